"""
A back end that fails, through real `iop-edge` and `iop-node` processes,
against a real fault-injecting HTTP server (tests/support/fake_providers.py):
a cut, a stall, a silent provider, a malformed event, a stream without
[DONE], a context-length 400, a 429 with Retry-After and an outage that
recovers (seen by the probe command). Whatever the fault, the caller gets
the whole answer or an explicit, bounded error, never a truncated answer
that ends like a success; and after every case the leases are at rest.
"""

import http.client
import json
import time

import pytest
from support.daemons import sse_events, wait_for

CHAT = "/v1/chat/completions"
#: The deadlines of the adapter under test (seconds).
FIRST_BYTE = 1
STALL = 1

FAULT_MODELS = ("cut", "stall", "silent", "malformed", "nodone", "context", "busy")


@pytest.fixture
def faulty(launch, fake_provider):
    fake = fake_provider("openai", delay_ms=5)
    adapter = {
        "name": "a",
        "type": "openai_compat",
        "max_concurrency": 4,
        "base_url": fake.url("/v1"),
        "first_byte_timeout_sec": FIRST_BYTE,
        "stall_timeout_sec": STALL,
    }
    node = {"id": "gpu", "token": "tok", "adapters": [adapter], "providers": [{"id": "a"}]}
    groups = [
        {"name": name, "providers": [{"node": "gpu", "provider": "a", "target": f"{name}-model"}], "retries": 0}
        for name in FAULT_MODELS + ("fake",)
    ]
    edge = launch.edge({"nodes": [node], "model_groups": groups, "admin_keys": ["adm"]})
    launch.node(edge.node_port, "tok")
    edge.wait_connected("gpu")
    yield edge, fake
    wait_for(lambda: at_rest(edge), what="leases at rest")


def at_rest(edge):
    status = edge.status()
    in_use = [p["in_use"] for n in status["nodes"] for p in n["providers"]]
    return all(u == {"normal": 0, "long": 0} for u in in_use)


def chat(model, stream):
    return {"model": model, "stream": stream, "messages": [{"role": "user", "content": "say something"}]}


def streamed(edge, model):
    """
    A streamed chat completion read to its end. @return: C{(status,
    payloads, seconds)}.
    """
    started = time.monotonic()
    conn, response = edge.stream("POST", CHAT, chat(model, True))
    try:
        payloads = list(sse_events(response)) if response.status == 200 else [response.read().decode()]
        return response.status, payloads, time.monotonic() - started
    finally:
        conn.close()


def whole(edge, model):
    started = time.monotonic()
    status, headers, body = edge.request("POST", CHAT, chat(model, False))
    return status, headers, body, time.monotonic() - started


def error_code(payloads):
    """
    The code of the error event a stream ended with (before its [DONE]).
    """
    events = [json.loads(p) for p in payloads if p != "[DONE]"]
    return events[-1]["error"]["code"] if "error" in events[-1] else None


def test_cut(faulty):
    """
    A stream cut after its first event ends with an explicit incomplete
    error; a non-streamed answer cut mid-body is a 502 JSON error, never a
    200 with part of a body.
    """
    edge, _ = faulty
    status, payloads, _ = streamed(edge, "cut")
    assert status == 200
    assert error_code(payloads) == "incomplete"
    status, _, body, _ = whole(edge, "cut")
    assert status == 502
    assert json.loads(body)["error"]["code"] == "provider_error"


def test_stall(faulty):
    """
    A stream that stalls after a word ends incomplete within about
    stall_timeout_sec (not the 300 s idle timeout); a non-streamed answer
    that stalls mid-body is an error, its partial body never relayed.
    """
    edge, _ = faulty
    status, payloads, seconds = streamed(edge, "stall")
    assert status == 200
    assert any("partial" in p for p in payloads)
    assert error_code(payloads) == "incomplete"
    assert seconds < STALL + 5
    status, _, body, seconds = whole(edge, "stall")
    assert status in (502, 504)
    assert json.loads(body)["error"]["code"] == "provider_timeout"
    assert seconds < STALL + 5


def test_silent(faulty):
    """
    A provider that answers nothing fails at first_byte_timeout_sec with a
    bounded error, streamed or not for a normalized run; a non-streamed
    tunnel has no first-byte deadline and is bounded by the idle one (not
    waited for here).
    """
    edge, _ = faulty
    status, payloads, seconds = streamed(edge, "silent")
    assert status in (502, 504), payloads
    assert json.loads(payloads[0])["error"]["code"] == "provider_timeout"
    assert seconds < FIRST_BYTE + 5
    events = edge.run_events({"model": "silent", "input": "hello"})
    assert events[-1]["type"] == "error"
    assert events[-1]["error"]["code"] == "provider_timeout"
    assert all(e["type"] != "start" for e in events)


def test_malformed_event_never_passed_on(faulty):
    """
    The malformed event never reaches the caller; the stream ends with an
    explicit incomplete error after what came before it.
    """
    edge, _ = faulty
    status, payloads, _ = streamed(edge, "malformed")
    assert status == 200
    assert not any("not json" in p for p in payloads)
    assert any("partial" in p for p in payloads)
    assert error_code(payloads) == "incomplete"
    events = edge.run_events({"model": "malformed", "input": "hello"})
    assert [e["type"] for e in events][-1] == "error"
    assert events[-1]["error"]["code"] == "incomplete"


def test_finished_without_done(faulty):
    """
    A stream that says it finished but sends no [DONE] and keeps its
    connection open is ended promptly: the tunnel relays the provider's
    bytes and ends; a normalized run completes.
    """
    edge, _ = faulty
    status, payloads, seconds = streamed(edge, "nodone")
    assert status == 200
    assert json.loads(payloads[-1])["choices"][0]["finish_reason"] == "stop"
    assert seconds < 10
    events = edge.run_events({"model": "nodone", "input": "hello"})
    assert events[-1]["type"] == "complete"
    assert "".join(e.get("text", "") for e in events if e["type"] == "delta") == "partial "


def test_context_length_and_retry_after(faulty):
    """
    A context-length 400 ends a normalized run as context_length_exceeded;
    a 429 with Retry-After passes through a tunnel as the provider wrote it.
    """
    edge, fake = faulty
    events = edge.run_events({"model": "context", "input": "hello"})
    assert events[-1]["error"]["code"] == "context_length_exceeded"
    status, headers, body, _ = whole(edge, "busy")
    assert status == 429
    assert {k.lower(): v for k, v in headers.items()}["retry-after"] == "1"
    assert json.loads(body)["error"]["message"] == "busy, retry after 1 s"


def test_outage_that_recovers(faulty):
    """
    While the provider is down its 503 reaches the caller and the probe
    command says so; once it is back the probe says ok and answers flow.
    """
    edge, fake = faulty
    probe = {"command": "probe", "adapter": "a"}
    admin = {"authorization": "Bearer adm"}
    fake_post(fake, {"down": True})
    status, _, _, _ = whole(edge, "fake")
    assert status == 503
    status, answer = edge.json("POST", "/v1/nodes/gpu/commands", probe, admin)
    assert status == 200
    assert answer["result"]["ok"] is False and answer["result"]["status"] == 503
    fake_post(fake, {"down": False})
    status, answer = edge.json("POST", "/v1/nodes/gpu/commands", probe, admin)
    assert answer["result"] == {"ok": True}
    status, _, _, _ = whole(edge, "fake")
    assert status == 200


def fake_post(fake, body):
    conn = http.client.HTTPConnection("127.0.0.1", fake.port, timeout=10)
    try:
        conn.request("POST", "/_faults", body=json.dumps(body), headers={"content-type": "application/json"})
        assert conn.getresponse().status == 200
    finally:
        conn.close()
