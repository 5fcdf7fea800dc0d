"""
OpenTelemetry spans of caller requests, when C{tracing.otlp_endpoint} is
set in C{edge.yaml} (docs/edge.md, "Tracing").

Each HTTP request gets one server span, from the route's choice to the
request's end, a child of the trace the caller sent in C{traceparent}
(W3C trace context) or the root of a new one. The span's own context is
what the provider sees: a tunnel's C{traceparent} header is replaced by
it, and a normalized run carries it on its C{RunRequest} for the Node's
HTTP adapter to send. Spans are exported over OTLP/HTTP by the SDK's
batch processor, whose thread does the network I/O: the reactor only
ends spans. What is still buffered when the Edge exits is sent then (the
SDK's own exit hook).

OpenTelemetry is an optional dependency (C{pip install iop[tracing]}):
without it, a configured C{tracing.otlp_endpoint} stops the Edge at start
with a message naming the key.
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from twisted.python.failure import Failure
from twisted.web.server import Request

from iop.config import Section, http_url_problem
from iop.edge.http.request import method_label

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter

#: The W3C trace context header (and its companion).
TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"


@dataclass(frozen=True)
class TracingSpec:
    """
    C{tracing:} in C{edge.yaml}.

    @ivar otlp_endpoint: where spans go: an OTLP/HTTP traces URL such as
        C{http://collector:4318/v1/traces}.
    @ivar service_name: the C{service.name} of the Edge's spans.
    @ivar export_interval_sec: how often the batch processor sends.
    """

    otlp_endpoint: str
    service_name: str = "iop-edge"
    export_interval_sec: float = 5.0


def parse_tracing(section: Section) -> TracingSpec | None:
    """
    Read C{tracing:} (empty or absent: no tracing).

    @raise ConfigError: naming the key of a bad value, or
        C{tracing.otlp_endpoint} when OpenTelemetry is not installed.
    """
    section.unknown({"otlp_endpoint", "service_name", "export_interval_sec"})
    endpoint = section.get("otlp_endpoint", str, None)
    if endpoint is None:
        return None
    problem = http_url_problem(endpoint)
    if problem is not None:
        raise section.error("otlp_endpoint", problem)
    try:
        import opentelemetry.exporter.otlp.proto.http.trace_exporter  # noqa: F401
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError:
        raise section.error(
            "otlp_endpoint", "needs OpenTelemetry: pip install 'iop[tracing]' (opentelemetry-sdk and its OTLP exporter)"
        ) from None
    return TracingSpec(
        otlp_endpoint=endpoint,
        service_name=section.get("service_name", str, "iop-edge"),
        export_interval_sec=float(section.number("export_interval_sec", 5.0, positive=True)),
    )


class RequestTracing:
    """
    The spans of the Edge's caller requests.

    @param provider: the OpenTelemetry C{TracerProvider} spans are made
        with (its processors export them).
    """

    def __init__(self, provider: "TracerProvider") -> None:
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = provider
        self.tracer = provider.get_tracer("iop.edge")
        self.propagator = TraceContextTextMapPropagator()

    def observe(self, route: str, request: Request) -> None:
        """
        The router chose C{route} for C{request}: its span starts, and the
        request carries the span's context (C{request.traceparent}) for
        whatever it sends to a provider; the span ends with the request.
        The span's context also replaces the caller's in the request's own
        headers, so that what relays them whole (a request forwarded to
        the Edge of the cluster that serves it) continues this span, not
        the caller's trace beside it.
        """
        from opentelemetry.trace import SpanKind

        carrier = {}
        for name in (TRACEPARENT, TRACESTATE):
            value = request.getHeader(name)
            if value is not None:
                carrier[name] = value
        parent = self.propagator.extract(carrier)
        method = method_label(request)
        span = self.tracer.start_span(
            f"{method} {route}",
            context=parent,
            kind=SpanKind.SERVER,
            attributes={"http.request.method": method, "http.route": route},
        )
        outgoing: dict[str, str] = {}
        self.propagator.inject(outgoing, context=_with_span(span))
        request.traceparent = outgoing.get(TRACEPARENT, "")  # type: ignore[attr-defined]
        for name, value in outgoing.items():
            request.requestHeaders.setRawHeaders(name, [value])
        request.notifyFinish().addBoth(self._ended, span, request)

    def _ended(self, result: object, span: Any, request: Request) -> None:
        span.set_attribute("http.response.status_code", request.code)
        for name, value in getattr(request, "notes", {}).items():
            if isinstance(value, str | int | float | bool):
                span.set_attribute(f"iop.{name}", value)
        if isinstance(result, Failure):
            span.set_attribute("iop.caller_gone", True)
        span.end()


def _with_span(span: Any) -> Any:
    from opentelemetry import trace

    return trace.set_span_in_context(span)


def build_tracing(spec: TracingSpec, exporter: "SpanExporter | None" = None) -> RequestTracing:
    """
    The Edge's L{RequestTracing} for C{spec}: spans batched to its OTLP
    endpoint (or to C{exporter}, in tests).
    """
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    if exporter is None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(endpoint=spec.otlp_endpoint)
    provider = TracerProvider(resource=Resource.create({"service.name": spec.service_name}))
    provider.add_span_processor(
        BatchSpanProcessor(exporter, schedule_delay_millis=int(spec.export_interval_sec * 1000))
    )
    return RequestTracing(provider)


def outgoing_traceparent(request: Request) -> str:
    """
    The trace context C{request}'s work sends on: its span's when tracing
    is on, else whatever the caller sent (passed through unchanged).
    """
    own = getattr(request, "traceparent", None)
    if own:
        return str(own)
    sent = request.getHeader(TRACEPARENT)
    return sent or ""
