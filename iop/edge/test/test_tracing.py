"""
Tracing (L{iop.edge.tracing}): C{tracing:} is read and checked at load; a
request's span is a child of the caller's trace; the span's context is
what a tunnel and a normalized run send on to the provider. Spans go to
an in-memory exporter here (the OTLP export is tested on live daemons,
tests/test_e2e_tracing.py).
"""

import copy
from io import BytesIO
from typing import Any, cast

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.http_headers import Headers
from twisted.web.test.requesthelper import DummyChannel, DummyRequest

from iop.config import ConfigError, Section
from iop.edge.cluster.forward import Forwarder
from iop.edge.config import parse
from iop.edge.dispatch import Placement
from iop.edge.http.common import caller_headers
from iop.edge.registry import NodeLink
from iop.edge.seam import Forward
from iop.edge.spec import RunSpec
from iop.edge.starter import _run_request
from iop.edge.tracing import RequestTracing, outgoing_traceparent
from iop.testing.edge import EDGE_YAML

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER = f"00-{TRACE}-00f067aa0ba902b7-01"


def traced(headers=()):
    """
    A request seen by a L{RequestTracing} over an in-memory exporter.
    @return: C{(request, exporter)}.
    """
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    # (twisted.web's test double stands in for its Request.)
    request: Any = DummyRequest([b"v1", b"chat", b"completions"])
    request.method = b"POST"
    for name, value in headers:
        request.requestHeaders.addRawHeader(name, value)
    RequestTracing(provider).observe("/v1/chat/completions", request)
    return request, exporter


class ConfigTests(SynchronousTestCase):
    def config(self, tracing):
        data = copy.deepcopy(EDGE_YAML)
        data["tracing"] = tracing
        return parse(Section(data, "", "edge.yaml"))

    def test_off_unless_configured(self):
        self.assertIsNone(parse(Section(copy.deepcopy(EDGE_YAML), "", "edge.yaml")).tracing)
        self.assertIsNone(self.config({}).tracing)

    def test_endpoint(self):
        spec = self.config({"otlp_endpoint": "http://collector:4318/v1/traces", "export_interval_sec": 1})
        assert spec.tracing is not None
        self.assertEqual(spec.tracing.otlp_endpoint, "http://collector:4318/v1/traces")
        self.assertEqual((spec.tracing.service_name, spec.tracing.export_interval_sec), ("iop-edge", 1.0))

    def test_bad_values_name_the_key(self):
        for tracing, key in (
            ({"otlp_endpoint": "collector:4318"}, "tracing.otlp_endpoint"),
            ({"otlp_endpoint": "http://c/v1/traces", "export_interval_sec": 0}, "tracing.export_interval_sec"),
            ({"otlp_endpoint": "http://c/v1/traces", "sampler": "all"}, "tracing.sampler"),
        ):
            error = self.assertRaises(ConfigError, self.config, tracing)
            self.assertIn(key, str(error))


class SpanTests(SynchronousTestCase):
    def test_child_of_the_callers_trace(self):
        """
        The span continues the trace the caller sent; the request carries
        the span's own context for what it sends on; the span ends with
        the request, naming its route and status.
        """
        request, exporter = traced([(b"traceparent", CALLER.encode())])
        version, trace, span_id, flags = request.traceparent.split("-")
        self.assertEqual((version, trace, flags), ("00", TRACE, "01"))  # (sampled, as the caller's)
        self.assertNotEqual(span_id, "00f067aa0ba902b7")
        self.assertEqual(exporter.get_finished_spans(), ())
        request.notes = {"model": "big", "node": "gpu"}
        request.code = 200  # (what twisted.web's request has; the dummy's is apart)
        request.finish()
        [span] = exporter.get_finished_spans()
        self.assertEqual(span.name, "POST /v1/chat/completions")
        self.assertEqual(format(span.context.trace_id, "032x"), TRACE)
        self.assertEqual(format(span.parent.span_id, "016x"), "00f067aa0ba902b7")
        self.assertEqual(format(span.context.span_id, "016x"), span_id)
        self.assertEqual(span.attributes["http.response.status_code"], 200)
        self.assertEqual((span.attributes["iop.model"], span.attributes["iop.node"]), ("big", "gpu"))

    def test_new_trace_without_one(self):
        request, exporter = traced()
        request.code = 200
        self.assertRegex(request.traceparent, r"^00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$")
        request.finish()
        [span] = exporter.get_finished_spans()
        self.assertIsNone(span.parent)


class PropagationTests(SynchronousTestCase):
    def test_tunnel_sends_the_spans_context(self):
        """
        A tunnel's headers carry the span's context instead of the
        caller's; without tracing, the caller's passes through.
        """
        request, _ = traced([(b"traceparent", CALLER.encode()), (b"x-team", b"ops")])
        headers = dict((name.lower(), value) for name, value in caller_headers(request))
        self.assertEqual(headers["traceparent"], request.traceparent)
        self.assertEqual(headers["x-team"], "ops")
        plain: Any = DummyRequest([b""])
        plain.requestHeaders.addRawHeader(b"traceparent", CALLER.encode())
        self.assertIn(("traceparent", CALLER), [(n.lower(), v) for n, v in caller_headers(plain)])

    def test_run_request_carries_it(self):
        """
        A normalized run's RunRequest carries the context the request
        sends on: the span's, or else the caller's.
        """
        request, _ = traced([(b"traceparent", CALLER.encode())])
        spec = RunSpec(messages=[{"role": "user", "content": "hi"}], model="big")
        spec.traceparent = outgoing_traceparent(request)
        placement = Placement(link=cast(NodeLink, None), adapter="llm", adapter_type="openai_compat")
        self.assertEqual(_run_request("r1", placement, spec).traceparent, request.traceparent)
        plain: Any = DummyRequest([b""])
        plain.requestHeaders.addRawHeader(b"traceparent", CALLER.encode())
        self.assertEqual(outgoing_traceparent(plain), CALLER)
        self.assertEqual(outgoing_traceparent(cast(Any, DummyRequest([b""]))), "")

    def test_forward_sends_the_spans_context(self):
        """
        A request another Edge of the cluster serves is sent there with
        this Edge's span as its parent (the owner's span is its child, as
        the provider's is), not with the caller's context beside it.
        """
        request, _ = traced([(b"traceparent", CALLER.encode()), (b"tracestate", b"vendor=1")])
        request.uri = b"/v1/chat/completions"
        request.content = BytesIO(b"{}")
        request._disconnected = False  # (twisted.web's flag of a caller who hung up)
        request.channel = DummyChannel()
        request.channel.transport = StringTransport()
        sent: list[Headers] = []

        class Peer:
            def request(self, method: bytes, uri: bytes, headers: Headers, body: object = None) -> Deferred[Any]:
                """
                The owning Edge: what it was sent is what the test reads.
                """
                sent.append(headers)
                return Deferred()

        Forwarder("secret", Clock(), cast(Any, Peer())).proxy(request, Forward("edge-b", "http://edge-b", "test"))
        [headers] = sent
        self.assertEqual(headers.getRawHeaders("traceparent"), [request.traceparent])
        self.assertEqual(headers.getRawHeaders("tracestate"), ["vendor=1"])
