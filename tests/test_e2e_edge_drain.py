"""
An Edge SIGTERM drains instead of cutting: real `twistd -n iop-edge` and
`iop-node` processes, a caller streaming through them.
"""

import json
import signal
import socket

from support.daemons import echo_node, sse_events, wait_for

WORDS = " ".join(f"w{i}" for i in range(30))


def start_pair(launch, delay_ms, grace):
    edge = launch.edge({"nodes": [echo_node("node-1", "tok-1", delay_ms=delay_ms)], "shutdown_grace_sec": grace})
    node = launch.node(edge.node_port, "tok-1")
    edge.wait_connected("node-1")
    return edge, node


def open_stream(edge):
    conn, response = edge.stream(
        "POST",
        "/v1/chat/completions",
        {"model": "echo", "stream": True, "messages": [{"role": "user", "content": WORDS}]},
    )
    assert response.status == 200
    return conn, response, sse_events(response)


def stream_through_stop(edge, signals):
    """
    Open a stream, read its first chunk, send the Edge C{signals} SIGTERMs
    (after the first, once it refuses new connections) and read the rest.

    @return: every C{data:} payload of the stream.
    """
    conn, _, events = open_stream(edge)
    try:
        first = next(events)
        for _ in range(signals):
            edge.process.send_signal(signal.SIGTERM)
            wait_for(lambda: refuses_connections(edge.http_port), timeout=10, what="HTTP listener closed")
        return [first, *events]
    finally:
        conn.close()


def assert_clean_exit(edge):
    assert edge.wait(timeout=20) == 0
    assert "Traceback" not in edge.output()


def refuses_connections(port):
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except ConnectionRefusedError:
        return True
    return False


def test_stream_within_grace_completes_whole(launch):
    """
    A stream in progress when the Edge gets SIGTERM goes on to its last
    chunk and `[DONE]`, while new HTTP connections are refused; the Edge
    then exits 0 and the Node keeps running.
    """
    edge, node = start_pair(launch, delay_ms=60, grace=30)
    payloads = stream_through_stop(edge, signals=1)
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == WORDS
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert_clean_exit(edge)
    assert node.running()


def test_stream_outliving_grace_ends_with_terminal(launch):
    """
    A stream that outlives `shutdown_grace_sec` is ended with an error
    event naming `shutting_down` and `[DONE]`, never cut; exit status 0.
    """
    edge, _ = start_pair(launch, delay_ms=300, grace=1)
    payloads = stream_through_stop(edge, signals=1)
    assert payloads[-1] == "[DONE]"
    assert json.loads(payloads[-2])["error"]["code"] == "shutting_down"
    assert_clean_exit(edge)


def test_second_signal_ends_drain_at_once(launch):
    """
    A second SIGTERM during a drain ends it at once: the stream gets its
    terminal long before the 60 s grace, and the Edge exits 0.
    """
    edge, _ = start_pair(launch, delay_ms=300, grace=60)
    payloads = stream_through_stop(edge, signals=2)
    assert payloads[-1] == "[DONE]"
    assert json.loads(payloads[-2])["error"]["code"] == "shutting_down"
    assert_clean_exit(edge)
