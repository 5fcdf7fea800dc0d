"""
The deadline on configuring (C{configure_timeout_sec}): an accepted
registration whose adapters are not running in time ends the attempt as
retryable, abandons the hung start, and leaves the host as it was for the
next attempt.
"""

from twisted.internet import defer
from twisted.internet.task import Clock
from twisted.test import iosim
from twisted.trial.unittest import SynchronousTestCase

from iop.node.host import AdapterHost
from iop.node.metrics import NodeMetrics
from iop.node.session import CLOSED, READY, NodeSession, RetryableRefusal
from iop.node.test.held import HeldStarts
from iop.protocols import messages
from iop.testing.node import FakeEdge, accepted, adapter_config, connect, elapse, hosted, make_context, node_config

READY_OK = messages.ready_response(ready=True)


class ConfigureDeadlineTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.metrics = NodeMetrics()
        self.starts = HeldStarts("slow")
        self.host = AdapterHost(self.clock, self.starts, self.metrics)
        self.context = make_context(self.clock, host=self.host, metrics=self.metrics, configure_timeout=30)

    def attempt(self, *adapters: messages.AdapterConfig) -> tuple[NodeSession, FakeEdge, iosim.IOPump]:
        """
        One attempt against an Edge that accepts C{adapters} and answers
        the ready.
        """
        edge = FakeEdge(accepted(node_config(*adapters)), READY_OK)
        session, pump = connect(self.context, edge)
        pump.flush()
        return session, edge, pump

    def test_deadline_refuses_retryably(self):
        """
        An adapter whose start does not end within C{configure_timeout}
        fails the attempt with L{RetryableRefusal} naming the key and the
        adapters that did not start, closes the connection, and no ready is
        sent.
        """
        session, edge, pump = self.attempt(adapter_config("fast"), adapter_config("slow"), adapter_config("later"))
        elapse(self.clock, pump, 29.5, step=0.5)
        self.assertNoResult(session.ready)
        elapse(self.clock, pump, 0.5)
        failure = self.failureResultOf(session.ready, RetryableRefusal)
        self.assertEqual(
            str(failure.value),
            "configuration not running within 30s (configure_timeout_sec): adapter(s) slow, later did not start",
        )
        self.assertIsNotNone(edge.lost_reason)
        self.successResultOf(session.lost)
        self.assertEqual(edge.kinds(), ["register_request"])

    def test_hung_start_cancelled_host_left_clean(self):
        """
        At the deadline the hung start is cancelled, and the adapters this
        attempt built (the started one and the hung one) are stopped and
        never registered; an adapter kept from an earlier session stays.
        The next attempt applies the same configuration afresh: one new
        instance per adapter, started once, and an in-flight gauge that
        counts only its work.
        """
        session, edge, pump = self.attempt(adapter_config("kept"))
        self.successResultOf(session.ready)
        kept = self.starts.instance("kept")
        edge.lose_connection()
        pump.flush()

        configs = (adapter_config("kept"), adapter_config("fast"), adapter_config("slow"))
        session, edge, pump = self.attempt(*configs)
        elapse(self.clock, pump, 30)
        self.failureResultOf(session.ready, RetryableRefusal)
        self.assertTrue(self.starts.held["slow"].called, "the hung start was not cancelled")
        fast, slow = self.starts.instance("fast"), self.starts.instance("slow")
        self.assertEqual((fast.started, fast.stopped), (1, 1))
        self.assertEqual((slow.started, slow.stopped), (1, 1))
        self.assertEqual([h.name for h in self.host.all()], ["kept"])
        self.assertIs(hosted(self.host, "kept").adapter, kept)
        self.assertEqual(kept.stopped, 0)
        self.assertEqual(self.host.starting, ())

        session, edge, pump = self.attempt(*configs)
        self.successResultOf(session.ready)
        self.assertEqual(sorted(h.name for h in self.host.all()), ["fast", "kept", "slow"])
        self.assertEqual([len(self.starts.built[name]) for name in ("kept", "fast", "slow")], [1, 2, 2])
        again = self.starts.instance("slow", 1)
        self.assertIs(hosted(self.host, "slow").adapter, again)
        self.assertEqual((again.started, again.stopped), (1, 0))
        self.assertEqual(kept.started, 1)
        hosted(self.host, "slow").gate.acquire()
        self.assertEqual(self.metrics.value("iop_node_in_flight", {"adapter": "slow"}), 1)

    def test_late_completion_does_nothing(self):
        """
        The back end answering the abandoned start after the deadline
        changes nothing: no ready is sent, no adapter is registered, the
        attempt stays refused once and retryable (the cancelled apply's
        failure is not taken for a fatal configuration error, nor logged).
        """
        session, edge, pump = self.attempt(adapter_config("slow"))
        elapse(self.clock, pump, 30)
        self.failureResultOf(session.ready, RetryableRefusal)

        self.starts.held["slow"].callback(None)
        elapse(self.clock, pump, 15)
        self.assertEqual(edge.kinds(), ["register_request"])
        self.assertEqual(self.host.all(), [])
        self.assertEqual(session.state, CLOSED)
        self.assertFalse(self.context.transport.connected)

    def test_slow_start_in_time_gets_ready(self):
        """
        A start that takes most of C{configure_timeout} but ends in time
        gets the session ready, and the deadline does not fire later.
        """
        session, edge, pump = self.attempt(adapter_config("slow"))
        elapse(self.clock, pump, 29)
        self.assertNoResult(session.ready)
        self.starts.held["slow"].callback(None)
        pump.flush()
        self.assertIs(self.successResultOf(session.ready), session)
        elapse(self.clock, pump, 60)
        self.assertEqual(session.state, READY)
        self.assertIsNone(edge.lost_reason)
        self.assertEqual(self.starts.instance("slow").stopped, 0)

    def test_session_owners_late(self):
        """
        The deadline covers the wait for the run store's session owners
        too, and says that is what it waited for.
        """
        uses: defer.Deferred[list[tuple[str, str, str]]] = defer.Deferred()
        self.context.owners.load(uses)
        session, edge, pump = self.attempt(adapter_config("fast"))
        elapse(self.clock, pump, 30)
        failure = self.failureResultOf(session.ready, RetryableRefusal)
        self.assertIn("the run store's session owners did not load", str(failure.value))
        uses.callback([])
        session, edge, pump = self.attempt(adapter_config("fast"))
        self.successResultOf(session.ready)

    def test_connection_lost_while_configuring(self):
        """
        The Edge closing the connection while a start hangs abandons the
        apply as the deadline would: the hung start does not hold the host,
        and the next attempt gets ready.
        """
        session, edge, pump = self.attempt(adapter_config("slow"))
        edge.lose_connection()
        pump.flush()
        failure = self.failureResultOf(session.ready, RetryableRefusal)
        self.assertIn("connection lost during registration", str(failure.value))
        self.assertTrue(self.starts.held["slow"].called, "the hung start was not cancelled")
        self.assertEqual(self.starts.instance("slow").stopped, 1)
        self.assertEqual(self.host.all(), [])

        session, edge, pump = self.attempt(adapter_config("slow"))
        self.successResultOf(session.ready)

    def test_refresh_refused_at_the_deadline(self):
        """
        A refresh whose adapter's start hangs is refused at
        C{configure_timeout} naming the key and the adapter: the previous
        adapters keep running, the hung start is cancelled, the session
        stays ready, and the next refresh applies.
        """
        session, edge, pump = self.attempt(adapter_config("kept"))
        self.successResultOf(session.ready)
        kept = self.starts.instance("kept")
        refresh = node_config(adapter_config("kept"), adapter_config("slow"))
        edge.connection.send(messages.config_refresh(config=refresh, request_id="r1"))
        pump.flush()
        elapse(self.clock, pump, 29.5, step=0.5)
        self.assertEqual(edge.of("node_command_response"), [])
        elapse(self.clock, pump, 0.5)
        (answer,) = edge.of("node_command_response")
        self.assertEqual((answer.request_id, answer.ok, answer.code), ("r1", False, "refused"))
        self.assertEqual(
            answer.error, "refresh not running within 30s (configure_timeout_sec): adapter(s) slow did not start"
        )
        self.assertTrue(self.starts.held["slow"].called, "the hung start was not cancelled")
        self.assertEqual([h.name for h in self.host.all()], ["kept"])
        self.assertIs(hosted(self.host, "kept").adapter, kept)
        self.assertEqual(session.state, READY)
        edge.connection.send(messages.config_refresh(config=refresh, request_id="r2"))
        pump.flush()
        self.assertEqual(
            [(r.request_id, r.ok) for r in edge.of("node_command_response")], [("r1", False), ("r2", True)]
        )
