"""
Several caller keys sharing one gateway, on real processes: a light
tenant is not stuck behind a heavy tenant's backlog, a waiting stream is
told its place, a token budget refuses with Retry-After, and the queue
view shows each key its own work.
"""

import json
import statistics
import time

from support.daemons import echo_node, wait_for

HEAVY = {"authorization": "Bearer sk-heavy"}
LIGHT = {"authorization": "Bearer sk-light"}
ADMIN = {"authorization": "Bearer sk-admin"}
TEXT = " ".join(f"w{i}" for i in range(10))


def tenants_edge(launch):
    """
    One echo node with 2 slots (100 ms per word: about a second per
    request) shared by a heavy, a light and a thrifty key.
    """
    config = {
        "api_keys": [
            {"key": "sk-heavy", "name": "heavy"},
            {"key": "sk-light", "name": "light"},
            {"key": "sk-thrifty", "name": "thrifty", "tokens_per_minute": 300},
        ],
        "admin_keys": [{"key": "sk-admin", "name": "ops"}],
        "nodes": [echo_node("n1", "tok-n1", delay_ms=100, max_concurrency=2)],
        "model_groups": [{"name": "m", "providers": [{"node": "n1", "provider": "echo"}], "queue_timeout_sec": 120}],
    }
    edge = launch.edge(config)
    launch.node(edge.node_port, "tok-n1")
    edge.wait_connected("n1")
    return edge


def chat(stream=True, **extra):
    return dict({"model": "m", "stream": stream, "messages": [{"role": "user", "content": TEXT}]}, **extra)


def timed_stream(edge, headers):
    """
    One streamed completion read to its end. @return: (seconds until its
    first chunk, seconds from then to the end, the queue comments seen).
    """
    sent = time.monotonic()
    conn, response = edge.stream("POST", "/v1/chat/completions", chat(), headers, timeout=120)
    try:
        assert response.status == 200, response.read()
        comments, first, done = [], None, False
        for _ in range(10_000):
            line = response.readline()
            if not line:
                break
            if line.startswith(b": queued"):
                comments.append(line.decode().strip())
            elif line.startswith(b"data: ") and first is None:
                first = time.monotonic()
            if line.startswith(b"data: [DONE]"):
                done = True
                break
        assert done and first is not None
        return first - sent, time.monotonic() - first, comments
    finally:
        conn.close()


def test_light_tenant_beside_a_heavy_backlog(launch):
    """
    A heavy key with 30 queued streams and a light key sending one request
    after another (with a pause between them, as a person or a pipeline
    does) on 2 slots: the light key's median wait is at most one service
    time (its request's time alone), not the heavy backlog's 15; each
    waiting stream hears its place; every lease is back at rest afterwards.
    """
    edge = tenants_edge(launch)
    alone, service, _ = timed_stream(edge, LIGHT)
    service_time = alone + service
    heavy = []
    try:
        for _ in range(30):
            heavy.append(edge.stream("POST", "/v1/chat/completions", chat(), HEAVY, timeout=120))
        wait_for(lambda: edge.status_with("sk-admin")["model_groups"][0]["queued"] >= 28, what="the heavy backlog")
        waits, heard = [], []
        for pause in (0.2, 0.6, 0.4, 0.8, 0.3):
            time.sleep(pause)  # the light caller's own pace, not synchronization
            wait, _, comments = timed_stream(edge, LIGHT)
            waits.append(wait)
            heard.extend(comments)
        status, view = edge.json("GET", "/v1/queue", headers=ADMIN)
        assert status == 200 and view["by_key"].get("heavy", 0) >= 5, view
        status, own = edge.json("GET", "/v1/queue", headers=LIGHT)
        assert (status, own["key"], own["queued"]) == (200, "light", []), own
    finally:
        for conn, _ in heavy:
            conn.close()
    assert statistics.median(waits) <= service_time, (waits, service_time)
    assert heard and all(c.startswith(": queued position=1 eta_ms=") for c in heard), heard
    wait_for(
        lambda: edge.status_with("sk-admin")["nodes"][0]["providers"][0]["in_use"] == {"normal": 0, "long": 0},
        timeout=30,
        what="leases at rest",
    )
    assert edge.status_with("sk-admin")["model_groups"][0]["queued"] == 0


def test_token_budget_on_live_daemons(launch):
    """
    A key over its tokens_per_minute is refused with 429
    token_budget_exceeded and a Retry-After: the 20 tokens its first
    request spent leave less than the second one's estimate (its input and
    max_tokens); another key is not affected.
    """
    edge = tenants_edge(launch)
    thrifty = {"authorization": "Bearer sk-thrifty"}
    status, _, _ = edge.request("POST", "/v1/chat/completions", chat(stream=False, max_tokens=290), thrifty)
    assert status == 200
    status, headers, body = edge.request("POST", "/v1/chat/completions", chat(stream=False, max_tokens=290), thrifty)
    assert status == 429, body
    assert json.loads(body)["error"]["code"] == "token_budget_exceeded"
    assert int(headers["Retry-After"]) >= 1
    status, _, _ = edge.request("POST", "/v1/chat/completions", chat(stream=False, max_tokens=200), LIGHT)
    assert status == 200
