"""
Backpressure on real processes (issue 12, finding 9): a caller that stops
reading a large tunnelled stream holds the Edge and the Node to about one
flow-control window each, and the provider to what the sockets between
hold, instead of the Edge buffering the provider's whole response. When
the caller reads again, the whole stream arrives.
"""

import json
import os
import socket
import time

import pytest
from support.probes import rss_bytes

PIECES = 1024  # 64 MiB from the provider
MiB = 1024 * 1024


@pytest.fixture
def big(launch, fake_provider):
    fake = fake_provider("openai")
    node = {
        "id": "gpu",
        "token": "tok-gpu",
        "adapters": [{"name": "openai", "type": "openai_compat", "max_concurrency": 2, "base_url": fake.url("/v1")}],
        "providers": [{"id": "openai", "adapter": "openai", "capacity": {"normal": 2, "long": 0}}],
    }
    groups = [{"name": "big", "providers": [{"node": "gpu", "provider": "openai", "target": "big-model"}]}]
    edge = launch.edge({"nodes": [node], "model_groups": groups})
    node_daemon = launch.node(edge.node_port, "tok-gpu")
    edge.wait_connected("gpu")
    return edge, node_daemon, fake


def open_stream(port):
    """
    A caller with a small receive buffer that sent a streamed request.
    """
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 * 1024)
    sock.settimeout(30)
    sock.connect(("127.0.0.1", port))
    body = json.dumps(
        {"model": "big", "stream": True, "max_tokens": PIECES, "messages": [{"role": "user", "content": "go"}]}
    ).encode()
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: e\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n" % len(body) + body
    )
    return sock


def read(sock, size):
    got = 0
    while got < size:
        data = sock.recv(min(65536, size - got))
        if not data:
            break
        got += len(data)
    return got


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs /proc")
def test_slow_caller_on_a_large_tunnel(big):
    """
    The caller reads 256 KiB and then nothing for 3 s: the provider has
    written far less than its 64 MiB, and neither daemon grew by more
    than 24 MiB. Reading on, the caller gets the whole stream.
    """
    edge, node, fake = big
    edge_before, node_before = rss_bytes(edge.pid), rss_bytes(node.pid)
    sock = open_stream(edge.http_port)
    try:
        assert read(sock, 256 * 1024) == 256 * 1024
        edge_peak, node_peak = edge_before, node_before
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            time.sleep(0.2)
            edge_peak = max(edge_peak, rss_bytes(edge.pid))
            node_peak = max(node_peak, rss_bytes(node.pid))
        written = fake.stats()["big_bytes"]
        assert written < 16 * MiB, f"the provider wrote {written} bytes to a caller that reads nothing"
        assert edge_peak - edge_before < 24 * MiB, (edge_before, edge_peak)
        assert node_peak - node_before < 24 * MiB, (node_before, node_peak)
        tail = b""
        total = 256 * 1024
        while True:
            data = sock.recv(65536)
            if not data:
                break
            total += len(data)
            tail = (tail + data)[-64:]
            if b"data: [DONE]" in tail:
                break
        assert b"data: [DONE]" in tail
        assert total > PIECES * 64 * 1024
        assert fake.stats()["big_bytes"] == PIECES * 64 * 1024
    finally:
        sock.close()
