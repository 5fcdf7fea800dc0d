"""
The Edge's listening children: the Node port, the HTTP site (callers and
C{/metrics}) and, when configured, the operator console. Each is a
C{strports} service under the L{iop.edge.service.EdgeService} tree; none
listens until the tree is started.
"""

from twisted.application import strports

from iop.edge.http.root import build_root
from iop.edge.http.site import EdgeSite
from iop.edge.metrics import build_metrics
from iop.edge.nodeport import NodePortFactory


def node_factory(edge, reactor):
    """
    The factory of Node connections: one
    L{iop.edge.connection.EdgeNodeConnection} each, talking to
    C{edge.links}, under the pre-registration limits.
    """
    return NodePortFactory(edge.links, lambda: edge.config, reactor)


def http_site(edge, reactor):
    metrics = build_metrics(edge, edge.bus) if edge.config.metrics else None
    return EdgeSite(build_root(edge, edge.config, reactor, metrics), limits=edge.config.limits, reactor=reactor)


def add_listeners(edge, reactor):
    """
    Give C{edge} its children. @return: C{(nodes, http, manhole)}, the
    last C{None} unless configured.
    """
    config = edge.config
    edge.node_port = node_factory(edge, reactor)
    nodes = strports.service(config.listen_nodes, edge.node_port, reactor=reactor)
    nodes.setServiceParent(edge)
    edge.site = http_site(edge, reactor)
    http = strports.service(config.listen_http, edge.site, reactor=reactor)
    http.setServiceParent(edge)
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
    return nodes, http, console
