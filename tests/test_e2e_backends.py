"""
Real back ends through real `iop-edge` and `iop-node` processes, against
loopback fake providers: the raw tunnel byte for byte, error passthrough,
usage breakdowns, reasoning, Ollama and CLI runs on both surfaces,
cancellation reaching the provider or process, sessions, and the Node's
shared capacity gate.
"""

import http.client
import json
import os
import sys
import time

import pytest
from support.daemons import FAKE_CLI, sse_events, wait_for

CHAT = "/v1/chat/completions"


def provider(pid, adapter):
    """
    A provider with the capacity config fills in: its adapter's whole
    max_concurrency.
    """
    return {"id": pid, "adapter": adapter}


def group(name, pid, target):
    return {"name": name, "providers": [{"node": "gpu", "provider": pid, "target": target}], "queue_timeout_sec": 10}


@pytest.fixture
def backends(launch, fake_provider, tmp_path):
    openai_fake = fake_provider("openai", delay_ms=100)
    vllm_fake = fake_provider("vllm")
    ollama_fake = fake_provider("ollama")
    cli = [sys.executable, FAKE_CLI]
    pidfile = str(tmp_path / "cli.pid")
    node = {
        "id": "gpu",
        "token": "tok-gpu",
        "adapters": [
            {"name": "openai", "type": "openai_compat", "max_concurrency": 4, "base_url": openai_fake.url("/v1")},
            {"name": "vllm", "type": "vllm", "max_concurrency": 4, "base_url": vllm_fake.url("/v1")},
            {"name": "ollama", "type": "ollama", "max_concurrency": 4, "base_url": ollama_fake.url()},
            {
                "name": "agent",
                "type": "cli",
                "max_concurrency": 2,
                "command": cli,
                "env": {"FAKE_CLI_PIDFILE": pidfile},
            },
            {
                "name": "slow-agent",
                "type": "cli",
                "max_concurrency": 2,
                "command": cli,
                "env": {"FAKE_CLI_PIDFILE": pidfile, "FAKE_CLI_DELAY": "0.2"},
                "sessions": True,
                "grace_sec": 1,
            },
            {"name": "single", "type": "openai_compat", "max_concurrency": 1, "base_url": openai_fake.url("/v1")},
        ],
        "providers": [
            provider("openai", "openai"),
            provider("vllm", "vllm"),
            provider("ollama", "ollama"),
            provider("agent", "agent"),
            provider("slow-agent", "slow-agent"),
            provider("single", "single"),
        ],
    }
    groups = [
        group("gpt", "openai", "fake-model"),
        group("gpt-slow", "openai", "slow-model"),
        group("gpt-error", "openai", "error-model"),
        group("qwen", "vllm", "fake-model"),
        group("llama", "ollama", "fake-model"),
        group("agent", "agent", ""),
        group("slow-agent", "slow-agent", ""),
        group("llama-error", "ollama", "error-model"),
        group("single-slow", "single", "slow-model"),
    ]
    edge = launch.edge({"nodes": [node], "model_groups": groups, "admin_keys": ["adm"]})
    launch.node(edge.node_port, "tok-gpu")
    edge.wait_connected("gpu")
    return {"edge": edge, "openai": openai_fake, "vllm": vllm_fake, "ollama": ollama_fake, "pidfile": pidfile}


def direct(fake, path, body):
    conn = http.client.HTTPConnection("127.0.0.1", fake.port, timeout=30)
    try:
        conn.request("POST", path, body=json.dumps(body), headers={"content-type": "application/json"})
        response = conn.getresponse()
        return response.status, response.getheader("content-type"), response.read()
    finally:
        conn.close()


def chat_text(edge, model, text="hello tunnel world"):
    conn, response = edge.stream(
        "POST", CHAT, {"model": model, "stream": True, "messages": [{"role": "user", "content": text}]}
    )
    try:
        assert response.status == 200
        payloads = list(sse_events(response))
    finally:
        conn.close()
    assert payloads[-1] == "[DONE]"
    return "".join(
        c["choices"][0]["delta"].get("content") or "" for c in map(json.loads, payloads[:-1]) if c["choices"]
    )


@pytest.mark.parametrize("stream", [True, False])
def test_tunnel_bytes_identical_to_direct(backends, stream):
    """
    Through an openai_compat provider the caller gets the provider's own
    bytes: status, content type and body identical to a direct request
    (the Edge only rewrote `model` to the provider's target).
    """
    edge, fake = backends["edge"], backends["openai"]
    body = {"messages": [{"role": "user", "content": "bytes should pass through unchanged"}], "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    want = direct(fake, "/v1/chat/completions", dict(body, model="fake-model"))
    status, headers, got = edge.request("POST", CHAT, dict(body, model="gpt"))
    assert (status, headers.get("content-type") or headers.get("Content-Type"), got) == want
    assert want[0] == 200 and len(want[2]) > 50


def test_error_status_passthrough(backends):
    """
    A provider error status and body reach the caller unchanged.
    """
    edge, fake = backends["edge"], backends["openai"]
    body = {"messages": [{"role": "user", "content": "x"}]}
    want = direct(fake, "/v1/chat/completions", dict(body, model="error-model"))
    status, _, got = edge.request("POST", CHAT, dict(body, model="gpt-error"))
    assert want[0] == 429
    assert (status, got) == (want[0], want[2])


def test_usage_breakdown_only_when_reported(backends):
    """
    vLLM reports reasoning and cached tokens: they appear. The plain
    OpenAI fake does not: the fields are absent, not zero.
    """
    edge = backends["edge"]
    vllm_terminal = edge.run_events({"model": "qwen", "input": "count my tokens"})[-1]
    assert vllm_terminal["type"] == "complete"
    assert {"reasoning_tokens", "cached_input_tokens"} <= set(vllm_terminal["usage"])
    openai_terminal = edge.run_events({"model": "gpt", "input": "count my tokens"})[-1]
    assert openai_terminal["type"] == "complete"
    assert openai_terminal["usage"]["output_tokens"] > 0
    assert "reasoning_tokens" not in openai_terminal["usage"]
    assert "cached_input_tokens" not in openai_terminal["usage"]


def test_reasoning_deltas(backends):
    """
    vLLM's reasoning_content arrives as reasoning_delta events, apart from
    the answer's deltas.
    """
    events = backends["edge"].run_events({"model": "qwen", "input": "think first"})
    reasoning = "".join(e.get("text", "") for e in events if e["type"] == "reasoning_delta")
    answer = "".join(e.get("text", "") for e in events if e["type"] == "delta")
    assert reasoning and answer == "think first"


@pytest.mark.parametrize("model", ["llama", "agent"])
def test_ollama_and_cli_on_both_surfaces(backends, model):
    """
    Ollama and CLI back ends run as normalized runs through the native API
    and through /v1/chat/completions (rendered as OpenAI chunks).
    """
    edge = backends["edge"]
    events = edge.run_events({"model": model, "input": "hello from native"})
    assert events[0]["type"] == "start" and events[-1]["type"] == "complete"
    assert "".join(e.get("text", "") for e in events if e["type"] == "delta").strip() == "hello from native"
    assert chat_text(edge, model, "hello from openai").strip() == "hello from openai"
    status, body = edge.json("POST", CHAT, {"model": model, "messages": [{"role": "user", "content": "once more"}]})
    assert status == 200 and body["choices"][0]["message"]["content"].strip() == "once more"


def test_ollama_usage_and_commands(backends):
    """
    Ollama's final counts become usage; its model API is reachable as a
    node command (admin key required).
    """
    edge = backends["edge"]
    terminal = edge.run_events({"model": "llama", "input": "one two"})[-1]
    assert terminal["usage"]["input_tokens"] > 0 and terminal["usage"]["output_tokens"] > 0
    status, _ = edge.json("POST", "/v1/nodes/gpu/commands", {"command": "ollama_list", "adapter": "ollama"})
    assert status == 403
    status, body = edge.json(
        "POST",
        "/v1/nodes/gpu/commands",
        {"command": "ollama_list", "adapter": "ollama"},
        {"authorization": "Bearer adm"},
    )
    assert status == 200, body
    assert "models" in body["result"]


def test_caller_disconnect_closes_provider_connection(backends):
    """
    A caller that goes away mid-stream cancels the tunnel: the provider
    sees its connection closed within 2 s, and the lease returns.
    """
    edge, fake = backends["edge"], backends["openai"]
    conn, response = edge.stream(
        "POST",
        CHAT,
        {"model": "gpt-slow", "stream": True, "max_tokens": 200, "messages": [{"role": "user", "content": "a b c"}]},
    )
    assert response.status == 200
    response.readline()
    assert fake.stats()["active"] == 1
    conn.sock.close()
    conn.close()
    closed = time.monotonic()
    wait_for(lambda: fake.stats()["closed_early"] >= 1, timeout=5, what="the provider connection to close")
    assert time.monotonic() - closed < 2.0
    wait_for(lambda: all(p["in_use"]["normal"] == 0 for p in edge.status()["nodes"][0]["providers"]), what="lease back")


def test_cli_cancel_kills_process(backends):
    """
    Cancelling a CLI run stops its process and ends the run `cancelled`.
    """
    edge, pidfile = backends["edge"], backends["pidfile"]
    conn, response = edge.stream(
        "POST", "/v1/runs", {"adapter": "slow-agent", "node": "gpu", "input": "w " * 100, "stream": True}
    )
    try:
        events = sse_events(response)
        first = json.loads(next(events))
        wait_for(lambda: os.path.exists(pidfile) and open(pidfile).read(), what="the process to start")
        pid = int(open(pidfile).read())
        os.kill(pid, 0)
        assert edge.json("POST", f"/v1/runs/{first['run_id']}/cancel", {})[0] == 200
        rest = [json.loads(p) for p in events]
    finally:
        conn.close()
    assert rest[-1]["type"] == "cancelled"
    wait_for(lambda: not _alive(pid), timeout=5, what="the CLI process to be gone")


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is gone for our purposes: reaped by the node soon.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_terminate_session(backends):
    """
    A CLI session is terminated through the native API; terminating it
    again (or a session that never existed) is `terminated: false` with
    404; an adapter without sessions answers "not supported" with 400.
    """
    edge = backends["edge"]
    events = edge.run_events({"adapter": "slow-agent", "node": "gpu", "input": "hi", "session_id": "s-1"})
    assert events[-1]["type"] == "complete"
    assert "[session s-1]" in "".join(e.get("text", "") for e in events)
    status, body = edge.json(
        "POST", "/v1/sessions/terminate", {"node": "gpu", "adapter": "slow-agent", "session_id": "s-1"}
    )
    assert status == 200 and body["terminated"] is True, body
    for session_id in ("s-1", "never-was"):
        status, body = edge.json(
            "POST", "/v1/sessions/terminate", {"node": "gpu", "adapter": "slow-agent", "session_id": session_id}
        )
        assert (status, body["terminated"], body["error"]["code"]) == (404, False, "unknown_session"), body
    status, body = edge.json(
        "POST", "/v1/sessions/terminate", {"node": "gpu", "adapter": "openai", "session_id": "s-1"}
    )
    assert (status, body["terminated"], body["error"]["code"]) == (400, False, "not_supported"), body
    assert "not support" in body["reason"]


def test_tunnel_and_direct_run_share_one_ledger(backends):
    """
    On an adapter with max_concurrency 1, a pooled tunnel and a run sent to
    the adapter by name lease from the same resource: the run waits in the
    queue while the tunnel streams, then completes; they never overlap at
    the provider and the Node's gate never refuses.
    """
    edge, fake = backends["edge"], backends["openai"]
    before = fake.stats()["max_active"]
    assert before <= 1
    conn, response = edge.stream(
        "POST",
        CHAT,
        {"model": "single-slow", "stream": True, "max_tokens": 20, "messages": [{"role": "user", "content": "a b"}]},
    )
    try:
        assert response.status == 200
        response.readline()
        status = edge.status()
        (single,) = [p for p in status["nodes"][0]["providers"] if p["id"] == "single"]
        assert single["in_use"]["normal"] == 1
        events = edge.run_events({"adapter": "single", "node": "gpu", "target": "slow-model", "input": "x"})
        assert events[-1]["type"] == "complete"
        response.read()
    finally:
        conn.close()
    assert fake.stats()["max_active"] == 1


def test_normalized_provider_error_keeps_status(backends):
    """
    A provider error on a normalized run (Ollama, unknown model) reaches an
    OpenAI caller with the provider's status, in OpenAI error form.
    """
    edge = backends["edge"]
    status, body = edge.json(
        "POST", "/v1/runs", {"adapter": "ollama", "node": "gpu", "target": "error-model", "input": "x", "stream": False}
    )
    assert status == 200 and body["status"] == "error"
    provider_status = body["events"][-1]["error"]["status"]
    assert provider_status == 404
    status, body = edge.json("POST", CHAT, {"model": "llama-error", "messages": [{"role": "user", "content": "x"}]})
    assert status == provider_status
    assert body["error"]["code"] == "provider_error"


def test_non_streaming_caller_disconnect_kills_cli_process(backends):
    """
    A caller that disconnects from a non-streaming completion cancels the
    run: the CLI process is stopped and the lease returns.
    """
    edge, pidfile = backends["edge"], backends["pidfile"]
    conn = http.client.HTTPConnection("127.0.0.1", edge.http_port, timeout=30)
    body = {"model": "slow-agent", "messages": [{"role": "user", "content": "w " * 100}]}
    conn.request("POST", CHAT, body=json.dumps(body), headers={"content-type": "application/json"})
    wait_for(lambda: os.path.exists(pidfile) and open(pidfile).read(), what="the process to start")
    pid = int(open(pidfile).read())
    conn.sock.close()
    conn.close()
    wait_for(lambda: not _alive(pid), timeout=5, what="the CLI process to be gone")
    wait_for(lambda: all(p["in_use"]["normal"] == 0 for p in edge.status()["nodes"][0]["providers"]), what="lease back")
