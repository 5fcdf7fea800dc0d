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


def sse_with_ids(response):
    """
    Yield C{(id, payload)} for each event of an SSE response as it comes.
    """
    event_id, data = None, None
    while True:
        line = response.readline()
        if not line:
            return
        line = line.rstrip(b"\r\n")
        if line.startswith(b"id: "):
            event_id = int(line[4:])
        elif line.startswith(b"data: "):
            data = json.loads(line[6:])
        elif line == b"" and data is not None:
            yield event_id, data
            event_id, data = None, None


def run_state(edge, run_id):
    status, run = edge.json("GET", f"/v1/runs/{run_id}")
    assert status == 200, run
    return run


def test_background_run_survives_its_caller(launch):
    """
    A streamed background run whose caller disconnects after two events
    runs to its end; `GET /v1/runs/{id}` then returns the whole text and
    the usage.
    """
    edge = launch.edge({"nodes": [echo_node("node-1", "tok-1", delay_ms=50)]})
    launch.node(edge.node_port, "tok-1")
    edge.wait_connected("node-1")
    conn, response = edge.stream(
        "POST", "/v1/runs", {"adapter": "echo", "input": TEXT, "stream": True, "background": True}
    )
    run_id = response.getheader("x-iop-run-id")
    events = sse_with_ids(response)
    assert [next(events)[1]["type"] for _ in range(2)] == ["start", "delta"]
    conn.close()
    run = wait_for(lambda: run_state(edge, run_id)["status"] == "complete" and run_state(edge, run_id), what="the end")
    assert run["output"] == TEXT
    assert run["usage"] == {"input_tokens": len(TEXT.split()), "output_tokens": len(TEXT.split())}
    assert run["background"] is True and run["node"] == "node-1"


def test_resume_with_last_event_id(launch):
    """
    A background run started with 202; a reader of its events is cut off
    and reconnects with Last-Event-ID: it gets exactly the missing events
    (the texts concatenate to the input, no seq twice).
    """
    edge = launch.edge({"nodes": [echo_node("node-1", "tok-1", delay_ms=40)]})
    launch.node(edge.node_port, "tok-1")
    edge.wait_connected("node-1")
    text = " ".join(f"w{i}" for i in range(40))
    status, run = edge.json("POST", "/v1/runs", {"adapter": "echo", "input": text, "stream": False, "background": True})
    assert status == 202 and run["status"] in ("queued", "running"), run
    seen = []
    conn, response = edge.stream("GET", f"/v1/runs/{run['id']}/events", None)
    events = sse_with_ids(response)
    for _ in range(6):
        seen.append(next(events))
    conn.close()
    conn, response = edge.stream(
        "GET", f"/v1/runs/{run['id']}/events", None, headers={"last-event-id": str(seen[-1][0])}
    )
    try:
        seen.extend(sse_with_ids(response))
    finally:
        conn.close()
    seqs = [seq for seq, _ in seen]
    assert seqs == list(range(1, len(seen) + 1)), seqs
    assert "".join(p.get("text", "") for _, p in seen) == text
    assert seen[-1][1]["type"] == "complete"
