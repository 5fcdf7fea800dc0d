"""
The Edge's in-process event bus: run, tunnel and node lifecycle events fan
out to subscribers (metrics, the status page, the events feed
C{GET /v1/events}, the manhole, tests).

Topics: C{run} (a run's start and terminal), C{tunnel} (a tunnel's start,
end and error), C{node} (lifecycle), and C{run_delta} (every delta of
every run), which only a subscriber that names it receives: with nobody
asking, deltas are not even published, so the hot path stays lean.

Publishing never waits for a subscriber. Each subscriber has its own
bounded backlog drained on the next reactor turn (every subscriber on one
timer, L{iop.turns.EndOfTurn}), so a slow or failing subscriber loses its
own oldest events (counted in C{dropped}) and never stalls the others or
the publisher.
"""

from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from iop.turns import EndOfTurn

#: Node lifecycle event kinds.
REGISTERED = "registered"
READY = "ready"
DRAINING = "draining"
DISCONNECTED = "disconnected"
REJECTED = "rejected"


#: Topics a subscriber receives only when it names them.
OPT_IN_TOPICS = frozenset({"run_delta"})

#: C{callback(topic, payload)}: what a subscriber is called with.
Subscriber = Callable[[str, dict[str, Any]], None]


class Subscription:
    """
    One subscriber's queue. C{cancel()} stops delivery.
    """

    def __init__(
        self,
        bus: "EventBus",
        callback: Subscriber,
        topics: frozenset[str] | None,
        backlog: int,
        opt_in: frozenset[str] = frozenset(),
    ) -> None:
        self.bus = bus
        self.callback = callback
        self.topics = topics
        self.opt_in = opt_in
        self.pending: deque[tuple[str, dict[str, Any]]] = deque(maxlen=backlog)
        self.dropped = 0
        #: Whether a drain is asked for at the end of this turn.
        self._scheduled = False

    def accepts(self, topic: str) -> bool:
        if self.topics is None:
            return topic not in OPT_IN_TOPICS or topic in self.opt_in
        return topic in self.topics

    def offer(self, topic: str, event: dict[str, Any]) -> None:
        if not self.accepts(topic):
            return
        if len(self.pending) == self.pending.maxlen:
            self.dropped += 1
        self.pending.append((topic, event))
        if not self._scheduled:
            self._scheduled = True
            self.bus.turns.at_end(self._drain)

    def _drain(self) -> None:
        self._scheduled = False
        while self.pending:
            topic, event = self.pending.popleft()
            try:
                self.callback(topic, event)
            except Exception:
                self.bus.log.failure("event bus subscriber failed on {topic}", topic=topic)

    def cancel(self) -> None:
        # (A drain already asked for finds nothing.)
        self.pending.clear()
        self.bus.subscriptions.discard(self)


class EventBus:
    """
    Topics are C{"run"} and C{"tunnel"} (payload: a dict with C{run_id},
    C{node}, C{type}, ...; see L{iop.edge.runs}), C{"run_delta"} (opt-in)
    and C{"node"} (payload: C{{"node": id, "event": kind, ...}}).
    """

    log = Logger()

    def __init__(self, clock: IReactorTime, backlog: int = 1000) -> None:
        self.turns = EndOfTurn(clock)
        self.backlog = backlog
        self.subscriptions: set[Subscription] = set()

    def subscribe(
        self, callback: Subscriber, topics: Iterable[str] | None = None, opt_in: Iterable[str] = ()
    ) -> Subscription:
        """
        Call C{callback(topic, payload)} for every event of C{topics}
        (when C{None}: every topic but the opt-in ones, plus those of them
        named in C{opt_in}).
        """
        subscription = Subscription(
            self, callback, None if topics is None else frozenset(topics), self.backlog, frozenset(opt_in)
        )
        self.subscriptions.add(subscription)
        return subscription

    def wants(self, topic: str) -> bool:
        """
        Whether any subscriber takes C{topic} (so a publisher can skip
        building a payload nobody reads).
        """
        return any(subscription.accepts(topic) for subscription in self.subscriptions)

    def publish(self, topic: str, payload: dict[str, Any]) -> None:
        for subscription in list(self.subscriptions):
            subscription.offer(topic, payload)

    def node_event(self, node_id: str, kind: str, **details: Any) -> None:

        self.publish("node", dict(node=node_id, event=kind, **details))
