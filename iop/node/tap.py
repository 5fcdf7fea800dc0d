"""
C{twistd iop-node}: the Node daemon.

Only this module touches the global reactor. The configuration is read in
L{makeService}; a bad one stops twistd at once with one line naming the
key, and exit status 1. The first SIGTERM/SIGINT drains the Node (see
L{iop.node.service.NodeService.stopService}) and exits 0; a second one
during the drain ends it at once.
"""

from twisted.application.service import IService
from twisted.python import usage

from iop.config import ConfigError
from iop.daemon import freeze_startup_heap, stop_then_hurry
from iop.logs import with_log_format
from iop.node.config import load_config
from iop.node.exit import ProcessExit


class Options(usage.Options):
    optParameters = [
        ["config", "c", "conf/node.yaml", "Path to node.yaml."],
    ]


def makeService(options: Options) -> IService:

    from twisted.internet import reactor

    from iop.node.service import NodeService

    path = options["config"]
    exit = ProcessExit(reactor)
    try:
        config = load_config(path)
        service = NodeService(config, reactor, exit, source=path)
    except ConfigError as e:
        # SystemExit prints its message on stderr and exits with status 1,
        # instead of the traceback twistd would show for any other error.
        raise SystemExit(f"iop-node: bad configuration: {e}") from None
    freeze_startup_heap(reactor)
    stop_then_hurry(reactor, service.hurry)
    return with_log_format(service, config.log_format, "iop-node")
