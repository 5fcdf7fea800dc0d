"""
The Edge as one service tree (its children: the listeners of
L{iop.edge.listeners}; its cluster: L{iop.edge.seam}), and the one caller
API every surface uses. It builds the state (registry, pool, run book,
in-flight table) and the pieces that act on it (intake, starter, commands,
history, drain, links: docs/architecture.md). It knows nothing of HTTP.
"""

from typing import Any

from twisted.application.service import IService, MultiService, Service
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from iop.edge.bus import EventBus
from iop.edge.cluster.etcd import IEtcd
from iop.edge.cluster.joined import cluster_for
from iop.edge.commands import NodeCommands
from iop.edge.config import EdgeConfig
from iop.edge.drain import Drain
from iop.edge.history import RunHistory
from iop.edge.http.site import EdgeSite
from iop.edge.inflight import Inflight
from iop.edge.intake import Intake
from iop.edge.links import NodeLinks
from iop.edge.listeners import add_listeners
from iop.edge.nodeport import NodePortFactory
from iop.edge.placement import Placer
from iop.edge.pool import ProviderPool, ProviderSpec
from iop.edge.probes import probe_provider
from iop.edge.registry import NodeRegistry
from iop.edge.runs import RunBook
from iop.edge.status import model_names, snapshot


class EdgeService(MultiService):
    """
    @param config: a validated L{iop.edge.config.EdgeConfig}.
    @param reactor: the reactor (listeners, timers); a C{task.Clock} in
        tests, where the tree is never started.
    @param listen: build the listening children (not in bare unit tests).
    @param etcd: with C{cluster}, the L{IEtcd} to use (tests: in memory).

    @ivar cluster: the L{iop.edge.seam.ICluster} this Edge belongs to.
    @ivar submit: like the other entry points bound with it, a piece's own
        (L{Intake.submit}, L{NodeCommands.command}, L{RunHistory.get_run}...).
    @ivar site: the HTTP L{EdgeSite}; C{node_port}, the L{NodePortFactory}.
    """

    log = Logger()

    def __init__(
        self,
        config: EdgeConfig,
        reactor: IReactorTime,
        bus: EventBus | None = None,
        listen: bool = True,
        etcd: IEtcd | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.clock = reactor
        self.bus = bus if bus is not None else EventBus(reactor)
        self.registry = NodeRegistry(config.nodes, reactor)
        groups, direct_timeout = config.model_groups, config.direct_queue_timeout_sec
        self.pool = ProviderPool(reactor, config.providers(), groups, direct_timeout, config.health, prober=self._probe)
        log = config.run_log
        self.runs = RunBook(reactor, self.bus, self._fetch_run, log.max_bytes, log.max_age_sec, log.max_runs)
        self.inflight = Inflight(reactor, self.runs)
        running = self._running
        self.cluster = cluster_for(running, reactor, self.registry, self.pool, self._void, self._moved, etcd)
        self.links = NodeLinks(running, self.registry, self.pool, self.inflight, self.bus, self.cluster)
        self.placer = Placer(running, self.registry, self.pool)
        self.drain = Drain(running, reactor, self.pool, self.links, self.inflight, self.cluster)
        self.intake = Intake(
            running, reactor, self.drain, self.cluster, self.placer, self.pool, self.runs, self.inflight, self.bus
        )
        self.budgets = self.intake.budgets
        self.commands = NodeCommands(running, reactor, self.registry, self.placer, self.inflight, self.drain)
        self.history = RunHistory(running, self.runs, self.registry, self.commands, self.cluster)
        self.submit = self.intake.submit
        self.cancel = self.intake.cancel
        self.command = self.commands.command
        self.terminate_session = self.commands.terminate_session
        self.get_run = self.history.get_run
        self.list_runs = self.history.list_runs
        self.follow = self.history.follow
        self.hurry = self.drain.hurry
        self.queue = self.pool.queued
        self.site: EdgeSite | None = None
        self.node_port: NodePortFactory | None = None
        self._listeners: list[IService] = []
        if listen:
            self._listeners = [child for child in add_listeners(self, reactor) if child is not None]

    def _running(self) -> EdgeConfig:
        return self.config

    def _probe(self, spec: ProviderSpec) -> "Deferred[bool | None]":
        return probe_provider(self.command, self.bus, spec)

    def _fetch_run(self, run_id: str, node_id: str | None, after: int) -> "Deferred[tuple[str, dict[str, Any]]]":
        # (The run book asks the history, which is built after it.)
        return self.history.fetch_run(run_id, node_id, after)

    def _void(self, reason: str) -> None:
        # The cluster took this Edge's claims away: its Nodes register again.
        self.links.close_all(reason)

    def _moved(self, node_id: str) -> None:
        # Another Edge has the node and the runs it kept (this Edge waits for some?).
        if self.inflight.detached_on(node_id):
            self.history.node_moved(node_id)

    def status(self) -> dict[str, Any]:
        """Every node with its providers, every model group, the cluster."""
        return self.cluster.annotate(snapshot(self.config, self.registry, self.pool, self.inflight))

    def models(self) -> list[str]:
        """What callers can name as C{model}."""
        return model_names(self.config, self.registry)

    def reload(self, config: EdgeConfig) -> list[str]:
        """
        Take a re-read configuration; adapter changes go to the ready Nodes
        as C{ConfigRefresh} (L{NodeLinks.reload}). @return: the ids of the
        nodes pushed a refresh. @raise ConfigError: if the change needs a
        restart (nothing applied).
        """
        old = self.config
        self.config = config
        try:
            pushed = self.links.reload(old, config)
        except Exception:
            self.config = old
            raise
        self.log.info("configuration reloaded; refresh pushed to {nodes}", nodes=", ".join(pushed) or "no node")
        return pushed

    def startService(self) -> None:
        super().startService()
        self.cluster.startService()

    def stopService(self) -> "Deferred[list[Any]]":
        """Drain, then stop (L{Drain.start}; a second signal L{hurry}s it)."""
        Service.stopService(self)
        stopped = self.drain.start(self._listeners, self.site)
        self.intake.starter.stop_resting()
        return stopped
