"""
log_format: json on real daemons: every line either daemon writes is one
JSON object, and the lines an operator acts on carry the node, run or
tunnel id and the reason as fields.
"""

import json
import signal

from support.daemons import echo_node, wait_for


def json_lines(daemon):
    lines = [line for line in daemon.output().splitlines() if line.strip()]
    return [json.loads(line) for line in lines]


def test_json_lines(launch):
    """
    With log_format: json on both sides: the Edge logs the node's
    registration and readiness with a node field, a run cut by the Node's
    loss with run_id, node, code and reason, and the disconnect with its
    reason; the Node logs JSON too; no line is anything but JSON.
    """
    edge = launch.edge({"nodes": [echo_node("node-1", "tok-1", delay_ms=200)], "log_format": "json"})
    node = launch.node(edge.node_port, "tok-1", extra={"log_format": "json"})
    edge.wait_connected("node-1")
    conn, response = edge.stream("POST", "/v1/runs", {"adapter": "echo", "input": "a b c d e f g h", "stream": True})
    try:
        assert response.status == 200
        response.readline()  # the first event: the run is in flight
        node.stop(signal.SIGKILL)
        response.read()
    finally:
        conn.close()
    edge.wait_connected("node-1", connected=False)
    edge.stop()

    records = json_lines(edge)
    assert {r["daemon"] for r in records} == {"iop-edge"}
    ready = [r for r in records if r.get("node") == "node-1" and "ready" in r["message"]]
    assert ready and ready[0]["level"] == "info"
    (failed,) = [r for r in records if r.get("run_id") and r.get("code") == "node_disconnected"]
    assert failed["node"] == "node-1" and failed["reason"] and failed["level"] == "warn"
    lost = [r for r in records if r.get("node") == "node-1" and "disconnected" in r["message"]]
    assert lost and lost[0]["reason"]
    node_records = wait_for(lambda: json_lines(node), what="the Node's log")
    assert {r["daemon"] for r in node_records} == {"iop-node"}
    assert any("connecting to the Edge" in r["message"] for r in node_records)
