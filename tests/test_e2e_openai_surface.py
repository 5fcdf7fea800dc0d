"""
A faithful OpenAI surface on real processes: the caller's headers reach
the provider by one rule, the provider's come back unchanged, and every
endpoint a tunnel can carry is byte-identical to asking the provider
directly; embeddings also work on an Ollama provider, in OpenAI's shape.
"""

import http.client
import json

import openai
import pytest
from support.daemons import free_port, sse_events, wait_for

PROVIDER_KEY = "pk-provider"


@pytest.fixture
def surface(launch, fake_provider):
    llm = fake_provider("openai", delay_ms=5)
    ollama = fake_provider("ollama", delay_ms=5)
    node = {
        "id": "gpu",
        "token": "tok-gpu",
        "adapters": [
            {
                "name": "llm",
                "type": "openai_compat",
                "max_concurrency": 4,
                "base_url": llm.url("/v1"),
                "api_key": PROVIDER_KEY,
                "headers": {"X-Team": "ops"},
                "drop_headers": ["X-Secret"],
            },
            {"name": "ollama", "type": "ollama", "max_concurrency": 2, "base_url": ollama.url()},
        ],
        "providers": [{"id": "llm", "adapter": "llm"}, {"id": "ollama", "adapter": "ollama"}],
    }
    groups = [
        {"name": "big", "providers": [{"node": "gpu", "provider": "llm", "target": "fake-model"}]},
        {"name": "local", "providers": [{"node": "gpu", "provider": "ollama", "target": "fake-model"}]},
    ]
    edge = launch.edge({"nodes": [node], "model_groups": groups, "api_keys": ["edge-key"]})
    launch.node(edge.node_port, "tok-gpu")
    edge.wait_connected("gpu")
    return edge, llm, ollama


def post(port, path, body, headers=None):
    """
    One POST; @return: C{(status, [(name, value)] as received, body bytes)}.
    """
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request(
            "POST",
            path,
            body=json.dumps(body).encode(),
            headers={"content-type": "application/json", **(headers or {})},
        )
        response = conn.getresponse()
        return response.status, response.getheaders(), response.read()
    finally:
        conn.close()


EDGE = {"authorization": "Bearer edge-key"}


def comparable(headers):
    """
    Header pairs as a caller compares them: names lowercased; C{Date}
    left out (it is a clock, not the provider's answer), and the Edge's
    own C{Server-Timing} (checked apart: it says where the time went).
    """
    return [(name.lower(), value) for name, value in headers if name.lower() not in ("date", "server-timing")]


def test_caller_headers_reach_the_provider(surface):
    """
    End-to-end caller headers (a trace header, the SDK's identification)
    reach the provider; the caller's Authorization (for the Edge) does not
    (the adapter's api_key replaces it); drop_headers are dropped and the
    adapter's own headers win.
    """
    edge, llm, _ = surface
    caller = {
        "X-Trace": "t-1",
        "User-Agent": "OpenAI/Python 2.0",
        "OpenAI-Organization": "org-1",
        "x-stainless-lang": "python",
        "X-Secret": "s",
        "X-Team": "caller",
        **EDGE,
    }
    body = {"model": "big", "messages": [{"role": "user", "content": "hi"}]}
    status, _, _ = post(edge.http_port, "/v1/chat/completions", body, caller)
    assert status == 200
    seen = {name.lower(): value for name, value in llm.requests()[-1]["headers"]}
    assert seen["x-trace"] == "t-1"
    assert seen["user-agent"] == "OpenAI/Python 2.0"
    assert seen["openai-organization"] == "org-1"
    assert seen["x-stainless-lang"] == "python"
    assert seen["authorization"] == f"Bearer {PROVIDER_KEY}"
    assert seen["x-team"] == "ops"
    assert "x-secret" not in seen


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "one two three"}]}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "one two three"}], "stream": True}),
        ("/v1/completions", {"prompt": "one two three"}),
        ("/v1/completions", {"prompt": "one two three", "stream": True}),
        ("/v1/embeddings", {"input": ["a", "bb"]}),
        ("/v1/responses", {"input": "one two three"}),
        ("/v1/responses", {"input": "one two three", "stream": True}),
    ],
)
def test_tunnel_identical_to_direct(surface, path, body):
    """
    Every endpoint a tunnel carries answers through the Edge exactly as the
    provider answers directly: status, headers (but Date; the Edge adds its
    Server-Timing) and body bytes.
    """
    edge, llm, _ = surface
    direct = post(llm.port, path, dict(body, model="fake-model"))
    relayed = post(edge.http_port, path, dict(body, model="big"), EDGE)
    assert relayed[0] == direct[0] == 200
    assert relayed[2] == direct[2]
    assert comparable(relayed[1]) == comparable(direct[1])
    timing = [value for name, value in relayed[1] if name.lower() == "server-timing"]
    assert len(timing) == 1 and "provider;dur=" in timing[0], timing


def test_embeddings_on_ollama(surface):
    """
    Embeddings on an Ollama provider go through its native /api/embed and
    come back in OpenAI's shape, readable by the official SDK.
    """
    edge, _, ollama = surface
    client = openai.OpenAI(base_url=edge.base_url + "/v1", api_key="edge-key", max_retries=0)
    result = client.embeddings.create(model="local", input=["a", "bbb"])
    assert [d.embedding for d in result.data] == [[1.0, 0.5, -0.25], [3.0, 0.5, -0.25]]
    assert result.usage.prompt_tokens == 4
    assert ollama.requests()[-1]["path"] == "/api/embed"


def test_endpoint_no_provider_serves_is_400(surface):
    """
    A model group whose providers cannot carry an endpoint (Ollama has no
    completions) answers 400 naming the endpoint, not 404.
    """
    edge, _, _ = surface
    status, _, body = post(edge.http_port, "/v1/completions", {"model": "local", "prompt": "x"}, EDGE)
    error = json.loads(body)["error"]
    assert (status, error["code"]) == (400, "unsupported_endpoint")
    assert "/v1/completions" in error["message"]


def test_failover_ejection_and_return(launch, fake_provider):
    """
    A group of two providers whose first refuses connections: every
    request succeeds (placed again on the second), the first is ejected and
    shown so with its last error, and once it is up again it is tried after
    its cooldown and healthy on its first answer. A failure after the first
    byte is not retried: the caller gets it, as an incomplete answer.
    """
    down_port = free_port()
    healthy = fake_provider("openai", delay_ms=5)
    adapters = [
        {"name": "a", "type": "openai_compat", "max_concurrency": 2, "base_url": f"http://127.0.0.1:{down_port}/v1"},
        {"name": "b", "type": "openai_compat", "max_concurrency": 2, "base_url": healthy.url("/v1")},
    ]
    node = {"id": "gpu", "token": "tok", "adapters": adapters, "providers": [{"id": "a"}, {"id": "b"}]}
    group = {"name": "m", "providers": [{"node": "gpu", "provider": p, "target": "fake-model"} for p in ("a", "b")]}
    cut = {"name": "cut", "providers": [{"node": "gpu", "provider": "b", "target": "cut-model"}]}
    edge = launch.edge({"nodes": [node], "model_groups": [group, cut], "health": {"cooldown_sec": 1}})
    launch.node(edge.node_port, "tok")
    edge.wait_connected("gpu")
    body = {"model": "m", "messages": [{"role": "user", "content": "one two"}]}
    for _ in range(4):
        status, _, answer = post(edge.http_port, "/v1/chat/completions", body)
        assert status == 200, answer
    providers = {p["id"]: p for p in edge.status()["nodes"][0]["providers"]}
    assert providers["a"]["health"] == "ejected"
    assert providers["a"]["last_error"].startswith("provider_unreachable")
    assert providers["b"]["health"] == "ok"
    metrics = edge.request("GET", "/metrics")[2].decode()
    assert 'iop_edge_provider_ejections_total{node="gpu",provider="a"} 1.0' in metrics
    assert 'iop_edge_retries_total{node="gpu",provider="a"}' in metrics

    revived = fake_provider("openai", delay_ms=5, port=down_port)

    def a_answered():
        post(edge.http_port, "/v1/chat/completions", body)
        return revived.stats()["requests"] > 0

    wait_for(a_answered, timeout=15, what="the revived provider to be tried again")
    provider = {p["id"]: p for p in edge.status()["nodes"][0]["providers"]}["a"]
    assert provider["health"] == "ok" and "last_error" not in provider

    before = healthy.stats()["requests"]
    conn, response = edge.stream(
        "POST", "/v1/chat/completions", {"model": "cut", "stream": True, "messages": [{"role": "user", "content": "x"}]}
    )
    try:
        assert response.status == 200
        payloads = list(sse_events(response))
    finally:
        conn.close()
    assert payloads[-1] == "[DONE]"
    assert json.loads(payloads[-2])["error"]["code"] == "incomplete"
    assert healthy.stats()["requests"] == before + 1


TOOLS = [
    {
        "type": "function",
        "function": {"name": "lookup", "description": "look it up", "parameters": {"type": "object", "properties": {}}},
    }
]


def test_tool_calls_through_ollama(surface):
    """
    A tool-calling exchange with an Ollama provider (a normalized run)
    speaks OpenAI: the official SDK reads the model's tool call, streamed
    and not, with finish_reason tool_calls; the tool's result goes back as
    a tool message and the answer uses it; images reach Ollama as base64.
    """
    edge, _, ollama = surface
    client = openai.OpenAI(base_url=edge.base_url + "/v1", api_key="edge-key", max_retries=0)
    question = [{"role": "user", "content": "weather in Oslo"}]
    reply = client.chat.completions.create(model="local", messages=question, tools=TOOLS)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "lookup"
    assert json.loads(call.function.arguments) == {"question": "weather in Oslo"}

    stream = client.chat.completions.create(model="local", messages=question, tools=TOOLS, stream=True)
    deltas, finish = [], None
    for chunk in stream:
        for choice in chunk.choices:
            deltas += choice.delta.tool_calls or []
            finish = choice.finish_reason or finish
    assert finish == "tool_calls"
    assert [d.function.name for d in deltas] == ["lookup"]

    followup = question + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
    ]
    answer = client.chat.completions.create(model="local", messages=followup, tools=TOOLS)
    assert answer.choices[0].finish_reason == "stop"
    assert answer.choices[0].message.content == "the tool said sunny"
    sent = ollama.requests()[-1]["body"]["messages"]
    assert sent[1]["tool_calls"] == [{"function": {"name": "lookup", "arguments": {"question": "weather in Oslo"}}}]
    assert sent[2]["role"] == "tool" and sent[2]["content"] == "sunny"

    image = [
        {"type": "text", "text": "what is this"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0K"}},
    ]
    client.chat.completions.create(model="local", messages=[{"role": "user", "content": image}])
    assert ollama.requests()[-1]["body"]["messages"][0]["images"] == ["iVBORw0K"]


def test_finish_reason_length_and_n(surface):
    """
    Ollama stopping at its token limit is OpenAI's finish_reason "length";
    n > 1 on a normalized run is refused with 400, never silently one.
    """
    edge, _, _ = surface
    client = openai.OpenAI(base_url=edge.base_url + "/v1", api_key="edge-key", max_retries=0)
    messages = [{"role": "user", "content": "one two three four five"}]
    reply = client.chat.completions.create(model="local", messages=messages, max_tokens=2)
    assert reply.choices[0].finish_reason == "length"
    assert reply.choices[0].message.content == "one two "
    status, _, body = post(
        edge.http_port, "/v1/chat/completions", {"model": "local", "messages": messages, "n": 2}, EDGE
    )
    assert (status, json.loads(body)["error"]["code"]) == (400, "unsupported_n")
