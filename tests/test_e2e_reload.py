"""
SIGHUP makes a running Edge re-read edge.yaml and push adapter changes to
its connected Nodes, without a restart or a reconnect.
"""

import signal

from support.daemons import echo_node, wait_for

ADMIN = {"authorization": "Bearer adm"}


def echo_capacity(edge):
    status, body = edge.json("POST", "/v1/nodes/node-1/commands", {"command": "capabilities"}, ADMIN)
    assert status == 200, body
    return {a["name"]: a["max_concurrency"] for a in body["result"]["adapters"]}["echo"]


def test_sighup_pushes_adapter_changes(launch):
    """
    Changing an adapter's max_concurrency and sending SIGHUP reaches the
    Node as a config refresh on the same connection; a change that needs a
    restart, or one whose providers would promise more than the adapter
    takes, is refused and logged naming the key, and the Edge keeps serving.
    """
    providers = [{"id": "echo", "adapter": "echo", "capacity": {"normal": 2}}]
    node = echo_node("node-1", "tok-1", max_concurrency=4, providers=providers)
    edge = launch.edge({"nodes": [node], "admin_keys": ["adm"]})
    launch.node(edge.node_port, "tok-1")
    edge.wait_connected("node-1")
    assert echo_capacity(edge) == 4
    since = edge.status()["nodes"][0]["connected_since"]

    edge.config["nodes"][0]["adapters"][0]["max_concurrency"] = 2
    edge.rewrite_config()
    edge.process.send_signal(signal.SIGHUP)
    wait_for(lambda: echo_capacity(edge) == 2, what="the node to apply the refresh")
    assert edge.status()["nodes"][0]["connected_since"] == since

    edge.config["nodes"][0]["adapters"][0]["max_concurrency"] = 1
    edge.rewrite_config()
    edge.process.send_signal(signal.SIGHUP)
    wait_for(lambda: "providers[0].capacity" in edge.output(), what="the over-declared reload to be refused")
    assert echo_capacity(edge) == 2

    edge.config["nodes"][0]["adapters"][0]["max_concurrency"] = 2
    edge.config["admin_keys"] = ["other"]
    edge.rewrite_config()
    edge.process.send_signal(signal.SIGHUP)
    wait_for(lambda: "admin_keys changed" in edge.output(), what="the refused reload to be logged")
    assert echo_capacity(edge) == 2
    assert edge.running()
