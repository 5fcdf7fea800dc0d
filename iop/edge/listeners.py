"""
The Edge's listening children: the Node port, the HTTP site (callers and
C{/metrics}) and, when configured, the operator console. Each is a
C{strports} service under the L{iop.edge.service.EdgeService} tree; none
listens until the tree is started.
"""

from twisted.application import strports

from iop.edge.connection import EdgeNodeConnection
from iop.edge.http.root import build_root
from iop.edge.http.site import EdgeSite
from iop.edge.metrics import build_metrics
from iop.protocols.wire import Heartbeat, WireFactory


def node_factory(edge, reactor):
    """
    The factory of Node connections: one L{EdgeNodeConnection} each,
    talking to C{edge.links}.
    """
    config = edge.config
    heartbeat = Heartbeat(config.heartbeat_interval, config.heartbeat_timeout)
    return WireFactory(lambda: EdgeNodeConnection(edge.links), reactor, heartbeat)


def http_site(edge, reactor):
    metrics = build_metrics(edge, edge.bus) if edge.config.metrics else None
    return EdgeSite(build_root(edge, edge.config, reactor, metrics))


def add_listeners(edge, reactor):
    """
    Give C{edge} its children. @return: C{(nodes, http, manhole)}, the
    last C{None} unless configured.
    """
    config = edge.config
    nodes = strports.service(config.listen_nodes, node_factory(edge, reactor), reactor=reactor)
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
