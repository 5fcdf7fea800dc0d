"""
Graceful drain on a local shutdown: work in flight may finish within the
grace period, new work is refused, the Edge is told (when it understands),
the rest is cancelled with its terminals sent, a second signal ends it at
once, and the whole Node service stops only when all of that is done.
"""

from twisted.internet.task import Clock
from twisted.internet.testing import MemoryReactorClock
from twisted.trial.unittest import SynchronousTestCase

from iop.node.config import NodeConfig, ReconnectPolicy
from iop.node.service import SHUTDOWN_REASON, NodeService
from iop.protocols import messages
from iop.run import DELTA, NODE_DRAINING, RunEventData
from iop.testing.node import (
    TOKEN,
    FakeEdge,
    RecordingExit,
    RecordingStore,
    accepted,
    adapter_config,
    build,
    dialled,
    elapse,
    hosted,
    manual,
    node_config,
    ready_node,
    run_request,
    tunnel_request,
)

REASON = SHUTDOWN_REASON


def run_events(edge):
    return [(e.run_id, e.type) for e in edge.of("run_event")]


class SessionDrainTests(SynchronousTestCase):
    def setUp(self):
        self.store = RecordingStore()
        self.clock = Clock()
        self.session, self.edge, self.pump, self.context = ready_node(clock=self.clock, store=self.store)
        self.adapter = manual(self.context.host, "manual")

    def start(self, *requests):
        for request in requests:
            self.edge.connection.send(request)
        self.pump.flush()

    def elapse(self, seconds):
        elapse(self.clock, self.pump, seconds)

    def test_nothing_in_flight_ends_at_once(self):
        """
        With nothing in flight the drain is over at once: no waiting for
        the grace period.
        """
        self.successResultOf(self.session.drain(30, REASON))

    def test_waits_for_run_in_flight(self):
        """
        A run in flight keeps the drain going until it ends by itself,
        whole; its terminal is sent and recorded before the drain is over.
        """
        self.start(run_request("r1"))
        drained = self.session.drain(30, REASON)
        self.elapse(29)
        self.assertNoResult(drained)
        _, _, d = self.adapter.runs[0]
        drained.addCallback(lambda _: self.assertEqual(self.store.ends, [("r1", "complete", None)]))
        d.callback(None)
        self.successResultOf(drained)
        self.pump.flush()
        self.assertEqual(run_events(self.edge), [("r1", "complete")])
        self.assertEqual(self.adapter.cancelled, [])

    def test_run_outliving_grace_is_cancelled(self):
        """
        A run still going when the grace period passes is cancelled: the
        Edge gets its C{cancelled} terminal, the store its end, and the
        drain is over.
        """
        self.start(run_request("r1"))
        drained = self.session.drain(5, REASON)
        self.elapse(4.9)
        self.assertNoResult(drained)
        self.elapse(0.1)
        self.successResultOf(drained)
        self.pump.flush()
        self.assertEqual(self.adapter.cancelled, ["r1"])
        self.assertEqual(run_events(self.edge), [("r1", "cancelled")])
        self.assertEqual(self.store.ends, [("r1", "cancelled", REASON)])

    def test_tunnel_outliving_grace_is_cancelled(self):
        """
        Tunnels drain like runs: one outliving the grace period ends with
        an error frame coded C{cancelled}.
        """
        self.start(tunnel_request("t1"))
        drained = self.session.drain(1, REASON)
        self.elapse(1)
        self.successResultOf(drained)
        self.pump.flush()
        [frame] = self.edge.of("provider_tunnel_frame")
        self.assertEqual((frame.error.code, frame.error.message), ("cancelled", REASON))

    def test_finished_work_waiting_for_credit_is_sent_whole(self):
        """
        Work that ended by itself but whose rest still waits for credit
        (a slow caller) is not cut when the grace passes: its whole body
        goes out before its success terminal, seqs without a gap.
        """
        run = run_request("r1")
        run.window_bytes = 10
        tunnel = tunnel_request("t1")
        tunnel.window_bytes = 100
        self.start(run, tunnel)
        _, emit, run_done = self.adapter.runs[0]
        for _ in range(4):
            emit(RunEventData(DELTA, text="abcdefgh"))
        run_done.callback(None)
        _, sink, tunnel_done = self.adapter.tunnels[0]
        sink.status(200)
        for _ in range(5):
            sink.body(b"y" * 100)
        tunnel_done.callback(None)
        self.pump.flush()
        drained = self.session.drain(0.5, REASON)
        self.elapse(1)
        self.successResultOf(drained)
        events = self.edge.of("run_event")
        self.assertEqual([e.type for e in events], ["delta"] * 4 + ["complete"])
        self.assertEqual([e.seq for e in events], [1, 2, 3, 4, 5])
        frames = self.edge.of("provider_tunnel_frame")
        self.assertEqual([f.WhichOneof("frame") for f in frames], ["status"] + ["body"] * 5 + ["end"])
        self.assertEqual([f.seq for f in frames], list(range(1, 8)))
        self.assertEqual(self.adapter.cancelled, [])

    def test_hurry_ends_at_once(self):
        """
        C{hurry} (a second stop signal) cuts the grace to zero: every run
        and tunnel in flight is cancelled now, with its terminal sent.
        """
        self.start(run_request("r1"), tunnel_request("t1"))
        drained = self.session.drain(30, REASON)
        self.session.hurry()
        self.successResultOf(drained)
        self.pump.flush()
        self.assertEqual(sorted(self.adapter.cancelled), ["r1", "t1"])
        self.assertEqual(run_events(self.edge), [("r1", "cancelled")])
        self.assertEqual(self.edge.of("provider_tunnel_frame")[-1].error.code, "cancelled")
        self.elapse(30)
        self.assertEqual(len(self.edge.of("run_event")), 1, "the grace timer must not fire after hurry")

    def test_new_work_refused(self):
        """
        A run or tunnel arriving during the drain is refused with one
        error terminal coded C{node_draining} (and recorded as ended); the
        work already in flight goes on.
        """
        self.start(run_request("r1"))
        self.session.drain(30, REASON)
        self.start(run_request("r2"), tunnel_request("t2"))
        [refusal] = [e for e in self.edge.of("run_event") if e.run_id == "r2"]
        self.assertEqual((refusal.seq, refusal.type, refusal.error.code), (1, "error", NODE_DRAINING))
        [frame] = self.edge.of("provider_tunnel_frame")
        self.assertEqual((frame.tunnel_id, frame.seq, frame.error.code), ("t2", 1, NODE_DRAINING))
        self.assertEqual(len(self.adapter.runs), 1)
        self.assertEqual(len(self.adapter.tunnels), 0)
        self.assertEqual(self.store.unfinished(), ["r1"])
        self.assertEqual(hosted(self.context.host, "manual").gate.in_use, 1)

    def test_node_draining_sent(self):
        """
        A version-2 Edge is told with C{NodeDraining} carrying the grace
        period and the reason.
        """
        self.session.drain(12.5, REASON)
        self.pump.flush()
        [message] = self.edge.of("node_draining")
        self.assertEqual((message.grace_sec, message.reason), (12.5, REASON))

    def test_node_draining_not_sent_to_version_one(self):
        """
        An Edge that declared no wire version (version 1) would close the
        connection on a message it does not know: it is not sent one, and
        the drain works the same.
        """
        clock = Clock()
        session, edge, pump, context = ready_node(clock=clock, wire_version=0)
        edge.connection.send(run_request("r1"))
        pump.flush()
        drained = session.drain(30, REASON)
        elapse(clock, pump, 30)
        self.successResultOf(drained)
        pump.flush()
        self.assertEqual(edge.of("node_draining"), [])
        self.assertEqual(run_events(edge), [("r1", "cancelled")])


class ServiceStopTests(SynchronousTestCase):
    """
    C{NodeService.stopService} as twistd calls it, on a memory reactor.
    """

    def setUp(self):
        self.reactor = MemoryReactorClock()
        self.store = RecordingStore()
        config = NodeConfig(
            edge="tcp:host=127.0.0.1:port=7100",
            token=TOKEN,
            reconnect=ReconnectPolicy(max_attempts=0, interval_sec=1),
            shutdown_grace_sec=10,
        )
        self.service = NodeService(config, self.reactor, RecordingExit(), build=build, store=self.store)
        self.service.startService()
        self.edge = FakeEdge(accepted(node_config(adapter_config("manual"))), messages.ready_response(ready=True))
        self.pump = dialled(self.reactor, self.edge)
        self.successResultOf(self.service.supervisor.when_ready())
        self.adapter = manual(self.service.host, "manual")

    def start_run(self, run_id):
        self.edge.connection.send(run_request(run_id))
        self.pump.flush()

    def assert_stopped(self, stopped):
        """
        The stop is complete: connection closed, adapters stopped, store
        stopped with no run left running, and no reconnect.
        """
        self.pump.flush()
        self.successResultOf(stopped)
        self.assertIsNotNone(self.edge.lost_reason)
        self.assertEqual(self.adapter.stopped, 1)
        self.assertEqual(self.store.running_when_stopped, [])
        self.reactor.advance(60)
        self.assertEqual(self.reactor.tcpClients, [])

    def test_stop_waits_for_run(self):
        """
        The Deferred from stopService has no result while a run is in
        flight; once the run ends whole, the connection closes, the
        adapters stop and the store closes.
        """
        self.start_run("r1")
        stopped = self.service.stopService()
        self.pump.flush()
        elapse(self.reactor, self.pump, 9)
        self.assertNoResult(stopped)
        self.assertIsNone(self.edge.lost_reason)
        self.assertEqual(self.adapter.stopped, 0)
        self.adapter.runs[0][2].callback(None)
        self.assert_stopped(stopped)
        self.assertEqual(run_events(self.edge), [("r1", "complete")])
        self.assertEqual(self.store.ends, [("r1", "complete", None)])

    def test_stop_cancels_after_grace(self):
        """
        A run outliving shutdown_grace_sec is cancelled, its terminal
        reaches the Edge and the store before the connection and the store
        close.
        """
        self.start_run("r1")
        stopped = self.service.stopService()
        elapse(self.reactor, self.pump, 10)
        self.assert_stopped(stopped)
        self.assertEqual(run_events(self.edge), [("r1", "cancelled")])
        self.assertEqual(self.store.ends, [("r1", "cancelled", REASON)])

    def test_hurry(self):
        """
        C{hurry} during the drain ends it at once and the stop goes on.
        """
        self.start_run("r1")
        stopped = self.service.stopService()
        self.pump.flush()
        self.service.hurry()
        self.assert_stopped(stopped)
        self.assertEqual(run_events(self.edge), [("r1", "cancelled")])

    def test_hurry_before_the_drain(self):
        """
        A second signal handled before stopService began (both came at
        once) still means "do not wait": the drain cancels at once.
        """
        self.start_run("r1")
        self.service.hurry()
        stopped = self.service.stopService()
        self.reactor.advance(0)
        self.assert_stopped(stopped)
        self.assertEqual(run_events(self.edge), [("r1", "cancelled")])

    def test_idle_stop_is_immediate(self):
        """
        With nothing in flight the stop completes without the clock moving.
        """
        self.assert_stopped(self.service.stopService())
        self.assertEqual(
            self.edge.kinds(), ["register_request", "run_reconcile", "node_ready_request", "node_draining"]
        )

    def test_connection_lost_during_drain(self):
        """
        If the Edge goes away during the drain, the work is cancelled with
        the connection, the stop completes, and the Node does not dial
        again.
        """
        self.start_run("r1")
        stopped = self.service.stopService()
        self.pump.flush()
        self.edge.lose_connection()
        self.assert_stopped(stopped)
        # (Ended as the Edge ended it for its caller: node_disconnected.)
        self.assertEqual(self.store.ends, [("r1", "error", "connection to the Edge lost")])
