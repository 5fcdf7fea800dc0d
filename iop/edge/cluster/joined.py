"""
This Edge joined to an Edge cluster on etcd: the L{ICluster} the service
is given when edge.yaml has C{cluster:} (L{cluster_for} chooses).

It puts together what the cluster's modules do: the L{Membership} (this
Edge's lease, the claims on its nodes, the view of the other Edges), the
load it publishes and reads (L{iop.edge.cluster.load}) to decide where a
request goes, the L{Forwarder} that proxies a request to the Edge that
serves it, and the L{PeerReader} that asks the other Edges for the runs
this one does not hold.
"""

from collections.abc import Callable
from typing import Any

from twisted.application.service import Service
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from zope.interface import implementer

from iop.edge.cluster.config import ClusterSpec
from iop.edge.cluster.etcd import EtcdClient, IEtcd
from iop.edge.cluster.forward import Forwarder
from iop.edge.cluster.load import forward_target, local_load, node_target
from iop.edge.cluster.membership import Membership
from iop.edge.cluster.peers import PeerReader, readable_peers
from iop.edge.config import EdgeConfig
from iop.edge.http.request import EdgeRequest
from iop.edge.pool import ProviderPool
from iop.edge.registry import NodeRegistry
from iop.edge.seam import Forward, ICluster, PeerAnswer, SoloEdge
from iop.edge.spec import RunSpec


@implementer(ICluster)
class EtcdCluster(Service):
    """
    @param spec: the C{cluster:} section.
    @param etcd: the L{IEtcd} to use.
    @param reactor: the reactor (timers, and the forwarder's connections).
    @param config: returns the running L{EdgeConfig} (it changes on
        reload): its model groups are what this Edge publishes room for.
    @param registry: whose connected nodes are served here.
    @param pool: whose room decides whether a request stays here.
    @param on_void: C{on_void(reason)}, called when this Edge's lease is
        gone: every claim is void and every Node link must close.
    @param on_moved: C{on_moved(node_id)}, called when another Edge claims
        a node.

    @ivar membership: the L{Membership}.
    @ivar forwarder: the L{Forwarder}.
    @ivar reader: the L{PeerReader} (on the forwarder's connections).
    """

    #: A Node that loses this Edge takes its runs to another.
    keeps_runs = True

    def __init__(
        self,
        spec: ClusterSpec,
        etcd: IEtcd,
        reactor: IReactorTime,
        config: Callable[[], EdgeConfig],
        registry: NodeRegistry,
        pool: ProviderPool,
        on_void: Callable[[str], object],
        on_moved: Callable[[str], object],
    ) -> None:
        self.registry = registry
        self.pool = pool
        self.forwarder = Forwarder(spec.secret, reactor)
        self.membership = Membership(
            spec,
            etcd,
            reactor,
            on_void=on_void,
            load=lambda: local_load(config(), pool),
            on_moved=on_moved,
            on_gone=self.forwarder.peer_gone,
        )
        self.reader = PeerReader(spec.secret, self.forwarder.agent, reactor)

    def startService(self) -> None:
        super().startService()
        self.membership.startService()

    def stopService(self) -> "Deferred[None]":
        super().stopService()
        return self.membership.stopService()

    def forward_target(self, spec: RunSpec) -> Forward | None:
        return forward_target(self.membership, self.registry, self.pool, spec)

    def node_target(self, node_id: str) -> Forward | None:
        return node_target(self.membership, self.registry, node_id)

    def proxy(self, request: EdgeRequest, forward: Forward) -> None:
        self.forwarder.proxy(request, forward)

    def ask_peers(self, request: EdgeRequest, path: bytes) -> "Deferred[list[PeerAnswer]]":
        return self.reader.ask(readable_peers(self.membership), request, path)

    def claim(self, node_id: str, generation: int) -> "Deferred[int]":
        # The claim's etcd revision, not the registry's count, is the
        # generation: it grows across the whole cluster.
        return self.membership.claim(node_id)

    def holds(self, node_id: str, generation: int) -> bool:
        return self.membership.holds(node_id, generation)

    def release(self, node_id: str, generation: int) -> None:
        self.membership.release(node_id, generation)

    def annotate(self, status: dict[str, Any]) -> dict[str, Any]:
        return self.membership.annotate(status)

    def start_draining(self) -> None:
        self.membership.start_draining()

    def leave(self) -> "Deferred[None]":
        return self.membership.leave()


def cluster_for(
    config: Callable[[], EdgeConfig],
    reactor: IReactorTime,
    registry: NodeRegistry,
    pool: ProviderPool,
    on_void: Callable[[str], object],
    on_moved: Callable[[str], object],
    etcd: IEtcd | None = None,
) -> ICluster:
    """
    The cluster of the Edge whose running configuration C{config()}
    returns: an L{EtcdCluster} with C{cluster:} (on C{etcd}, by default a
    client of C{cluster.etcd}), else a L{SoloEdge}.
    """
    spec = config().cluster
    if spec is None:
        return SoloEdge()
    if etcd is None:
        etcd = EtcdClient(spec.etcd, reactor)
    return EtcdCluster(spec, etcd, reactor, config, registry, pool, on_void, on_moved)
