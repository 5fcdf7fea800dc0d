"""
C{twistd -n iop-edge --config edge.yaml}: the Edge daemon.
"""

from twisted.application import service, strports
from twisted.python import usage
from twisted.web.server import Site

from iop.config import ConfigError
from iop.daemon import exit_zero_on_stop_signals
from iop.edge import config as edge_config


class Options(usage.Options):
    optParameters = [["config", "c", "conf/edge.yaml", "Path to edge.yaml."]]

    def postOptions(self):
        # Read and validate now, so a bad config stops twistd with one clear
        # line naming the key, before anything listens.
        try:
            self["edge_config"] = edge_config.load(self["config"])
        except ConfigError as e:
            raise usage.UsageError(str(e))


def makeService(options):
    from twisted.internet import reactor

    from iop.edge.bus import EventBus
    from iop.edge.connection import EdgeNodeConnection
    from iop.edge.http.root import build_root
    from iop.edge.metrics import build_metrics
    from iop.edge.service import EdgeService
    from iop.protocols.wire import WireFactory

    exit_zero_on_stop_signals(reactor)
    config = options["edge_config"]
    top = service.MultiService()
    bus = EventBus(reactor)
    edge = EdgeService(config, reactor, bus)
    top.edge = edge
    nodes = WireFactory(lambda: EdgeNodeConnection(edge), reactor, edge.heartbeat())
    strports.service(config.listen_nodes, nodes).setServiceParent(top)
    metrics = build_metrics(edge, bus) if config.metrics else None
    site = Site(build_root(edge, config, reactor, metrics))
    site.displayTracebacks = False
    strports.service(config.listen_http, site).setServiceParent(top)
    if config.manhole is not None:
        from iop.edge.manhole import manhole_service

        manhole_service(config.manhole, {"edge": edge, "registry": edge.registry, "pool": edge.pool, "bus": bus, "inflight": edge.inflight}).setServiceParent(top)
    return top
