"""
Prometheus metrics for one Node.

Each L{NodeMetrics} has its own C{CollectorRegistry} rather than the
process-global one, so tests (and a process hosting several Nodes) can
build as many as they like. The metrics are always collected; serving
them over HTTP is optional (C{metrics} in C{node.yaml}).
"""

from prometheus_client import CollectorRegistry, Counter, Gauge
from twisted.application.internet import StreamServerEndpointService
from twisted.internet.endpoints import serverFromString
from twisted.internet.interfaces import IReactorTime
from twisted.web.resource import Resource
from twisted.web.server import Site

from iop.metricspage import MetricsPage
from iop.run import CONTEXT_LENGTH_EXCEEDED, INCOMPLETE, PROVIDER_ERROR, PROVIDER_TIMEOUT, PROVIDER_UNREACHABLE

#: The failure codes that are the provider's (counted by
#: C{iop_node_provider_failures_total}).
PROVIDER_FAILURES = frozenset(
    {PROVIDER_ERROR, PROVIDER_TIMEOUT, PROVIDER_UNREACHABLE, CONTEXT_LENGTH_EXCEEDED, INCOMPLETE}
)


class NodeMetrics:
    """
    @ivar registry: the C{CollectorRegistry} holding this Node's metrics.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = CollectorRegistry() if registry is None else registry
        self.runs = Counter(
            "iop_node_runs_total",
            "Normalized runs finished on this Node, by adapter and terminal status.",
            ["adapter", "status"],
            registry=self.registry,
        )
        self.in_flight_gauge = Gauge(
            "iop_node_in_flight",
            "Runs and tunnels holding a capacity slot, by adapter.",
            ["adapter"],
            registry=self.registry,
        )
        self.provider_failures = Counter(
            "iop_node_provider_failures_total",
            "Runs and tunnels ended by their provider's failure, by adapter, failure code and missed deadline"
            " (first_byte, stall, idle; empty for none).",
            ["adapter", "code", "deadline"],
            registry=self.registry,
        )
        self.tunnel_bytes = Counter(
            "iop_node_tunnel_bytes_total",
            "Provider response body bytes relayed through raw tunnels.",
            registry=self.registry,
        )
        self.store_ok_gauge = Gauge(
            "iop_node_store_ok",
            "1 while the run store records runs, 0 once a write failed (see transport_status).",
            registry=self.registry,
        )
        self.store_ok_gauge.set(1)
        self.store_failures = Counter(
            "iop_node_store_failures_total",
            "Run store writes that failed.",
            registry=self.registry,
        )

    def run_ended(self, adapter: str, status: str) -> None:
        self.runs.labels(adapter=adapter, status=status).inc()

    def provider_failed(self, adapter: str, code: str, deadline: str) -> None:
        """
        A run or tunnel ended with one of L{PROVIDER_FAILURES} (others,
        such as a cancel or a refusal, are not the provider's).
        """
        if code in PROVIDER_FAILURES:
            self.provider_failures.labels(adapter=adapter, code=code, deadline=deadline).inc()

    def in_flight(self, adapter: str, count: int) -> None:
        self.in_flight_gauge.labels(adapter=adapter).set(count)

    def tunnel_body(self, size: int) -> None:
        self.tunnel_bytes.inc(size)

    def store_ok(self, ok: bool) -> None:
        self.store_ok_gauge.set(1 if ok else 0)

    def store_failed(self) -> None:
        self.store_failures.inc()

    def value(self, name: str, labels: dict[str, str] | None = None) -> float | None:
        """
        The current value of one sample (for tests and status output).
        """
        return self.registry.get_sample_value(name, labels or {})


def metrics_service(reactor: IReactorTime, description: str, metrics: NodeMetrics) -> StreamServerEndpointService:
    """
    A service listening on the server endpoint C{description} and serving
    C{/metrics}.

    @param reactor: the reactor the endpoint listens with (typed by the
        clock every Node part shares; endpoints take any reactor).
    """

    root = Resource()
    root.putChild(b"metrics", MetricsPage(metrics.registry))
    return StreamServerEndpointService(serverFromString(reactor, description), Site(root))
