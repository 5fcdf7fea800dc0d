"""
The whole path with real processes: a caller, a real `twistd -n iop-edge`,
a real `twistd -n iop-node` with the built-in echo back end.
"""

import json
import signal

import openai
import pytest
from support.daemons import echo_node, sse_events, wait_for

TEXT = "the quick brown fox jumps over the lazy dog"


@pytest.fixture
def pair(launch):
    edge = launch.edge({"nodes": [echo_node("node-1", "tok-1", delay_ms=20)], "admin_keys": ["adm"]})
    node = launch.node(edge.node_port, "tok-1")
    edge.wait_connected("node-1")
    return edge, node


def test_stream_completion_raw_sse(pair):
    """
    A streamed chat completion through raw SSE: OpenAI chunks whose
    contents join to the input exactly, then `data: [DONE]`.
    """
    edge, _ = pair
    conn, response = edge.stream(
        "POST",
        "/v1/chat/completions",
        {"model": "echo", "stream": True, "messages": [{"role": "user", "content": TEXT}]},
    )
    try:
        assert response.status == 200
        assert response.getheader("content-type") == "text/event-stream"
        payloads = list(sse_events(response))
    finally:
        conn.close()
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == TEXT
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_stream_completion_openai_sdk(pair):
    """
    The official openai SDK streams a completion and reads a non-streamed
    one, with usage, through the Edge.
    """
    edge, _ = pair
    client = openai.OpenAI(base_url=edge.base_url + "/v1", api_key="unused", max_retries=0)
    stream = client.chat.completions.create(
        model="echo", messages=[{"role": "user", "content": TEXT}], stream=True, stream_options={"include_usage": True}
    )
    parts, usage = [], None
    for chunk in stream:
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
        if chunk.usage:
            usage = chunk.usage
    assert "".join(parts) == TEXT
    assert usage.completion_tokens == len(TEXT.split())
    reply = client.chat.completions.create(model="echo", messages=[{"role": "user", "content": TEXT}])
    assert reply.choices[0].message.content == TEXT
    assert reply.usage.prompt_tokens == len(TEXT.split())
    models = [m.id for m in client.models.list()]
    assert "echo" in models


def test_native_run_stream_and_status(pair):
    """
    POST /v1/runs streams native events with run_id and type, deltas
    carrying text and the terminal carrying usage; the status lists the
    node as connected.
    """
    edge, _ = pair
    conn, response = edge.stream("POST", "/v1/runs", {"adapter": "echo", "input": TEXT, "stream": True})
    try:
        events = [json.loads(p) for p in sse_events(response)]
    finally:
        conn.close()
    types = [e["type"] for e in events]
    assert types[0] == "start" and types[-1] == "complete"
    assert set(types[1:-1]) == {"delta"}
    assert len({e["run_id"] for e in events}) == 1
    assert "".join(e.get("text", "") for e in events) == TEXT
    assert events[-1]["usage"] == {"input_tokens": 9, "output_tokens": 9}
    status = edge.status()
    assert status["nodes"][0]["id"] == "node-1" and status["nodes"][0]["connected"] is True


def test_cancel_native_run_mid_stream(launch):
    """
    Cancelling a native run mid-stream ends it with `cancelled` long
    before the echo back end would have finished.
    """
    edge = launch.edge({"nodes": [echo_node("node-1", "tok-1", delay_ms=200)]})
    launch.node(edge.node_port, "tok-1")
    edge.wait_connected("node-1")
    conn, response = edge.stream("POST", "/v1/runs", {"adapter": "echo", "input": "word " * 200, "stream": True})
    try:
        events = sse_events(response)
        first = json.loads(next(events))
        assert first["type"] == "start"
        status, body = edge.json("POST", f"/v1/runs/{first['run_id']}/cancel", {})
        assert status == 200, body
        rest = [json.loads(p) for p in events]
    finally:
        conn.close()
    assert rest[-1]["type"] == "cancelled"
    assert sum(1 for e in rest if e["type"] == "delta") < 50
    wait_for(lambda: edge.status()["nodes"][0]["in_flight"] == 0, what="no run in flight")


def test_bad_json_is_openai_error(pair):
    """
    Malformed JSON gets a 400 with an OpenAI-style error body; an unknown
    model a 404; both leave the Edge serving.
    """
    edge, _ = pair
    status, _, body = edge.request("POST", "/v1/chat/completions", b"{not json")
    assert status == 400
    assert json.loads(body)["error"]["code"] == "invalid_json"
    status, body = edge.json(
        "POST", "/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "x"}]}
    )
    assert status == 404 and "error" in body
    assert edge.node_connected("node-1")


def test_sigterm_exits_zero(pair):
    """
    SIGTERM stops both daemons cleanly with exit status 0.
    """
    edge, node = pair
    assert node.stop(signal.SIGTERM) == 0
    assert edge.stop(signal.SIGTERM) == 0


def test_caller_api_keys(launch):
    """
    With caller keys configured, a request without a valid key gets 401 in
    OpenAI error form; a caller key works; an admin key works as a caller
    key too but a caller key cannot run node commands.
    """
    edge = launch.edge({"nodes": [echo_node("node-1", "tok-1")], "api_keys": ["caller"], "admin_keys": ["adm"]})
    launch.node(edge.node_port, "tok-1")
    wait_for(lambda: edge.status_with("adm")["nodes"][0]["connected"], what="node-1 connected")
    body = {"model": "echo", "messages": [{"role": "user", "content": "hi"}]}
    status, error = edge.json("POST", "/v1/chat/completions", body)
    assert status == 401 and error["error"]["code"] == "missing_api_key"
    status, error = edge.json("POST", "/v1/chat/completions", body, {"authorization": "Bearer wrong"})
    assert status == 401 and error["error"]["code"] == "invalid_api_key"
    status, reply = edge.json("POST", "/v1/chat/completions", body, {"authorization": "Bearer caller"})
    assert status == 200 and reply["choices"][0]["message"]["content"] == "hi"
    status, _ = edge.json(
        "POST", "/v1/nodes/node-1/commands", {"command": "capabilities"}, {"authorization": "Bearer caller"}
    )
    assert status == 403
    status, result = edge.json(
        "POST", "/v1/nodes/node-1/commands", {"command": "capabilities"}, {"authorization": "Bearer adm"}
    )
    assert status == 200 and result["command"] == "capabilities"


def server_timing(headers):
    """
    A Server-Timing header as C{{name: milliseconds}}.
    """
    value = {k.lower(): v for k, v in headers.items()}["server-timing"]
    parts = {}
    for metric in value.split(","):
        name, *params = metric.strip().split(";")
        parts[name] = next(float(p[4:]) for p in params if p.startswith("dur="))
    return parts


def test_server_timing(pair):
    """
    An answer says where its time went: queue, place, node, the
    provider's first byte, the rest of an answer sent whole and the
    Edge's own, all measured; the gateway's
    own time has its histogram. A request the Edge answers itself has only
    its own time.
    """
    edge, _ = pair
    status, headers, _ = edge.request(
        "POST", "/v1/chat/completions", {"model": "echo", "messages": [{"role": "user", "content": TEXT}]}
    )
    assert status == 200
    parts = server_timing(headers)
    assert list(parts) == ["queue", "place", "node", "provider", "generate", "edge"]
    assert all(ms >= 0 for ms in parts.values())
    # The Node measured the back end's first answer (echo's start event).
    assert parts["provider"] > 0
    # Answered whole: echo's words (20 ms apart) are the back end's time.
    assert parts["generate"] >= 20
    _, headers, _ = edge.request("GET", "/v1/models")
    assert list(server_timing(headers)) == ["edge"]
    _, _, body = edge.request("GET", "/metrics")
    assert 'iop_edge_gateway_seconds_count{route="/v1/chat/completions"} 1.0' in body.decode()


def test_metrics(pair):
    """
    The Edge serves Prometheus metrics that reflect the live node.
    """
    edge, _ = pair
    status, headers, body = edge.request("GET", "/metrics")
    assert status == 200
    assert 'iop_edge_node_connected{node="node-1"} 1.0' in body.decode()


def test_bad_config_names_the_key(launch, tmp_path):
    """
    A bad edge.yaml or node.yaml stops the daemon at start with a non-zero
    status and a message naming the key.
    """
    edge = launch.edge({"nodes": [{"id": "n", "token": "t", "adapters": [{"name": "e", "type": "gpt"}]}]}, start=False)
    edge.start_process()
    assert edge.wait(timeout=20) != 0
    assert "nodes[0].adapters[0].type" in edge.output()
    node = launch.node(1, "t", start=False, reconnect={"max_attempts": 0, "interval_sec": 0})
    node.start()
    assert node.wait(timeout=20) == 1
    assert "reconnect.interval_sec" in node.output()


def test_access_log_line(launch):
    """
    Each HTTP request is one structured access-log line (method, path,
    status, duration, model, node, provider, tokens); `access_log: false`
    turns them off.
    """
    edge = launch.edge({"nodes": [echo_node("node-1", "tok-1")]})
    launch.node(edge.node_port, "tok-1")
    edge.wait_connected("node-1")
    body = {"model": "echo", "messages": [{"role": "user", "content": "one two"}]}
    assert edge.request("POST", "/v1/chat/completions", body)[0] == 200
    line = wait_for(
        lambda: next((x for x in edge.output().splitlines() if "POST /v1/chat/completions 200" in x), None),
        what="the access log line",
    )
    assert "model=echo" in line and "node=node-1" in line and "tokens_out=" in line

    quiet = launch.edge({"nodes": [echo_node("node-2", "tok-2")], "access_log": False})
    assert quiet.request("GET", "/v1/status")[0] == 200
    assert "GET /v1/status" not in quiet.output()
