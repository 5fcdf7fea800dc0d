"""
Nodes still on their way in: work that only they could serve waits for
them here rather than failing at once.

In an Edge cluster another Edge forwards a request to this one as soon as
it sees that this Edge owns a node of the request's group (the claim is
written at registration: docs/cluster.md, "Serving a caller at any
Edge"), which may be before the node is ready here and its providers
live. Such a request waits for the node's news — ready, or its ready
refused — for at most its group's queue timeout (a connection that goes
before its ready publishes no news: the bound ends that wait), and is
then placed as usual (served, queued, or refused for want of a live
provider).
"""

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime

from iop.edge.bus import DISCONNECTED, READY, REJECTED, EventBus, Subscription
from iop.edge.registry import NodeRegistry

#: The node events that end a wait: the node is live, or will not be.
_NEWS = frozenset((READY, REJECTED, DISCONNECTED))


class Arrivals:
    """
    @param clock: for the waits' bounds.
    @param bus: whose C{node} events say a node is ready, refused or gone.
    @param registry: which nodes are registering here.
    """

    def __init__(self, clock: IReactorTime, bus: EventBus, registry: NodeRegistry) -> None:
        self.clock = clock
        self.bus = bus
        self.registry = registry
        self._waiting: dict[Deferred[None], tuple[frozenset[str], IDelayedCall]] = {}
        self._subscription: Subscription | None = None

    def registering(self, node_ids: list[str]) -> list[str]:
        """
        Those of C{node_ids} connected here but not ready yet.
        """
        return [n for n in node_ids if self.registry.owner(n) is not None and self.registry.ready_link(n) is None]

    def __len__(self) -> int:
        return len(self._waiting)

    def wait(self, node_ids: list[str], timeout: float) -> "Deferred[None]":
        """
        @return: a Deferred firing when one of C{node_ids} is ready, refused
            or gone, or after C{timeout} seconds; cancelling it ends the wait.
        """
        d: Deferred[None] = Deferred(self._cancelled)
        timer = self.clock.callLater(timeout, self._fire, d)
        self._waiting[d] = (frozenset(node_ids), timer)
        if self._subscription is None:
            self._subscription = self.bus.subscribe(self._event, ["node"])
        return d

    def _event(self, topic: str, payload: dict[str, object]) -> None:
        if payload.get("event") not in _NEWS:
            return
        for d, (nodes, _) in list(self._waiting.items()):
            if payload.get("node") in nodes:
                self._fire(d)

    def _cancelled(self, d: "Deferred[None]") -> None:
        self._done(d)

    def _fire(self, d: "Deferred[None]") -> None:
        if self._done(d):
            d.callback(None)

    def _done(self, d: "Deferred[None]") -> bool:
        """
        Forget the wait of C{d}. @return: whether it was still waiting.
        """
        entry = self._waiting.pop(d, None)
        if entry is None:
            return False
        timer = entry[1]
        if timer.active():
            timer.cancel()
        if not self._waiting and self._subscription is not None:
            self._subscription.cancel()
            self._subscription = None
        return True
