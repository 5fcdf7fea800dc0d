"""
C{twistd -n iop-edge --config edge.yaml}: the Edge daemon.
"""

import signal

from twisted.application import service, strports
from twisted.logger import Logger
from twisted.python import usage
from twisted.web.server import Site

from iop.config import ConfigError
from iop.daemon import exit_zero_on_stop_signals, on_signals
from iop.edge import config as edge_config


class Options(usage.Options):
    optParameters = [["config", "c", "conf/edge.yaml", "Path to edge.yaml."]]


log = Logger()


def reload(edge, path, why):
    """
    Re-read C{edge.yaml} and apply what can change while running (see
    L{iop.edge.reload}); a bad or too-large change is logged and ignored.
    """
    log.info("{why}: reloading {path}", why=why, path=path)
    try:
        edge.reload(edge_config.load(path))
    except ConfigError as e:
        log.error("reload refused, keeping the running configuration: {error}", error=str(e))


def makeService(options):
    from twisted.internet import reactor

    from iop.edge.bus import EventBus
    from iop.edge.connection import EdgeNodeConnection
    from iop.edge.http.root import build_root
    from iop.edge.metrics import build_metrics
    from iop.edge.service import EdgeService
    from iop.protocols.wire import WireFactory

    try:
        config = edge_config.load(options["config"])
    except ConfigError as e:
        # One line naming the key, exit status 1, before anything listens.
        raise SystemExit(f"iop-edge: bad configuration: {e}") from None
    exit_zero_on_stop_signals(reactor)
    top = service.MultiService()
    bus = EventBus(reactor)
    edge = EdgeService(config, reactor, bus)
    top.edge = edge
    on_signals(reactor, (signal.SIGHUP,), lambda message: reload(edge, options["config"], message))
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
