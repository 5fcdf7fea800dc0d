"""
C{twistd -n iop-edge --config edge.yaml}: the Edge daemon.

Only this module touches the global reactor. The configuration is read in
L{makeService}; a bad one stops twistd at once with one line naming the
key, and exit status 1. The first SIGTERM/SIGINT drains the Edge (see
L{iop.edge.service.EdgeService.stopService}) and exits 0; a second one
during the drain ends it at once.
"""

import signal
from typing import TYPE_CHECKING

from twisted.application.service import IService
from twisted.logger import Logger
from twisted.python import usage

from iop.config import ConfigError
from iop.daemon import freeze_startup_heap, on_signals, stop_then_hurry
from iop.edge import config as edge_config
from iop.logs import with_log_format

if TYPE_CHECKING:
    from iop.edge.service import EdgeService

log = Logger()


class Options(usage.Options):
    optParameters = [["config", "c", "conf/edge.yaml", "Path to edge.yaml."]]


def reload(edge: "EdgeService", path: str, why: str) -> None:
    """
    Re-read C{edge.yaml} and apply what can change while running (see
    L{iop.edge.reload}); a bad or too-large change is logged and ignored,
    and so is any while the Edge drains (the Nodes it lets go would
    rebuild adapters for nothing, and the drain would wait for their
    answers).
    """
    if edge.drain.draining:
        log.warn("{why}: not reloading {path}: the Edge is draining", why=why, path=path)
        return
    log.info("{why}: reloading {path}", why=why, path=path)
    try:
        edge.reload(edge_config.load(path))
    except ConfigError as e:
        log.error("reload refused, keeping the running configuration: {error}", error=str(e))
    except Exception:
        log.failure("reload failed, keeping the running configuration")


def makeService(options: Options) -> IService:
    from twisted.internet import reactor

    from iop.edge.service import EdgeService

    try:
        config = edge_config.load(options["config"])
    except ConfigError as e:
        # One line naming the key, exit status 1, before anything listens.
        raise SystemExit(f"iop-edge: bad configuration: {e}") from None
    edge = EdgeService(config, reactor)
    freeze_startup_heap(reactor)
    stop_then_hurry(reactor, edge.hurry)
    on_signals(reactor, (signal.SIGHUP,), lambda message: reload(edge, options["config"], message))
    return with_log_format(edge, config.log_format, "iop-edge")
