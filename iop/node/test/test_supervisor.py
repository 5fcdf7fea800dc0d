"""
The connection supervisor: one retry policy for failed dials, refused or
timed-out handshakes and lost sessions; the attempt count and its reset;
and how each terminal outcome becomes an exit status.
"""

from collections.abc import Callable
from random import Random

from twisted.internet import defer
from twisted.internet.error import ConnectionRefusedError
from twisted.internet.interfaces import IStreamClientEndpoint
from twisted.internet.task import Clock
from twisted.logger import LogLevel, capturedLogs, formatEvent
from twisted.test import iosim
from twisted.trial.unittest import SynchronousTestCase
from zope.interface import implementer

from iop.node.config import ReconnectPolicy
from iop.node.exit import EXIT_EXHAUSTED, EXIT_INCOMPATIBLE, EXIT_REFUSED, ProcessExit
from iop.node.host import AdapterHost
from iop.node.supervisor import Supervisor
from iop.node.test.held import HeldStarts
from iop.protocols import messages
from iop.protocols.wire import WireProtocol
from iop.testing.node import (
    FakeEdge,
    RecordingExit,
    accepted,
    adapter_config,
    make_context,
    node_config,
    run_request,
)

READY_OK = messages.ready_response(ready=True)


@implementer(IStreamClientEndpoint)
class FakeEndpoint:
    """
    A client endpoint whose every dial the test answers: refuse it, or
    connect it in memory to a L{FakeEdge}.
    """

    def __init__(self, clock):
        self.clock = clock
        self.pending = []
        self.dials = 0

    def connect(self, factory):
        self.dials += 1
        d: defer.Deferred[object] = defer.Deferred()
        self.pending.append((factory, d))
        return d

    def refuse(self):
        factory, d = self.pending.pop(0)
        d.errback(ConnectionRefusedError("nobody home"))

    def accept(self, edge):
        factory, d = self.pending.pop(0)
        protocol = factory.buildProtocol(None)
        server = WireProtocol(edge, self.clock)
        pump = iosim.connect(
            server,
            iosim.makeFakeServer(server),
            protocol,
            iosim.makeFakeClient(protocol),
            greet=False,
            clock=self.clock,
        )
        d.callback(protocol)
        pump.flush()
        return pump


def ready_edge():
    return FakeEdge(accepted(node_config(adapter_config("manual"))), READY_OK)


class SupervisorTestsMixin(SynchronousTestCase):
    def supervisor(self, max_attempts=10, interval_sec=10.0, **context_args):
        self.clock = Clock()
        self.context = make_context(self.clock, **context_args)
        self.context.transport.edge = "tcp:host=edge.test:port=7100"
        self.endpoint = FakeEndpoint(self.clock)
        self.exit = RecordingExit()
        supervisor = Supervisor(
            # A fixed interval, so the tests can step to each attempt.
            self.endpoint,
            self.context,
            ReconnectPolicy(max_attempts, interval_sec, jitter=0),
            self.clock,
            self.exit,
        )
        supervisor.startService()
        self.addCleanup(self.stop, supervisor)
        return supervisor

    def stop(self, supervisor):
        if supervisor.running:
            supervisor.stopService()
        self.clock.advance(0)

    def fail_attempts(self, count, interval):
        for _ in range(count):
            self.endpoint.refuse()
            self.clock.advance(interval)


class PolicyTests(SupervisorTestsMixin, SynchronousTestCase):
    def test_default_gives_up_after_ten(self):
        """
        With the default policy (10 attempts, 10 s apart), nine failed
        attempts are retried and the tenth ends the Node with status 3 and
        a message giving the count.
        """
        self.supervisor()
        self.fail_attempts(9, 10)
        self.assertEqual(self.endpoint.dials, 10)
        self.assertEqual(self.exit.calls, [])
        self.endpoint.refuse()
        self.clock.advance(0)
        [(status, message)] = self.exit.calls
        self.assertEqual(status, EXIT_EXHAUSTED)
        self.assertIn("10 consecutive connect attempts failed", message)
        self.assertIn("nobody home", message)

    def test_finite(self):
        """
        max_attempts=2: the second consecutive failure ends the Node with
        status 3, after exactly one retry at the configured interval.
        """
        self.supervisor(max_attempts=2, interval_sec=0.2)
        self.endpoint.refuse()
        self.clock.advance(0.19)
        self.assertEqual(self.endpoint.dials, 1)
        self.clock.advance(0.01)
        self.assertEqual(self.endpoint.dials, 2)
        self.endpoint.refuse()
        self.assertEqual(self.exit.calls, [], "exit must be scheduled, not re-entrant")
        self.clock.advance(0)
        self.assertEqual(self.exit.calls[0][0], EXIT_EXHAUSTED)
        self.assertIn("2 consecutive connect attempts failed", self.exit.calls[0][1])

    def test_unlimited(self):
        """
        max_attempts=0 never gives up.
        """
        self.supervisor(max_attempts=0, interval_sec=1)
        self.fail_attempts(200, 1)
        self.assertEqual(self.exit.calls, [])
        self.assertEqual(self.endpoint.dials, 201)

    def test_jittered_pauses(self):
        """
        With jitter, each pause between attempts is drawn from the
        supervisor's random source within interval * (1 +/- jitter): Nodes
        that lost their Edge together spread their redials out.
        """
        self.clock = Clock()
        self.context = make_context(self.clock)
        self.endpoint = FakeEndpoint(self.clock)
        draws = []

        class Drawn(Random):
            def uniform(self, low: float, high: float) -> float:
                draws.append((low, high))
                return high

        supervisor = Supervisor(
            self.endpoint, self.context, ReconnectPolicy(0, 4.0, jitter=0.25), self.clock, RecordingExit(), Drawn()
        )
        supervisor.startService()
        self.addCleanup(self.stop, supervisor)
        self.endpoint.refuse()
        self.clock.advance(4.9)
        self.assertEqual(self.endpoint.dials, 1)
        self.clock.advance(0.1)
        self.assertEqual(self.endpoint.dials, 2)
        self.assertEqual(draws, [(3.0, 5.0)])

    def test_retry_logged(self):
        """
        Each failed attempt is logged with its number, the reason and the
        delay before the next one.
        """
        with capturedLogs() as events:
            self.supervisor(max_attempts=3, interval_sec=2.5)
            self.endpoint.refuse()
        texts = [formatEvent(e) for e in events if "connect attempt" in e.get("log_format", "")]
        self.assertEqual(
            texts, ["connect attempt 1 failed: Connection was refused by other side: nobody home; retrying in 2.5s"]
        )
        self.assertFalse([e for e in events if "Scheduling retry" in e.get("log_format", "")])

    def test_count_resets_once_ready(self):
        """
        The count of consecutive failures resets once a session becomes
        ready: failures before and after a ready session do not add up.
        """
        supervisor = self.supervisor(max_attempts=3, interval_sec=1)
        self.fail_attempts(2, 1)
        self.assertEqual(supervisor.failures, 2)
        edge = ready_edge()
        pump = self.endpoint.accept(edge)
        self.assertIsNotNone(supervisor.ready_session)
        self.assertEqual(supervisor.failures, 0)
        self.assertEqual(self.context.transport.sessions, 1)

        edge.lose_connection()
        pump.flush()
        self.assertIsNone(supervisor.ready_session)
        self.clock.advance(1)
        self.fail_attempts(2, 1)
        self.assertEqual(self.exit.calls, [])
        self.endpoint.refuse()
        self.clock.advance(0)
        self.assertEqual(self.exit.calls[0][0], EXIT_EXHAUSTED)

    def test_lost_session_reconnects(self):
        """
        A lost ready session is retried under the same policy, and the
        next ready session is announced through C{when_ready}.
        """
        supervisor = self.supervisor(max_attempts=1, interval_sec=1)
        edge = ready_edge()
        pump = self.endpoint.accept(edge)
        first = self.successResultOf(supervisor.when_ready())
        edge.lose_connection()
        pump.flush()
        waiting = supervisor.when_ready()
        self.assertNoResult(waiting)
        self.clock.advance(1)
        self.endpoint.accept(ready_edge())
        second = self.successResultOf(waiting)
        self.assertIsNot(first, second)
        self.assertEqual(self.exit.calls, [])

    def test_edge_draining_loss_not_counted(self):
        """
        A ready session whose Edge said C{EdgeDraining} and then closed is
        reconnected after the normal interval, counts no failed attempt
        (with max_attempts=1 a counted failure would end the Node), and is
        logged at info level as the Edge draining, not as an unexpected
        loss.
        """
        supervisor = self.supervisor(max_attempts=1, interval_sec=3)
        edge = ready_edge()
        pump = self.endpoint.accept(edge)
        edge.wire.send(messages.edge_draining(grace_sec=10, reason="edge restarting"))
        pump.flush()
        with capturedLogs() as events:
            edge.lose_connection()
            pump.flush()
            self.clock.advance(0)
        self.assertEqual(supervisor.failures, 0)
        self.assertEqual(self.exit.calls, [])
        [event] = [e for e in events if "reconnecting" in e.get("log_format", "")]
        self.assertEqual(event["log_level"], LogLevel.info)
        self.assertIn("the Edge was draining", formatEvent(event))
        self.assertIn("reconnecting in 3s", formatEvent(event))
        self.clock.advance(2.9)
        self.assertEqual(self.endpoint.dials, 1)
        self.clock.advance(0.1)
        self.assertEqual(self.endpoint.dials, 2)

    def test_unexpected_loss_warns(self):
        """
        Without C{EdgeDraining}, losing a ready session is a warning.
        """
        self.supervisor(max_attempts=1, interval_sec=3)
        edge = ready_edge()
        pump = self.endpoint.accept(edge)
        with capturedLogs() as events:
            edge.lose_connection()
            pump.flush()
        [event] = [e for e in events if "reconnecting" in e.get("log_format", "")]
        self.assertEqual(event["log_level"], LogLevel.warn)
        self.assertIn("connection to the Edge lost", formatEvent(event))

    def test_retryable_refusal_counts(self):
        """
        A duplicate-connection refusal is a failed attempt like a refused
        dial: with max_attempts=1 it ends the Node with status 3.
        """
        self.supervisor(max_attempts=1, interval_sec=1)
        edge = FakeEdge(messages.register_refused(messages.DUPLICATE_CONNECTION, "dup"))
        self.endpoint.accept(edge)
        self.clock.advance(0)
        [(status, message)] = self.exit.calls
        self.assertEqual(status, EXIT_EXHAUSTED)
        self.assertIn("DUPLICATE_CONNECTION", message)

    def test_register_timeout_counts(self):
        """
        A handshake the Edge never answers fails the attempt after
        register_timeout_sec, and the Node retries.
        """
        supervisor = self.supervisor(max_attempts=5, interval_sec=1, register_timeout=10)
        edge = FakeEdge()
        pump = self.endpoint.accept(edge)
        self.assertEqual(supervisor.failures, 0)
        self.clock.advance(10)
        pump.flush()
        self.assertEqual(supervisor.failures, 1)
        self.clock.advance(1)
        self.assertEqual(self.endpoint.dials, 2)

    def test_configure_timeout_counts(self):
        """
        Adapters that do not start within configure_timeout_sec fail the
        attempt: its warning names them, the count goes up, and the Node
        retries after the interval.
        """
        supervisor = self.supervisor(max_attempts=5, interval_sec=1, configure_timeout=5)
        self.context.host = AdapterHost(self.clock, HeldStarts("slow"))
        with capturedLogs() as events:
            pump = self.endpoint.accept(FakeEdge(accepted(node_config(adapter_config("slow"))), READY_OK))
            for _ in range(5):  # a second at a time: the heartbeats keep the link
                self.clock.advance(1)
                pump.flush()
        self.assertEqual(supervisor.failures, 1)
        warnings = [formatEvent(e) for e in events if e["log_level"] >= LogLevel.warn]
        self.assertEqual(
            [line for line in warnings if line.startswith("connect attempt")],
            [
                "connect attempt 1 failed: configuration not running within 5s (configure_timeout_sec): "
                "adapter(s) slow did not start; retrying in 1s"
            ],
        )
        self.clock.advance(1)
        self.assertEqual(self.endpoint.dials, 2)


class OutcomeTests(SupervisorTestsMixin, SynchronousTestCase):
    def test_fatal_refusal_exits_two(self):
        """
        An unknown token ends the Node with status 2 and a message naming
        the cause; it is not retried.
        """
        self.supervisor(max_attempts=0, interval_sec=1)
        edge = FakeEdge(messages.register_refused(messages.UNKNOWN_TOKEN, "token matches no node"))
        with capturedLogs() as events:
            pump = self.endpoint.accept(edge)
            pump.flush()
            self.clock.advance(0)
        [(status, message)] = self.exit.calls
        self.assertEqual(status, EXIT_REFUSED)
        self.assertIn("UNKNOWN_TOKEN", message)
        self.assertIn("token matches no node", message)
        self.assertFalse([e for e in events if "retrying" in e.get("log_format", "")])

    def test_incompatible_version_exits_four(self):
        """
        An Edge that cannot serve this Node's wire version ends the Node
        with its own status, 4, and the Edge's reason.
        """
        self.supervisor(max_attempts=0, interval_sec=1)
        edge = FakeEdge(messages.register_refused(messages.INCOMPATIBLE_VERSION, "edge speaks 3 to 5"))
        self.endpoint.accept(edge)
        self.clock.advance(100)
        [(status, message)] = self.exit.calls
        self.assertEqual(status, EXIT_INCOMPATIBLE)
        self.assertIn("INCOMPATIBLE_VERSION", message)
        self.assertIn("edge speaks 3 to 5", message)

    def test_adapter_build_failure_exits_two(self):
        """
        An adapter the Node cannot build is fatal too (status 2).
        """
        self.supervisor()
        edge = FakeEdge(accepted(node_config(adapter_config("bad", type="broken"))), READY_OK)
        self.endpoint.accept(edge)
        self.clock.advance(0)
        self.assertEqual(self.exit.calls[0][0], EXIT_REFUSED)
        self.assertIn("adapter bad", self.exit.calls[0][1])

    def test_stop_service_cancels_work(self):
        """
        Stopping the supervisor cancels in-flight runs (telling the Edge),
        closes the connection, stops retrying, and its Deferred fires once
        the connection is gone.
        """
        supervisor = self.supervisor()
        edge = ready_edge()
        pump = self.endpoint.accept(edge)
        edge.connection.send(run_request("r1"))
        pump.flush()
        d = supervisor.stopService()
        pump.flush()
        self.successResultOf(d)
        self.assertEqual([e.type for e in edge.of("run_event")], ["cancelled"])
        self.assertIsNotNone(edge.lost_reason)
        self.clock.advance(100)
        self.assertEqual(self.endpoint.dials, 1)
        self.assertEqual(self.exit.calls, [])

    def test_stop_while_waiting(self):
        """
        Stopping between attempts cancels the pending retry.
        """
        supervisor = self.supervisor(interval_sec=5)
        self.endpoint.refuse()
        self.successResultOf(supervisor.stopService())
        self.clock.advance(10)
        self.assertEqual(self.endpoint.dials, 1)


class FakeReactor:
    def __init__(self):
        self.stopped = 0

    def stop(self):
        self.stopped += 1


class ProcessExitTests(SynchronousTestCase):
    def test_non_zero_status(self):
        """
        A non-zero status stops the reactor and leaves an atexit hook that
        ends the process with that status.
        """
        reactor = FakeReactor()
        hooks: list[tuple[Callable[..., object], tuple[object, ...]]] = []
        exits: list[int] = []
        exit = ProcessExit(reactor, register=lambda f, *a: hooks.append((f, a)), hard_exit=exits.append)
        exit(3, "giving up")
        self.assertEqual(reactor.stopped, 1)
        [(hook, args)] = hooks
        hook(*args)
        self.assertEqual(exits, [3])

    def test_only_first_call_counts(self):
        """
        A second exit request (say, exhaustion racing a fatal refusal) is
        ignored.
        """
        reactor, hooks = FakeReactor(), []
        exit = ProcessExit(reactor, register=lambda f, *a: hooks.append(a), hard_exit=lambda s: None)
        exit(2, "refused")
        exit(3, "exhausted")
        self.assertEqual(hooks, [(2,)])
        self.assertEqual(reactor.stopped, 1)

    def test_zero_status_leaves_twistd_alone(self):
        """
        Status 0 just stops the reactor (twistd exits 0 by itself).
        """
        reactor, hooks = FakeReactor(), []
        ProcessExit(reactor, register=lambda f, *a: hooks.append(a), hard_exit=lambda s: None)(0, "bye")
        self.assertEqual(hooks, [])
        self.assertEqual(reactor.stopped, 1)


class SeveralEdgesTests(SynchronousTestCase):
    """
    A Node configured with several Edges (an Edge cluster) tries them in
    turn under one policy.
    """

    def supervisor(self, max_attempts=0, interval_sec=1.0):
        from iop.node.edges import EdgeRotation

        self.clock = Clock()
        self.context = make_context(self.clock)
        self.a, self.b = FakeEndpoint(self.clock), FakeEndpoint(self.clock)
        rotation = EdgeRotation([("tcp:host=a:port=1", self.a), ("tcp:host=b:port=1", self.b)])
        self.exit = RecordingExit()
        supervisor = Supervisor(
            rotation, self.context, ReconnectPolicy(max_attempts, interval_sec, jitter=0), self.clock, self.exit
        )
        supervisor.startService()

        def stop():
            supervisor.stopService()
            self.clock.advance(0)

        self.addCleanup(stop)
        return supervisor

    def test_failed_attempt_moves_on(self):
        """
        A refused dial counts as a failed attempt and the next dial goes
        to the next Edge, and round again; the count is shared, so
        max_attempts failures anywhere end the Node.
        """
        supervisor = self.supervisor(max_attempts=3)
        self.assertEqual((self.a.dials, self.b.dials), (1, 0))
        self.a.refuse()
        self.assertEqual(self.context.transport.edge, "tcp:host=b:port=1")
        self.clock.advance(1)
        self.assertEqual((self.a.dials, self.b.dials), (1, 1))
        self.b.refuse()
        self.clock.advance(1)
        self.assertEqual((self.a.dials, self.b.dials), (2, 1))
        self.assertEqual(supervisor.failures, 2)
        self.a.refuse()
        self.clock.advance(0)
        [(status, message)] = self.exit.calls
        self.assertEqual(status, EXIT_EXHAUSTED)
        self.assertIn("tcp:host=a:port=1, tcp:host=b:port=1", message)

    def test_lost_session_moves_on(self):
        """
        A ready session lost (its Edge died) sends the Node to the next
        Edge without a failed attempt.
        """
        supervisor = self.supervisor()
        edge = ready_edge()
        pump = self.a.accept(edge)
        edge.lose_connection()
        pump.flush()
        self.clock.advance(1)
        self.assertEqual((self.a.dials, self.b.dials), (1, 1))
        self.assertEqual(supervisor.failures, 0)

    def test_drained_edge_moves_on_uncounted(self):
        """
        An Edge that drains sends its Node to the next Edge, which takes
        it; no failed attempt is counted (max_attempts=1 would end it).
        """
        supervisor = self.supervisor(max_attempts=1)
        edge = ready_edge()
        pump = self.a.accept(edge)
        edge.wire.send(messages.edge_draining(grace_sec=10, reason="edge stopping"))
        pump.flush()
        edge.lose_connection()
        pump.flush()
        self.clock.advance(1)
        self.assertEqual(self.b.dials, 1)
        self.b.accept(ready_edge())
        self.assertIsNotNone(supervisor.ready_session)
        self.assertEqual(supervisor.failures, 0)
        self.assertEqual(self.exit.calls, [])
