"""
The Edge's listening children: the Node port, the HTTP site (callers and
C{/metrics}), and when configured a separate metrics endpoint and the
operator console. Each is a
C{strports} service under the L{iop.edge.service.EdgeService} tree; none
listens until the tree is started.
"""

from typing import Any

from twisted.application import strports
from twisted.application.service import IService
from twisted.web.resource import Resource

from iop.edge.http.common import RequireKey
from iop.edge.http.root import Router, build_root
from iop.edge.http.site import EdgeSite
from iop.edge.metrics import HTTPMetrics, build_metrics
from iop.edge.nodeport import NodePortFactory
from iop.edge.nodetls import context_factory
from iop.edge.tlsdoors import RefusingTLSFactory, endpoint_wraps
from iop.edge.tracing import build_tracing

#: The L{iop.edge.service.EdgeService} the children are for: not imported,
#: since it imports this module to build them.
Edge = Any

#: The listen backlog of the Node port and the HTTP port unless their
#: endpoint string says otherwise (Twisted's default, 50, overflows under a
#: burst of connections: the extra ones are reset by the kernel).
LISTEN_BACKLOG = 1024


def with_backlog(description: str, backlog: int = LISTEN_BACKLOG) -> str:
    """
    C{description} (a server endpoint string) with C{backlog=} added for
    the stream endpoints that take it, unless it names one already.
    """
    kind = description.split(":", 1)[0]
    if kind in ("tcp", "tcp6", "ssl", "unix") and "backlog=" not in description:
        return f"{description}:backlog={backlog}"
    return description


def node_factory(edge: Edge, reactor: Any) -> NodePortFactory:
    """
    The factory of Node connections: one
    L{iop.edge.connection.EdgeNodeConnection} each, talking to
    C{edge.links}, under the pre-registration limits.
    """
    return NodePortFactory(edge.links, lambda: edge.config, reactor)


def metrics_resource(edge: Edge) -> tuple[Resource, HTTPMetrics] | None:
    """
    C{/metrics}, behind C{metrics_key} when one is configured, and the
    request metrics the HTTP site counts into (wherever C{/metrics} is
    served); C{None} when metrics are off.
    """
    config = edge.config
    if not config.metrics:
        return None
    page = build_metrics(edge, edge.bus)
    resource = page if config.metrics_key is None else RequireKey(page, config.metrics_key)
    return resource, page.http


def http_site(
    edge: Edge, reactor: Any, metrics: Resource | None = None, requests: HTTPMetrics | None = None
) -> EdgeSite:
    config = edge.config
    tracing = build_tracing(config.tracing) if config.tracing is not None else None
    root = build_root(edge, reactor, metrics, tracing, requests.observe if requests is not None else None)
    return EdgeSite(root, limits=config.limits, access_log=config.access_log, reactor=reactor)


def peer_site(edge: Edge, reactor: Any) -> EdgeSite:
    """
    C{listen.peer} of an Edge cluster: the same routes as the HTTP port,
    for requests other Edges forward, behind the cluster's secret.
    """
    from iop.edge.cluster.forward import PeerGate

    config = edge.config
    root = PeerGate(build_root(edge, reactor), config.cluster.secret)
    return EdgeSite(root, limits=config.limits, access_log=config.access_log, per_address=False, reactor=reactor)


def add_listeners(
    edge: Edge, reactor: Any
) -> tuple[IService, IService, IService | None, IService | None, IService | None]:
    """
    Give C{edge} its children. @return: C{(nodes, http, metrics, manhole,
    peer)}, the last three C{None} unless configured (C{/metrics} is on the HTTP port
    unless C{listen.metrics} gives it its own).
    """
    config = edge.config
    built = metrics_resource(edge)
    metrics, requests = built if built is not None else (None, None)
    metrics_listener = None
    if metrics is not None and config.listen_metrics is not None:
        metrics_site = EdgeSite(Router.only("/metrics", metrics), limits=config.limits, reactor=reactor)
        metrics_site.refuse_with_protocol = endpoint_wraps(config.listen_metrics)
        metrics_listener = strports.service(config.listen_metrics, metrics_site, reactor=reactor)
        metrics_listener.setServiceParent(edge)
        metrics = None
    edge.node_port = node_factory(edge, reactor)
    edge.node_port.refuse_with_protocol = endpoint_wraps(config.listen_nodes)
    factory = edge.node_port
    if config.node_tls is not None:
        # Mutual TLS over the plain endpoint: client certificates required.
        factory = RefusingTLSFactory(context_factory(config.node_tls), False, factory)
    nodes = strports.service(with_backlog(config.listen_nodes), factory, reactor=reactor)
    nodes.setServiceParent(edge)
    edge.site = http_site(edge, reactor, metrics, requests)
    edge.site.refuse_with_protocol = endpoint_wraps(config.listen_http)
    http = strports.service(with_backlog(config.listen_http), edge.site, reactor=reactor)
    http.setServiceParent(edge)
    peer = None
    if config.listen_peer is not None:
        site = peer_site(edge, reactor)
        site.refuse_with_protocol = endpoint_wraps(config.listen_peer)
        peer = strports.service(with_backlog(config.listen_peer), site, reactor=reactor)
        peer.setServiceParent(edge)
    console = None
    if config.manhole is not None:
        from iop.edge.manhole import manhole_service

        namespace = {
            "edge": edge,
            "registry": edge.registry,
            "pool": edge.pool,
            "bus": edge.bus,
            "inflight": edge.inflight,
        }
        console = manhole_service(config.manhole, namespace, reactor)
        console.setServiceParent(edge)
    return nodes, http, metrics_listener, console, peer
