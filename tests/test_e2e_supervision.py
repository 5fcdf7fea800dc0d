"""
Node connectivity supervision and connection fencing with real processes:
late Edge, Edge restart, Node death mid-stream, a frozen link, fatal and
exhausted reconnects, clean shutdown.
"""

import json
import signal
import time

from support.daemons import echo_node, sse_events, wait_for
from support.proxy import FreezableProxy

EDGE = {"nodes": [echo_node("node-1", "tok-1", delay_ms=100)]}

RUN = {"adapter": "echo", "input": "one two three"}


def test_node_started_before_edge(launch):
    """
    A Node started while no Edge listens keeps retrying and connects once
    the Edge is up, then serves.
    """
    edge = launch.edge(EDGE, start=False)
    node = launch.node(edge.node_port, "tok-1", reconnect={"max_attempts": 0, "interval_sec": 0.3})
    wait_for(lambda: "attempt" in node.output(), what="a failed attempt to be logged")
    assert node.running()
    edge.start()
    edge.wait_connected("node-1")
    assert edge.run_events(RUN)[-1]["type"] == "complete"


def test_edge_restart(launch):
    """
    The Edge killed outright and started again: the Node comes back on
    its own and serves.
    """
    edge = launch.edge(EDGE)
    node = launch.node(edge.node_port, "tok-1", reconnect={"max_attempts": 0, "interval_sec": 0.3})
    edge.wait_connected("node-1")
    edge.stop(signal.SIGKILL)
    edge.start()
    edge.wait_connected("node-1")
    assert edge.run_events(RUN)[-1]["type"] == "complete"
    assert node.running()


def test_node_killed_mid_stream(launch):
    """
    A Node SIGKILLed mid-stream: the caller's stream ends with an `error`
    saying the node disconnected, within 2 s; the status shows it gone.
    """
    edge = launch.edge(EDGE)
    node = launch.node(edge.node_port, "tok-1")
    edge.wait_connected("node-1")
    conn, response = edge.stream("POST", "/v1/runs", {"adapter": "echo", "input": "word " * 300, "stream": True})
    try:
        events = sse_events(response)
        assert json.loads(next(events))["type"] == "start"
        node.stop(signal.SIGKILL)
        killed = time.monotonic()
        rest = [json.loads(p) for p in events]
        elapsed = time.monotonic() - killed
    finally:
        conn.close()
    assert rest[-1]["type"] == "error"
    assert rest[-1]["error"]["code"] == "node_disconnected"
    assert elapsed < 2.0
    assert edge.node_connected("node-1") is False


def test_frozen_link(launch):
    """
    A link that silently stops forwarding (no FIN, no RST): the Edge drops
    the Node within about 5 s by heartbeat, and once the link heals the
    Node is back and serving.
    """
    edge = launch.edge(EDGE)
    proxy = FreezableProxy(edge.node_port)
    try:
        launch.node(proxy.port, "tok-1", reconnect={"max_attempts": 0, "interval_sec": 0.5})
        edge.wait_connected("node-1")
        proxy.freeze()
        frozen = time.monotonic()
        edge.wait_connected("node-1", connected=False, timeout=10)
        assert time.monotonic() - frozen < 7.5
        proxy.heal()
        edge.wait_connected("node-1", timeout=30)
        assert edge.run_events(RUN)[-1]["type"] == "complete"
    finally:
        proxy.close()


def test_unknown_token_exits_nonzero(launch):
    """
    An unknown token is fatal: the Node exits non-zero, saying why.
    """
    edge = launch.edge(EDGE)
    node = launch.node(edge.node_port, "wrong-token")
    code = node.wait(timeout=20)
    assert code != 0
    assert "unknown token" in node.output()
    assert "wrong-token" not in edge.output()


def test_exhaustion_exits_nonzero(launch):
    """
    With max_attempts 2 and no Edge, the Node gives up with a non-zero
    status and says how many attempts failed.
    """
    edge = launch.edge(EDGE, start=False)
    node = launch.node(edge.node_port, "tok-1", reconnect={"max_attempts": 2, "interval_sec": 0.2})
    code = node.wait(timeout=20)
    assert code != 0
    assert "2" in node.output() and "attempt" in node.output()


def test_sigterm_and_sigint_exit_zero(launch):
    """
    SIGTERM and SIGINT are clean local shutdowns: exit status 0.
    """
    edge = launch.edge(EDGE)
    node = launch.node(edge.node_port, "tok-1")
    edge.wait_connected("node-1")
    assert node.stop(signal.SIGINT) == 0
    node = launch.node(edge.node_port, "tok-1")
    edge.wait_connected("node-1")
    assert node.stop(signal.SIGTERM) == 0
    assert edge.stop(signal.SIGTERM) == 0
