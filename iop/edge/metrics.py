"""
Prometheus metrics for the Edge.

Gauges are read from the live service at scrape time (no shadow copies of
registry, pool or in-flight state); counters follow the event bus. Each
Edge builds its own C{CollectorRegistry}, so several can live in one
process (tests).
"""

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily

from iop.metricspage import MetricsPage


class _ServiceCollector:
    def __init__(self, service):
        self.service = service

    def collect(self):
        status = self.service.status()
        connected = GaugeMetricFamily("iop_edge_node_connected", "1 if the node is dispatch-ready", labels=["node"])
        in_use = GaugeMetricFamily("iop_edge_provider_in_use", "Leases held", labels=["node", "provider", "class"])
        capacity = GaugeMetricFamily(
            "iop_edge_provider_capacity", "Effective capacity", labels=["node", "provider", "class"]
        )
        for node in status["nodes"]:
            connected.add_metric([node["id"]], 1 if node["connected"] else 0)
            for provider in node["providers"]:
                for klass in ("normal", "long"):
                    labels = [node["id"], provider["id"], klass]
                    in_use.add_metric(labels, provider["in_use"][klass])
                    capacity.add_metric(labels, provider["capacity"][klass])
        queued = GaugeMetricFamily("iop_edge_queued", "Requests waiting for capacity", labels=["model_group"])
        for group in status["model_groups"]:
            queued.add_metric([group["name"]], group["queued"])
        inflight = GaugeMetricFamily("iop_edge_in_flight", "Runs and tunnels in flight")
        inflight.add_metric([], len(self.service.inflight))
        return [connected, in_use, capacity, queued, inflight]


def build_metrics(service, bus):
    """
    @return: the C{/metrics} resource.
    """
    registry = CollectorRegistry()
    registry.register(_ServiceCollector(service))
    terminals = Counter("iop_edge_run_terminals", "Run terminal events", ["type"], registry=registry)
    node_events = Counter("iop_edge_node_events", "Node lifecycle events", ["event"], registry=registry)

    def observe(topic, payload):
        if topic == "run" and payload["type"] in ("complete", "error", "cancelled"):
            terminals.labels(payload["type"]).inc()
        elif topic == "node":
            node_events.labels(payload["event"]).inc()

    bus.subscribe(observe)
    return MetricsPage(registry)
