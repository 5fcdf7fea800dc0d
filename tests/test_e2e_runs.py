"""
Runs that outlive their caller, on real processes: the Node's store (rows
of a killed Node, tunnels), background runs read back and resumed, a
background run that survives its Node's link being cut, the events feed
and the token metrics.
"""

import json
import os
import signal
import sqlite3

from support.daemons import echo_node, sse_events, wait_for

TEXT = "the quick brown fox jumps over the lazy dog"


def store_rows(node):
    with sqlite3.connect(os.path.join(node.workdir, "runs.db")) as db:
        db.row_factory = sqlite3.Row
        return [dict(row) for row in db.execute("SELECT * FROM runs ORDER BY started_at")]


def test_killed_node_marks_running_rows(launch):
    """
    A Node SIGKILLed in the middle of a run leaves its row `running`; when
    it starts again, that row becomes `error` with `node_restarted`.
    """
    edge = launch.edge({"nodes": [echo_node("node-1", "tok-1", delay_ms=200)]})
    node = launch.node(edge.node_port, "tok-1")
    edge.wait_connected("node-1")
    conn, response = edge.stream("POST", "/v1/runs", {"adapter": "echo", "input": "word " * 100, "stream": True})
    try:
        events = sse_events(response)
        assert json.loads(next(events))["type"] == "start"
        wait_for(lambda: [r["status"] for r in store_rows(node)] == ["running"], what="the run's row")
        node.stop(signal.SIGKILL)
    finally:
        conn.close()
    assert [r["status"] for r in store_rows(node)] == ["running"]
    node.start()
    edge.wait_connected("node-1")
    [row] = wait_for(lambda: [r for r in store_rows(node) if r["status"] != "running"], what="the row ended")
    assert (row["status"], row["error_code"]) == ("error", "node_restarted")
    assert row["ended_at"] is not None
