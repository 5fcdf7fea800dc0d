"""
The Edge's in-process event bus: run, tunnel and node lifecycle events fan
out to subscribers (metrics, the status page, the events feed
C{GET /v1/events}, the manhole, tests).

Topics: C{run} (a run's start and terminal), C{tunnel} (a tunnel's start,
end and error), C{node} (lifecycle), and C{run_delta} (every delta of
every run), which only a subscriber that names it receives: with nobody
asking, deltas are not even published, so the hot path stays lean.

Publishing never waits for a subscriber. Each subscriber has its own
bounded backlog drained on the next reactor turn, so a slow or failing
subscriber loses its own oldest events (counted in C{dropped}) and never
stalls the others or the publisher.
"""

from collections import deque

from twisted.logger import Logger

#: Node lifecycle event kinds.
REGISTERED = "registered"
READY = "ready"
DRAINING = "draining"
DISCONNECTED = "disconnected"
REJECTED = "rejected"


#: Topics a subscriber receives only when it names them.
OPT_IN_TOPICS = frozenset({"run_delta"})


class Subscription:
    """
    One subscriber's queue. C{cancel()} stops delivery.
    """

    def __init__(self, bus, callback, topics, backlog, opt_in=frozenset()):
        self.bus = bus
        self.callback = callback
        self.topics = topics
        self.opt_in = opt_in
        self.pending = deque(maxlen=backlog)
        self.dropped = 0
        self._scheduled = None

    def accepts(self, topic):
        if self.topics is None:
            return topic not in OPT_IN_TOPICS or topic in self.opt_in
        return topic in self.topics

    def offer(self, topic, event):
        if not self.accepts(topic):
            return
        if len(self.pending) == self.pending.maxlen:
            self.dropped += 1
        self.pending.append((topic, event))
        if self._scheduled is None:
            self._scheduled = self.bus.clock.callLater(0, self._drain)

    def _drain(self):
        self._scheduled = None
        while self.pending:
            topic, event = self.pending.popleft()
            try:
                self.callback(topic, event)
            except Exception:
                self.bus.log.failure("event bus subscriber failed on {topic}", topic=topic)

    def cancel(self):
        if self._scheduled is not None and self._scheduled.active():
            self._scheduled.cancel()
        self._scheduled = None
        self.pending.clear()
        self.bus.subscriptions.discard(self)


class EventBus:
    """
    Topics are C{"run"} and C{"tunnel"} (payload: a dict with C{run_id},
    C{node}, C{type}, ...; see L{iop.edge.runs}), C{"run_delta"} (opt-in)
    and C{"node"} (payload: C{{"node": id, "event": kind, ...}}).
    """

    log = Logger()

    def __init__(self, clock, backlog=1000):
        self.clock = clock
        self.backlog = backlog
        self.subscriptions = set()

    def subscribe(self, callback, topics=None, opt_in=()):
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

    def wants(self, topic):
        """
        Whether any subscriber takes C{topic} (so a publisher can skip
        building a payload nobody reads).
        """
        return any(subscription.accepts(topic) for subscription in self.subscriptions)

    def publish(self, topic, payload):
        for subscription in list(self.subscriptions):
            subscription.offer(topic, payload)

    def node_event(self, node_id, kind, **details):
        self.publish("node", dict(node=node_id, event=kind, **details))
