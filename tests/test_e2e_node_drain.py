"""
A Node stopped mid-stream with real processes: the first SIGTERM drains
(the stream finishes whole), a second one ends the drain at once (the
stream ends cancelled); either way the Node exits 0 and leaves no run
`running` in its store.
"""

import json
import os
import signal
import sqlite3

from support.daemons import echo_node, sse_events, wait_for

# 100 ms per word: a stream of N words takes N/10 seconds.
EDGE = {"nodes": [echo_node("node-1", "tok-1", delay_ms=100)]}


def start_node(launch, edge):
    node = launch.node(edge.node_port, "tok-1", extra={"shutdown_grace_sec": 60})
    edge.wait_connected("node-1")
    return node


def stream_with_sigterms(edge, node, text, count):
    """
    Stream a native run of C{text}; once it has started, send the Node
    SIGTERM C{count} times, each after the Node logged that it drains (two
    signals sent at once may reach the process as one).

    @return: every event of the stream, in order.
    """
    conn, response = edge.stream("POST", "/v1/runs", {"adapter": "echo", "input": text, "stream": True})
    try:
        events = sse_events(response)
        first = json.loads(next(events))
        assert first["type"] == "start"
        for _ in range(count):
            node.process.send_signal(signal.SIGTERM)
            wait_for(lambda: "draining:" in node.output(), what="the Node to drain")
        return [first] + [json.loads(p) for p in events]
    finally:
        conn.close()


def store_statuses(node):
    with sqlite3.connect(os.path.join(node.workdir, "runs.db")) as db:
        return [status for (status,) in db.execute("SELECT status FROM runs")]


def test_sigterm_lets_the_stream_finish(launch):
    """
    SIGTERM during a stream: the stream still ends `complete` with every
    word, the Node exits 0, and its store records the run as complete.
    """
    edge = launch.edge(EDGE)
    node = start_node(launch, edge)
    text = "word " * 20
    events = stream_with_sigterms(edge, node, text, 1)
    assert events[-1]["type"] == "complete"
    assert "".join(e.get("text", "") for e in events) == text
    assert node.wait(timeout=15) == 0
    assert store_statuses(node) == ["complete"]


def test_second_sigterm_ends_at_once(launch):
    """
    A second SIGTERM during the drain cancels the stream now (it would
    take 30 s): the caller gets `cancelled`, the Node exits 0, and its
    store records the run as cancelled.
    """
    edge = launch.edge(EDGE)
    node = start_node(launch, edge)
    events = stream_with_sigterms(edge, node, "word " * 300, 2)
    assert events[-1]["type"] == "cancelled"
    assert node.wait(timeout=15) == 0
    assert store_statuses(node) == ["cancelled"]
