"""
Tracing on real daemons: an Edge with C{tracing.otlp_endpoint} exports a
span per caller request over OTLP/HTTP to a collector (a tiny loopback
server here), in the caller's trace, and the provider behind a tunnel and
behind a normalized run is sent the span's own trace context. Every wait
is bounded.
"""

import http.server
import json
import threading

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from support.daemons import free_port, wait_for

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"
CALLER = f"00-{TRACE}-{CALLER_SPAN}-01"


class Collector(http.server.ThreadingHTTPServer):
    """
    An OTLP/HTTP traces endpoint that keeps every span it is sent.
    """

    def __init__(self, port):
        self.spans = []
        self.lock = threading.Lock()
        super().__init__(("127.0.0.1", port), _Export)

    def spans_named(self, name):
        with self.lock:
            return [s for s in self.spans if s.name == name]


class _Export(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        body = self.rfile.read(int(self.headers["content-length"]))
        request = ExportTraceServiceRequest.FromString(body)
        with self.server.lock:
            for resource in request.resource_spans:
                for scope in resource.scope_spans:
                    self.server.spans.extend(scope.spans)
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def collector():
    server = Collector(free_port())
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def traced_post(edge, model, stream=False):
    status, _, body = edge.request(
        "POST",
        "/v1/chat/completions",
        {"model": model, "stream": stream, "messages": [{"role": "user", "content": "one two"}]},
        headers={"traceparent": CALLER},
    )
    assert status == 200, body
    return body


def sent_traceparent(provider):
    [request] = [r for r in provider.requests() if r["path"].endswith("/chat/completions")][-1:]
    values = [value for name, value in request["headers"] if name.lower() == "traceparent"]
    assert len(values) == 1, request["headers"]
    return values[0]


def test_spans_exported_and_context_sent_on(launch, fake_provider, collector):
    """
    A tunnelled and a normalized chat completion, each sent with the
    caller's traceparent: the collector receives a server span for each,
    in the caller's trace and a child of the caller's span; the provider
    was sent that span's context (the caller's trace, the Edge's span),
    not the caller's own.
    """
    llm = fake_provider("openai", delay_ms=1)
    node = {
        "id": "gpu",
        "token": "tok-gpu",
        "adapters": [{"name": "llm", "type": "openai_compat", "max_concurrency": 2, "base_url": llm.url("/v1")}],
        "providers": [{"id": "llm", "adapter": "llm"}],
    }
    groups = [{"name": "big", "providers": [{"node": "gpu", "provider": "llm", "target": "fake-model"}]}]
    tracing = {"otlp_endpoint": f"http://127.0.0.1:{collector.server_port}/v1/traces", "export_interval_sec": 0.2}
    edge = launch.edge({"nodes": [node], "model_groups": groups, "tracing": tracing})
    launch.node(edge.node_port, "tok-gpu")
    edge.wait_connected("gpu")

    traced_post(edge, "big")
    tunnel_context = sent_traceparent(llm)
    # A run on the same provider, as the native surface starts it.
    status, _, body = edge.request(
        "POST",
        "/v1/runs",
        {"model": "big", "input": "one two", "stream": False},
        headers={"traceparent": CALLER},
    )
    assert status == 200 and json.loads(body)["status"] == "complete", body
    run_context = sent_traceparent(llm)

    spans = wait_for(
        lambda: (
            len(found := collector.spans_named("POST /v1/chat/completions") + collector.spans_named("POST /v1/runs"))
            == 2
            and found
        ),
        timeout=15,
        what="both spans at the collector",
    )
    for span, context in zip(spans, (tunnel_context, run_context), strict=True):
        assert span.trace_id.hex() == TRACE
        assert span.parent_span_id.hex() == CALLER_SPAN
        version, trace, span_id, _ = context.split("-")
        assert (version, trace) == ("00", TRACE)
        assert span_id == span.span_id.hex(), "the provider was not sent the Edge's span"
        attributes = {a.key: a.value for a in span.attributes}
        assert attributes["http.response.status_code"].int_value == 200
