"""
Prometheus metrics for the Edge.

Gauges are read from the live service at scrape time (no shadow copies of
registry, pool or in-flight state); counters follow the event bus, and the
HTTP ones are counted by the router (L{HTTPMetrics}). Each Edge builds its
own C{CollectorRegistry}, so several can live in one process (tests).

The names are a contract with conf/grafana/iop.json and
conf/prometheus/alerts.yml (tests/test_dashboards.py checks every name
they use against a live scrape).
"""

import collections
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from twisted.internet.interfaces import IReactorTime
from twisted.python.failure import Failure

from iop.edge.bus import EventBus
from iop.edge.http.request import EdgeRequest, method_label
from iop.edge.http.site import EdgeSite
from iop.edge.inflight import Inflight
from iop.edge.nodeport import NodePortFactory
from iop.edge.pool import ProviderPool
from iop.metricspage import MetricsPage
from iop.run import TERMINAL_TYPES

#: Usage fields and the C{kind} label of C{iop_edge_tokens_total}.
TOKEN_KINDS = (
    ("input_tokens", "input"),
    ("output_tokens", "output"),
    ("reasoning_tokens", "reasoning"),
    ("cached_input_tokens", "cached_input"),
)

#: The C{code} of a request whose caller went away before any answer.
CALLER_GONE = "499"

#: The routes whose time to first byte is measured: those that run work,
#: when they are asked to (a C{POST}: C{GET /v1/runs} lists the history).
TIMED_ROUTES = frozenset({"/v1/chat/completions", "/v1/runs"})

TTFB_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
#: The gateway's own time is a few hundred microseconds when all is well.
GATEWAY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5)


def disconnect_cause(reason: str | None) -> str:
    """
    A Node connection's loss reason as a small label set, so heartbeat
    timeouts can be told from clean closes and broken frames.
    """
    reason = (reason or "").lower()
    if reason.startswith("heartbeat timeout"):
        return "heartbeat_timeout"
    if reason.startswith(("protocol violation", "undecodable frame", "frame of", "frame carries")):
        return "protocol_error"
    if "closed cleanly" in reason:
        return "closed"
    return "lost"


class Observed(Protocol):
    """
    What the metrics read of the Edge (L{iop.edge.service.EdgeService},
    which imports this module, so it is described here).
    """

    @property
    def clock(self) -> IReactorTime: ...

    @property
    def inflight(self) -> Inflight: ...

    @property
    def pool(self) -> ProviderPool: ...

    @property
    def site(self) -> EdgeSite | None: ...

    @property
    def node_port(self) -> NodePortFactory | None: ...

    def status(self) -> dict[str, Any]: ...


class _ServiceCollector:
    def __init__(self, service: Observed, refused: dict[str, int]) -> None:
        self.service = service
        self.refused = refused

    def collect(self) -> list[Metric]:
        status = self.service.status()
        connected = GaugeMetricFamily("iop_edge_node_connected", "1 if the node is dispatch-ready", labels=["node"])
        node_work = GaugeMetricFamily(
            "iop_edge_node_in_flight", "Runs and tunnels in flight on the node", labels=["node"]
        )
        in_use = GaugeMetricFamily("iop_edge_provider_in_use", "Leases held", labels=["node", "provider", "class"])
        capacity = GaugeMetricFamily(
            "iop_edge_provider_capacity", "Effective capacity", labels=["node", "provider", "class"]
        )
        up = GaugeMetricFamily(
            "iop_edge_provider_up",
            "1 if the provider's health is ok (0: offline or ejected)",
            labels=["node", "provider"],
        )
        for node in status["nodes"]:
            connected.add_metric([node["id"]], 1 if node["connected"] else 0)
            node_work.add_metric([node["id"]], node.get("in_flight", 0))
            for provider in node["providers"]:
                up.add_metric([node["id"], provider["id"]], 1 if provider.get("health") == "ok" else 0)
                for klass in ("normal", "long"):
                    labels = [node["id"], provider["id"], klass]
                    in_use.add_metric(labels, provider["in_use"][klass])
                    capacity.add_metric(labels, provider["capacity"][klass])
        queued = GaugeMetricFamily("iop_edge_queued", "Requests waiting for capacity", labels=["model_group"])
        for group in (*status["model_groups"], *status.get("direct_queues", ())):
            queued.add_metric([group["name"]], group["queued"])
        inflight = GaugeMetricFamily("iop_edge_in_flight", "Runs and tunnels in flight")
        inflight.add_metric([], len(self.service.inflight))
        return [connected, node_work, in_use, capacity, up, queued, inflight, *self._health(), *self._doors()]

    def _doors(self) -> list[Metric]:
        """
        Connections refused or closed before they were served, by reason:
        the HTTP site's (C{max_http_connections},
        C{max_http_connections_per_address}, C{address_line_evicted},
        C{address_wait_timeout}, C{header_timeout_sec},
        C{body_timeout_sec}), the Node port's
        (C{max_unregistered_connections}, C{max_unregistered_per_address},
        C{node_port_line_evicted}, C{register_timeout_sec},
        C{unknown_token} and the other refused registrations' codes, a
        stranger's C{frame_too_large}, C{too_many_frames},
        C{protocol_error}, C{heartbeat_timeout}) and work
        refused by error code (C{queue_full}, C{token_budget_exceeded},
        ...); and the HTTP and Node-port connections that waited unread.
        """
        refusals = CounterMetricFamily(
            "iop_edge_refusals",
            "Connections and work refused or closed before being served, by reason",
            labels=["reason"],
        )
        waits = CounterMetricFamily(
            "iop_edge_http_address_waits",
            "HTTP connections that waited unread in their address's line (limits.max_http_connections_per_address)",
        )
        waiting = GaugeMetricFamily(
            "iop_edge_http_waiting_connections", "HTTP connections waiting unread in their address's line now"
        )
        node_waits = CounterMetricFamily(
            "iop_edge_node_port_waits",
            "Unregistered Node connections that waited unread (their address's line or the hall beyond"
            " limits.max_unregistered_connections)",
        )
        node_waiting = GaugeMetricFamily(
            "iop_edge_node_port_waiting_connections", "Unregistered Node connections waiting unread now"
        )
        # (Summed by reason: a reason two sources share is one sample.)
        by_reason = collections.Counter(self.refused)
        site, node_port = self.service.site, self.service.node_port
        if site is not None:
            by_reason.update(site.refused)
            waits.add_metric([], site.doors.waits)
            waiting.add_metric([], site.doors.waiting)
        if node_port is not None:
            by_reason.update(node_port.refused)
            node_waits.add_metric([], node_port.doors.waits)
            node_waiting.add_metric([], node_port.doors.waiting + node_port.doors.in_hall)
        for reason, count in sorted(by_reason.items()):
            refusals.add_metric([reason], count)
        return [refusals, waits, waiting, node_waits, node_waiting]

    def _health(self) -> list[Metric]:
        failures = CounterMetricFamily(
            "iop_edge_provider_failures",
            "Provider failures before answering (they feed its health), by reason code",
            labels=["node", "provider", "code"],
        )
        ejections = CounterMetricFamily(
            "iop_edge_provider_ejections", "Times the provider was ejected for failing", labels=["node", "provider"]
        )
        probes = CounterMetricFamily(
            "iop_edge_provider_probes",
            "Probes of an ejected provider's back end, by outcome (passed, failed)",
            labels=["node", "provider", "outcome"],
        )
        for node, provider, by_code, ejected, by_outcome in self.service.pool.health_counters():
            for code, count in by_code.items():
                failures.add_metric([node, provider, code], count)
            ejections.add_metric([node, provider], ejected)
            for outcome, count in by_outcome.items():
                probes.add_metric([node, provider, outcome], count)
        return [failures, ejections, probes]


class HTTPMetrics:
    """
    Caller requests by route pattern, method and status (counted when the
    response ends, streams included), and for the routes that run work the
    time from the request reaching the router to the first body byte of a
    successful answer: queueing, placement and the back end's first token.
    """

    def __init__(self, registry: CollectorRegistry, clock: IReactorTime) -> None:
        self.clock = clock
        self.requests = Counter(
            "iop_edge_http_requests",
            "HTTP requests by route, method and status",
            ["route", "method", "code"],
            registry=registry,
        )
        #: Work refused (429/503, or a queued stream ended) by reason
        #: code; reported in C{iop_edge_refusals_total} with the doors'.
        self.refused: dict[str, int] = {}
        self.ttfb = Histogram(
            "iop_edge_http_ttfb_seconds",
            "Time to the first byte of a successful answer",
            ["route"],
            buckets=TTFB_BUCKETS,
            registry=registry,
        )
        self.gateway = Histogram(
            "iop_edge_gateway_seconds",
            "The gateway's own time in a request until its answer's headers (Server-Timing edge and place:"
            " not the queue, the Node or the provider)",
            ["route"],
            buckets=GATEWAY_BUCKETS,
            registry=registry,
        )

    def observe(self, route: str, request: EdgeRequest) -> None:
        """
        Called by the router for each request, before its resource.
        """
        method = method_label(request)
        if route in TIMED_ROUTES and method == "POST":
            self._time_first_write(route, request, self.clock.seconds())
        request.notifyFinish().addBoth(lambda outcome: self._ended(route, method, request, outcome))

    def _ended(self, route: str, method: str, request: EdgeRequest, outcome: object) -> None:
        # A caller who went away before any answer got none: not the 200
        # twisted.web's request starts with (499, as nginx says it).
        gone = isinstance(outcome, Failure) and not request.startedWriting
        self.requests.labels(route, method, CALLER_GONE if gone else str(request.code)).inc()
        refused = getattr(request, "refused", None)
        if refused is not None:
            self.refused[refused] = self.refused.get(refused, 0) + 1
        gateway = getattr(request, "gateway_seconds", None)
        if gateway is not None:
            self.gateway.labels(route).observe(gateway)

    def _time_first_write(self, route: str, request: EdgeRequest, arrived: float) -> None:
        # Shadow this one request's write until its first call that is an
        # answer's (not a stream's word of its place in the queue), then
        # remove the shadow: later writes go straight to twisted.web.
        def first_write(data: bytes) -> None:
            if getattr(request, "waiting", False):
                return type(request).write(request, data)
            del request.write
            if request.code < 400:
                self.ttfb.labels(route).observe(self.clock.seconds() - arrived)
            return request.write(data)

        request.write = first_write  # type: ignore[method-assign]  # a shadow for one call, removed by it


def build_metrics(service: Observed, bus: EventBus, clock: IReactorTime | None = None) -> "EdgeMetricsPage":
    """
    @return: the C{/metrics} resource; its C{http} attribute is the
        L{HTTPMetrics} the router reports requests to.
    """
    registry = CollectorRegistry()
    http = HTTPMetrics(registry, clock if clock is not None else service.clock)
    registry.register(_ServiceCollector(service, http.refused))
    terminals = Counter(
        "iop_edge_run_terminals", "How runs and tunnels ended, by terminal type", ["type", "kind"], registry=registry
    )
    failures = Counter(
        "iop_edge_run_failures",
        "Runs and tunnels ended in error or cancelled, by reason code",
        ["node", "type", "code"],
        registry=registry,
    )
    tokens = Counter(
        "iop_edge_tokens",
        "Tokens reported by providers, by kind, model group, provider, node and caller key name",
        ["node", "kind", "model_group", "provider", "key"],
        registry=registry,
    )
    queue_wait = Histogram(
        "iop_edge_queue_wait_seconds",
        "How long work waited for room, by caller key name and how the wait ended",
        ["key", "outcome"],
        buckets=TTFB_BUCKETS,
        registry=registry,
    )
    node_events = Counter("iop_edge_node_events", "Node lifecycle events", ["event"], registry=registry)
    disconnects = Counter(
        "iop_edge_node_disconnects", "Node connections lost, by cause", ["node", "cause"], registry=registry
    )
    retries = Counter(
        "iop_edge_retries",
        "Work placed again after its provider failed before answering",
        ["node", "provider"],
        registry=registry,
    )

    fallbacks = Counter(
        "iop_edge_fallbacks",
        "Work taken by a fallback model group after its own group's providers failed it before a byte reached"
        " its caller, by reason (fallbacks, context_fallbacks)",
        ["model_group", "fallback", "reason"],
        registry=registry,
    )
    deadlines = Counter(
        "iop_edge_deadline_hits",
        "Provider deadlines missed, by kind (first_byte, stall, idle)",
        ["node", "provider", "kind"],
        registry=registry,
    )
    incompletes = Counter(
        "iop_edge_incompletes",
        "Answers cut, stalled or malformed after their first byte reached the caller (ended with an explicit"
        " error), by whether they were continued on another provider",
        ["node", "provider", "continued"],
        registry=registry,
    )

    def ended(work: str, kind: str, payload: dict[str, Any]) -> None:
        terminals.labels(kind, work).inc()
        if payload.get("error"):
            failures.labels(payload.get("node") or "", kind, payload["error"].get("code") or "unknown").inc()
        usage = payload.get("usage") or {}
        for field, token_kind in TOKEN_KINDS:
            if usage.get(field):
                labels = (payload.get("model_group") or "", payload.get("provider") or "", payload.get("key") or "")
                tokens.labels(payload.get("node") or "", token_kind, *labels).inc(usage[field])

    def observe(topic: str, payload: dict[str, Any]) -> None:
        if topic == "run":
            if payload["type"] in TERMINAL_TYPES:
                ended("run", payload["type"], payload)
        elif topic == "tunnel":
            if payload.get("status") in TERMINAL_TYPES:
                ended("tunnel", payload["status"], payload)
        elif topic == "queue":
            queue_wait.labels(payload["key"], payload["event"]).observe(payload["waited_sec"])
        elif topic == "provider":
            provider_event(payload)
        elif topic == "node":
            node_events.labels(payload["event"]).inc()
            if payload["event"] == "disconnected":
                disconnects.labels(payload["node"] or "", disconnect_cause(payload.get("reason"))).inc()

    def provider_event(payload: dict[str, Any]) -> None:
        event = payload.get("event")
        if event == "retry":
            retries.labels(payload["node"], payload["provider"]).inc()
        elif event == "fallback":
            fallbacks.labels(payload["model_group"], payload["fallback"], payload["reason"]).inc()
        elif event == "deadline":
            deadlines.labels(payload["node"], payload["provider"], payload["kind"]).inc()
        elif event == "incomplete":
            incompletes.labels(payload["node"], payload["provider"], str(payload["continued"]).lower()).inc()

    bus.subscribe(observe)
    return EdgeMetricsPage(registry, http)


class EdgeMetricsPage(MetricsPage):
    """
    C{/metrics}, holding the L{HTTPMetrics} the router reports to.
    """

    def __init__(self, registry: CollectorRegistry, http: HTTPMetrics) -> None:
        super().__init__(registry)
        self.http = http
