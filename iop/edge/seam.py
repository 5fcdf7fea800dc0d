"""
Where an Edge cluster plugs into the Edge (docs/cluster.md).

L{ICluster} is all the Edge asks of the cluster it may belong to: whether
a request goes to another Edge, and how to proxy it there; whether this
Edge may own a node (claimed at registration, checked at ready, given
back on loss); what the status shows of the cluster; saying that this
Edge is draining, and leaving. The service chooses one at construction
and hands it to the Node links, the surfaces and the drain:
L{SoloEdge} for an Edge on its own (it owns every node, forwards nothing,
has no peers), L{iop.edge.cluster.joined.EtcdCluster} with C{cluster:}
in edge.yaml.

L{Forward} is the outcome of a request another Edge should serve: the
surfaces recognise it here, so they never import the cluster.
"""

from typing import Any

from twisted.application.service import IService, Service
from twisted.internet import defer
from twisted.internet.defer import Deferred
from twisted.web.server import Request
from zope.interface import implementer

from iop.edge.spec import RunSpec


class Forward(Exception):
    """
    The service's answer for a request another Edge should serve: the
    surface proxies it to C{url} (that Edge's C{listen.peer}) with
    L{ICluster.proxy}.

    @ivar edge_id: the Edge that serves it.
    @ivar url: that Edge's peer listener (its C{advertise} URL).
    """

    def __init__(self, edge_id: str, url: str, why: str) -> None:
        super().__init__(f"forwarded to Edge {edge_id}: {why}")
        self.edge_id = edge_id
        self.url = url


class ICluster(IService):
    """
    The cluster as the Edge sees it. A service started with the Edge's
    tree; a stopping Edge says L{start_draining} at once and L{leave}s
    once its work is over.
    """

    def forward_target(spec: RunSpec) -> Forward | None:
        """
        Where a request that may be forwarded goes: C{None} to place it
        here, or the L{Forward} to answer it with.
        """

    def proxy(request: Request, forward: Forward) -> None:
        """
        Send C{request} (its body read) to the Edge C{forward} names and
        relay that Edge's answer to the caller.
        """

    def claim(node_id: str, generation: int) -> "Deferred[int]":
        """
        Make this Edge the owner of C{node_id}, whose new connection the
        registry gave C{generation}.

        @return: a Deferred firing with the connection's generation in the
            cluster, or failing with L{NotOwner}.
        """

    def holds(node_id: str, generation: int) -> bool:
        """
        Whether this Edge still owns C{node_id} under the claim of
        C{generation}.
        """

    def release(node_id: str, generation: int) -> None:
        """
        Give up the claim of C{generation} on C{node_id} (its connection
        is gone); a later claim is left alone.
        """

    def annotate(status: dict[str, Any]) -> dict[str, Any]:
        """
        Add what the cluster knows to a C{/v1/status} snapshot.
        """

    def start_draining() -> None:
        """
        This Edge is draining: it takes no registrations, and other Edges
        stop forwarding to it.
        """

    def leave() -> "Deferred[None]":
        """
        Give every node back (the drain is over), so that its Nodes may
        register elsewhere as soon as their links close.
        """


class NotOwner(Exception):
    """
    This Edge may not own the node now: another Edge does, or the cluster
    cannot be asked (C{unreachable}).
    """

    def __init__(self, reason: str, unreachable: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.unreachable = unreachable


@implementer(ICluster)
class SoloEdge(Service):
    """
    The cluster of an Edge on its own: it owns every node under the
    generation the registry gives it, forwards nothing and shows nothing
    of a cluster in its status.
    """

    def forward_target(self, spec: RunSpec) -> Forward | None:
        return None

    def proxy(self, request: Request, forward: Forward) -> None:
        raise RuntimeError(f"an Edge on its own forwards nothing (asked to forward to {forward.edge_id})")

    def claim(self, node_id: str, generation: int) -> "Deferred[int]":
        return defer.succeed(generation)

    def holds(self, node_id: str, generation: int) -> bool:
        return True

    def release(self, node_id: str, generation: int) -> None:
        return None

    def annotate(self, status: dict[str, Any]) -> dict[str, Any]:
        return status

    def start_draining(self) -> None:
        return None

    def leave(self) -> "Deferred[None]":
        return defer.succeed(None)
