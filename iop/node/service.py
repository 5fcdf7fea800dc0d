"""
The Node as one service tree: run store, Edge supervisor, optional
C{/metrics} listener, and the adapters they share.
"""

from importlib import metadata

from twisted.application.internet import StreamServerEndpointService
from twisted.application.service import MultiService, Service
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import clientFromString
from twisted.internet.interfaces import IReactorTime, IStreamClientEndpoint
from twisted.logger import Logger
from twisted.python.failure import Failure

from iop.adapters.registry import build_adapter
from iop.config import ConfigError
from iop.node.config import NodeConfig
from iop.node.context import NodeContext
from iop.node.edges import EdgeRotation
from iop.node.exit import Exit
from iop.node.host import AdapterHost, BuildAdapter
from iop.node.metrics import NodeMetrics, metrics_service
from iop.node.owners import SessionOwners
from iop.node.store import RunStore, StoreService
from iop.node.supervisor import Supervisor

#: Why the Node drains: the reason in C{NodeDraining}, the run store and
#: the error of a tunnel cancelled at the end of the drain.
SHUTDOWN_REASON = "the node is shutting down"


def _version() -> str:
    try:
        return "iop " + metadata.version("iop")
    except metadata.PackageNotFoundError:
        return "iop"


class NodeService(MultiService):
    """
    @param config: a validated L{iop.node.config.NodeConfig}.
    @param source: the config file's name, for error messages.
    @param exit: C{exit(status, message)}; see L{iop.node.exit}.
    @param store: the run store service; by default an SQLite
        L{RunStore} at C{config.store}, which also loads the session
        owners (tests pass one that needs no threads).
    @raise ConfigError: if an endpoint string does not parse.

    @ivar supervisor: the L{Supervisor} (C{when_ready()}, C{session}).
    @ivar context: the L{NodeContext} shared by sessions.
    """

    log = Logger()

    def __init__(
        self,
        config: NodeConfig,
        reactor: IReactorTime,
        exit: Exit,
        source: str = "node.yaml",
        build: BuildAdapter = build_adapter,
        store: StoreService | None = None,
    ) -> None:
        super().__init__()
        edges = config.edges or (config.edge,)
        endpoints: list[tuple[str, IStreamClientEndpoint]] = []
        for i, description in enumerate(edges):
            try:
                endpoints.append((description, clientFromString(reactor, description)))
            except Exception as e:
                key = "edge" if len(edges) == 1 else f"edge[{i}]"
                raise ConfigError(f"{source}: {key}: not a valid client endpoint string ({e})") from None
        endpoint = endpoints[0][1] if len(endpoints) == 1 else EdgeRotation(endpoints)
        self.metrics = NodeMetrics()
        owners = SessionOwners()
        if store is None:
            store = RunStore(reactor, config.store, retention=config.retention, metrics=self.metrics, owners=owners)
        self.store: StoreService = store
        self.host = AdapterHost(reactor, build, self.metrics)
        self.context = NodeContext(
            token=config.token,
            clock=reactor,
            host=self.host,
            store=self.store,
            metrics=self.metrics,
            register_timeout=config.register_timeout_sec,
            configure_timeout=config.configure_timeout_sec,
            node_version=_version(),
            owners=owners,
        )
        self.context.transport.edge = config.edge
        self.context.transport.store = self.store
        self.shutdown_grace_sec = config.shutdown_grace_sec
        self.store.setServiceParent(self)
        self.supervisor = Supervisor(endpoint, self.context, config.reconnect, reactor, exit)
        self.supervisor.setServiceParent(self)
        self.metrics_listener: StreamServerEndpointService | None = None
        if config.metrics is not None:
            try:
                self.metrics_listener = metrics_service(reactor, config.metrics, self.metrics)
            except Exception as e:
                raise ConfigError(f"{source}: metrics: not a valid server endpoint string ({e})") from None
            self.metrics_listener.setServiceParent(self)

    def stopService(self) -> Deferred[None]:
        """
        Stop in order: drain the work in flight (no new work, up to
        C{shutdown_grace_sec} for the rest to end, then cancelled), close
        the connection (so every terminal reached the Edge and the store),
        then stop the adapters, the metrics listener, and the store last.

        @return: a Deferred firing once everything is down (twistd waits
            for it before the process exits).
        """
        Service.stopService(self)
        self.log.info("{reason}", reason=SHUTDOWN_REASON)
        d = self.supervisor.drain(self.shutdown_grace_sec, SHUTDOWN_REASON)
        d.addBoth(self._logged, "draining the work in flight")
        d.addCallback(lambda _: self.supervisor.stopService())
        d.addBoth(self._logged, "stopping the supervisor")
        d.addCallback(lambda _: self.host.stop())
        d.addBoth(self._logged, "stopping the adapters")
        listener = self.metrics_listener
        if listener is not None:
            d.addCallback(lambda _: listener.stopService())
            d.addBoth(self._logged, "stopping the metrics listener")
        d.addCallback(lambda _: self.store.stopService())
        d.addBoth(self._logged, "closing the run store")
        return d

    def hurry(self) -> None:
        """
        Another stop signal: cut the grace period to zero. During the
        drain the work still in flight is cancelled now and the shutdown
        goes on; before it (both signals came at once), the drain will
        cancel at once.
        """
        self.shutdown_grace_sec = 0
        self.supervisor.hurry()

    def _logged(self, result: object, what: str) -> None:

        if isinstance(result, Failure):
            self.log.failure("{what} failed", result, what=what)
        return None
