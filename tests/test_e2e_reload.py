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
    edge.config.setdefault("heartbeat", {})["interval_sec"] = 1
    edge.rewrite_config()
    edge.process.send_signal(signal.SIGHUP)
    wait_for(lambda: "heartbeat.interval_sec changed" in edge.output(), what="the refused reload to be logged")
    assert echo_capacity(edge) == 2
    assert edge.running()


def test_sighup_rotates_keys(launch):
    """
    Caller and admin keys apply from the next request after SIGHUP: a new
    key is let in, a removed one is refused, and the Node stays connected.
    """
    node = echo_node("node-1", "tok-1")
    edge = launch.edge({"nodes": [node], "admin_keys": ["adm"], "api_keys": ["old-key"]})
    launch.node(edge.node_port, "tok-1")
    edge.wait_connected("node-1")
    since = edge.status()["nodes"][0]["connected_since"]
    assert edge.json("GET", "/v1/models", None, {"authorization": "Bearer old-key"})[0] == 200

    edge.config["api_keys"] = ["new-key"]
    edge.config["admin_keys"] = ["new-adm"]
    edge.rewrite_config()
    edge.process.send_signal(signal.SIGHUP)

    def rotated():
        return edge.json("GET", "/v1/models", None, {"authorization": "Bearer new-key"})[0] == 200

    wait_for(rotated, what="the new caller key to be let in")
    status, body = edge.json("GET", "/v1/models", None, {"authorization": "Bearer old-key"})
    assert (status, body["error"]["code"]) == (401, "invalid_api_key")
    status, body = edge.json("POST", "/v1/nodes/node-1/commands", {"command": "capabilities"}, ADMIN)
    assert (status, body["error"]["code"]) == (403, "admin_key_required")
    status, _ = edge.json(
        "POST", "/v1/nodes/node-1/commands", {"command": "capabilities"}, {"authorization": "Bearer new-adm"}
    )
    assert status == 200
    assert edge.status()["nodes"][0]["connected_since"] == since
