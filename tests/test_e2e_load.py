"""
A bounded load test on loopback: many concurrent streams through one Edge
and two Nodes, driven from one Twisted reactor with treq (pytest-twisted).
Every stream must come back whole and every counter must return to 0.
"""

import json

import pytest
import pytest_twisted
import treq
from support.daemons import echo_node
from twisted.internet import defer

STREAMS = 60


@pytest.fixture
def pool_edge(launch):
    providers = [{"id": "echo", "adapter": "echo", "capacity": {"normal": 4, "long": 0}}]
    nodes = [echo_node(n, f"tok-{n}", delay_ms=5, max_concurrency=4, providers=providers) for n in ("a", "b")]
    group = {
        "name": "chat",
        "providers": [{"node": n, "provider": "echo", "target": "t"} for n in ("a", "b")],
        "queue_timeout_sec": 60,
    }
    edge = launch.edge({"nodes": nodes, "model_groups": [group]})
    for n in ("a", "b"):
        launch.node(edge.node_port, f"tok-{n}")
    edge.wait_connected("a")
    edge.wait_connected("b")
    return edge


@pytest_twisted.inlineCallbacks
def test_concurrent_streams_complete_and_counters_return(pool_edge):
    """
    60 concurrent streamed completions over 8 slots: all complete with
    exactly their own text (none lost or mixed up), the queue absorbed the
    excess, and leases and queue are back to 0 afterwards.
    """
    url = pool_edge.base_url + "/v1/chat/completions"

    @defer.inlineCallbacks
    def one(i):
        text = f"stream {i} " + " ".join(f"w{i}-{k}" for k in range(20))
        body = {"model": "chat", "stream": True, "messages": [{"role": "user", "content": text}]}
        response = yield treq.post(url, json=body, unbuffered=True)
        raw = yield response.content()
        payloads = [line[6:] for line in raw.decode().split("\n") if line.startswith("data: ")]
        got = "".join(
            c["choices"][0]["delta"].get("content", "") for c in map(json.loads, payloads[:-1]) if c["choices"]
        )
        return response.code, payloads[-1], got == text

    results = yield defer.gatherResults([one(i) for i in range(STREAMS)], consumeErrors=True)
    assert all(code == 200 for code, _, _ in results)
    assert all(last == "[DONE]" for _, last, _ in results)
    assert all(same for _, _, same in results)
    response = yield treq.get(pool_edge.base_url + "/v1/status")
    status = yield response.json()
    assert all(p["in_use"] == {"normal": 0, "long": 0} for n in status["nodes"] for p in n["providers"])
    assert status["model_groups"][0]["queued"] == 0
