"""
The event bus fans events out without letting one subscriber hold up
another or the publisher.
"""

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from iop.edge.bus import EventBus


class EventBusTests(SynchronousTestCase):
    def setUp(self):
        self.clock = Clock()
        self.bus = EventBus(self.clock, backlog=3)

    def test_fan_out_on_next_turn(self):
        """
        Every subscriber gets every event of its topics, in order, on the
        next reactor turn (never inside publish).
        """
        a, b = [], []
        self.bus.subscribe(lambda topic, event: a.append((topic, event)))
        self.bus.subscribe(lambda topic, event: b.append(event), topics=["node"])
        self.bus.publish("run", {"n": 1})
        self.bus.node_event("n1", "ready")
        self.assertEqual((a, b), ([], []))
        self.clock.advance(0)
        self.assertEqual(a, [("run", {"n": 1}), ("node", {"node": "n1", "event": "ready"})])
        self.assertEqual(b, [{"node": "n1", "event": "ready"}])

    def test_deltas_only_when_asked(self):
        """
        C{run_delta} reaches only subscribers that name it; C{wants} says
        whether anyone does, so a publisher can skip the work.
        """
        every, deltas = [], []
        self.bus.subscribe(lambda topic, event: every.append(topic))
        self.assertFalse(self.bus.wants("run_delta"))
        self.assertTrue(self.bus.wants("run"))
        subscription = self.bus.subscribe(lambda topic, event: deltas.append(topic), topics=["run", "run_delta"])
        self.assertTrue(self.bus.wants("run_delta"))
        self.bus.publish("run_delta", {})
        self.bus.publish("run", {})
        self.clock.advance(0)
        self.assertEqual((every, deltas), (["run"], ["run_delta", "run"]))
        subscription.cancel()
        self.assertFalse(self.bus.wants("run_delta"))

    def test_failing_subscriber_isolated(self):
        """
        A subscriber that raises is logged and does not stop delivery to the
        others or to itself later.
        """
        good = []
        calls = []

        def bad(topic, event):
            calls.append(event)
            raise RuntimeError("boom")

        self.bus.subscribe(bad)
        self.bus.subscribe(lambda topic, event: good.append(event))
        self.bus.publish("run", {"n": 1})
        self.bus.publish("run", {"n": 2})
        self.clock.advance(0)
        self.assertEqual(good, [{"n": 1}, {"n": 2}])
        self.assertEqual(calls, [{"n": 1}, {"n": 2}])
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 2)

    def test_backlog_bounded(self):
        """
        Events published faster than a subscriber is served are kept up to
        its backlog: it gets the newest ones and counts what it lost, and
        publishing never waits.
        """
        got = []
        subscription = self.bus.subscribe(lambda topic, event: got.append(event))
        for i in range(5):
            self.bus.publish("run", {"n": i})
        self.assertEqual(subscription.dropped, 2)
        self.clock.advance(0)
        self.assertEqual(got, [{"n": 2}, {"n": 3}, {"n": 4}])
        self.bus.publish("run", {"n": 5})
        self.clock.advance(0)
        self.assertEqual(got, [{"n": 2}, {"n": 3}, {"n": 4}, {"n": 5}])

    def test_cancel(self):
        """
        A cancelled subscription receives nothing more and leaves no timer.
        """
        got = []
        subscription = self.bus.subscribe(lambda topic, event: got.append(event))
        self.bus.publish("run", {"n": 1})
        subscription.cancel()
        self.clock.advance(0)
        self.assertEqual(got, [])
        self.assertEqual(self.clock.getDelayedCalls(), [])
        self.assertNotIn(subscription, self.bus.subscriptions)
