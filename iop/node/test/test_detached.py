"""
Background runs across a lost link, on the Node's side (wire version 4):
kept running, reported before the next ready, resumed from the store
without a gap or a repeat, cancelled when the Edge does not want them or
the Node stops; an older Edge gets the old behaviour.
"""

from twisted.internet import defer
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from iop.node.runs import Resumed
from iop.protocols import messages
from iop.run import COMPLETE, DELTA, START, RunEventData
from iop.testing.node import (
    FakeEdge,
    RecordingStore,
    accepted,
    adapter_config,
    connect,
    hosted,
    manual,
    node_config,
    ready_node,
    run_request,
)

READY_OK = messages.ready_response(ready=True)


class DetachTests(SynchronousTestCase):
    def setUp(self):
        self.store = RecordingStore()
        self.session, self.edge, self.pump, self.context = ready_node(store=self.store)
        self.adapter = manual(self.context.host, "manual")

    def start(self, run_id, background=True):
        self.edge.connection.send(run_request(run_id, background=background))
        self.pump.flush()
        run, emit, d = self.adapter.runs[-1]
        emit(RunEventData(START))
        emit(RunEventData(DELTA, text="a"))
        self.pump.flush()
        return emit, d

    def lose(self):
        self.edge.lose_connection()
        self.pump.flush()

    def reconnect(self):
        edge = FakeEdge(accepted(node_config(adapter_config("manual"))), READY_OK)
        session, pump = connect(self.context, edge)
        pump.flush()
        return session, edge, pump

    def test_kept_and_reported(self):
        """
        A lost link cancels foreground runs but keeps background ones
        running (their slot held); the next session reports them, with
        their status, last seq and start, before its ready.
        """
        clock = self.context.host.reactor
        assert isinstance(clock, Clock)
        clock.advance(1234)
        took = clock.seconds()
        emit, _ = self.start("bg")
        self.start("fg", background=False)
        self.lose()
        self.assertEqual(self.adapter.cancelled, ["fg"])
        self.assertIn("bg", self.context.detached)
        self.assertEqual(hosted(self.context.host, "manual").gate.in_use, 1)
        emit(RunEventData(DELTA, text="b"))
        session, edge, pump = self.reconnect()
        self.assertEqual(edge.kinds(), ["register_request", "run_reconcile", "node_ready_request"])
        [reported] = edge.of("run_reconcile")[0].runs
        self.assertEqual(
            (reported.run_id, reported.adapter, reported.status, reported.last_seq), ("bg", "manual", "running", 3)
        )
        self.assertEqual(reported.started_at, took)

    def test_resumed_from_the_store(self):
        """
        C{RunResume} attaches the run to the new session: the events after
        the Edge's last come from the store, the live ones after them, each
        once; the run is the new session's (cancellable there).
        """
        emit, d = self.start("bg")
        self.lose()
        emit(RunEventData(DELTA, text="b"))
        emit(RunEventData(DELTA, text="c"))
        session, edge, pump = self.reconnect()
        edge.wire.send(messages.run_resume(run_id="bg", after_seq=2))
        emit(RunEventData(DELTA, text="d"))
        pump.flush()
        emit(RunEventData(COMPLETE))
        d.callback(None)
        pump.flush()
        got = [(e.seq, e.type, e.text) for e in edge.of("run_event")]
        self.assertEqual(got, [(3, "delta", "b"), (4, "delta", "c"), (5, "delta", "d"), (6, "complete", "")])
        self.assertNotIn("bg", self.context.detached)
        self.assertEqual(len(session.inflight), 0)
        self.assertEqual(self.store.ends[-1], ("bg", "complete", None))

    def test_ended_while_away(self):
        """
        A run that ends while detached is reported ended, and resumed its
        rest (terminal included) comes from the store.
        """
        emit, d = self.start("bg")
        self.lose()
        emit(RunEventData(COMPLETE))
        d.callback(None)
        self.assertEqual(hosted(self.context.host, "manual").gate.in_use, 0)
        session, edge, pump = self.reconnect()
        self.assertEqual(edge.of("run_reconcile")[0].runs[0].status, "complete")
        edge.wire.send(messages.run_resume(run_id="bg", after_seq=1))
        pump.flush()
        self.assertEqual([(e.seq, e.type) for e in edge.of("run_event")], [(2, "delta"), (3, "complete")])

    def test_ended_while_its_rest_waited_for_credit(self):
        """
        A background run that ended while its last events still waited
        for credit is kept too when the link goes: reported ended, and
        resumed, its rest comes from the store.
        """
        request = run_request("bg", background=True)
        request.window_bytes = 10
        self.edge.connection.send(request)
        self.pump.flush()
        _, emit, d = self.adapter.runs[-1]
        emit(RunEventData(START))
        for _ in range(3):
            emit(RunEventData(DELTA, text="abcdefghijkl"))
        emit(RunEventData(COMPLETE))
        d.callback(None)
        self.pump.flush()
        self.assertEqual([e.seq for e in self.edge.of("run_event")], [1, 2])
        self.lose()
        self.assertIn("bg", self.context.detached)
        session, edge, pump = self.reconnect()
        self.assertEqual([(r.run_id, r.status) for r in edge.of("run_reconcile")[0].runs], [("bg", "complete")])
        edge.wire.send(messages.run_resume(run_id="bg", after_seq=2))
        pump.flush()
        self.assertEqual([(e.seq, e.type) for e in edge.of("run_event")], [(3, "delta"), (4, "delta"), (5, "complete")])

    def test_ended_while_away_store_failed(self):
        """
        A run that ended while detached, resumed when its store cannot be
        read back (a failed store: runs go on unrecorded), still ends on
        the new connection: the Node sends the terminal it kept.
        """
        emit, d = self.start("bg")
        self.lose()
        emit(RunEventData(COMPLETE))
        d.callback(None)
        self.patch(self.store, "get", lambda run_id, after=0: defer.fail(RuntimeError("disk image is malformed")))
        session, edge, pump = self.reconnect()
        edge.wire.send(messages.run_resume(run_id="bg", after_seq=2))
        pump.flush()
        self.assertEqual([(e.seq, e.type) for e in edge.of("run_event")], [(3, "complete")])
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)

    def test_history_that_cannot_be_sent_as_stored(self):
        """
        Stored events are sent back fit for the wire: a text with a lone
        surrogate (stored by an older Node) cleaned; one that cannot be
        encoded at all is left out (logged), and the rest still go.
        """
        emit, d = self.start("bg")
        self.lose()
        emit(RunEventData(COMPLETE))
        d.callback(None)
        stored = {
            "run": {"run_id": "bg"},
            "events": [
                {"seq": 2, "type": "delta", "text": "a\ud83d"},
                {"seq": 3, "type": "delta", "usage": {"input_tokens": -1, "output_tokens": 0}},
                {"seq": 4, "type": "complete"},
            ],
        }
        self.patch(self.store, "get", lambda run_id, after=0: defer.succeed(stored))
        session, edge, pump = self.reconnect()
        edge.wire.send(messages.run_resume(run_id="bg", after_seq=1))
        pump.flush()
        got = [(e.seq, e.type, e.text) for e in edge.of("run_event")]
        self.assertEqual(got, [(2, "delta", "a\ufffd"), (4, "complete", "")])
        self.assertEqual(len(self.flushLoggedErrors(ValueError)), 1)

    def test_not_wanted_back(self):
        """
        A kept run the Edge cancels is cancelled and forgotten; a resume of
        a run the Node no longer has ends it with unknown_run.
        """
        self.start("bg")
        self.lose()
        session, edge, pump = self.reconnect()
        edge.wire.send(messages.cancel_run("bg"))
        edge.wire.send(messages.run_resume(run_id="gone", after_seq=4))
        pump.flush()
        self.assertEqual(self.adapter.cancelled, ["bg"])
        self.assertEqual(len(self.context.detached), 0)
        [event] = edge.of("run_event")
        self.assertEqual((event.run_id, event.seq, event.error.code), ("gone", 5, "unknown_run"))

    def test_ended_with_the_edges_verdict(self):
        """
        A kept run the Edge ended already with an error (its link was not
        back in time) is cancelled with that error: the store reads back
        as the Edge told its caller, not as a cancel.
        """
        self.start("bg")
        self.lose()
        session, edge, pump = self.reconnect()
        edge.wire.send(messages.cancel_run("bg", "node_disconnected", "node n1 did not come back within 120s"))
        pump.flush()
        self.assertEqual(self.store.ends[-1], ("bg", "error", "node n1 did not come back within 120s"))
        self.assertEqual(self.store.rows["bg"]["error_code"], "node_disconnected")

    def test_older_edge_cancels(self):
        """
        With an Edge of wire version 3 (it could never ask for them back)
        background runs end with the link, as before, and no reconcile is
        sent.
        """
        session, edge, pump, context = ready_node(wire_version=3)
        edge.connection.send(run_request("bg", background=True))
        pump.flush()
        edge.lose_connection()
        pump.flush()
        self.assertEqual(manual(context.host, "manual").cancelled, ["bg"])
        self.assertEqual(len(context.detached), 0)

    def test_local_shutdown(self):
        """
        A local shutdown does not keep background runs: the session's are
        cancelled as before, and kept ones are cancelled too.
        """
        self.start("kept")
        self.lose()
        session, edge, pump = self.reconnect()
        self.context.detached.cancel_all("the node is shutting down")
        self.assertEqual(self.adapter.cancelled, ["kept"])
        self.assertEqual(self.store.ends[-1], ("kept", "cancelled", "the node is shutting down"))


class ResumedTests(SynchronousTestCase):
    def test_order_without_repeats(self):
        """
        Live events held while the history is read go out after it; an
        event the history already had, or the Edge had, is not sent again.
        """
        sent: list[messages.RunEvent] = []
        resumed = Resumed(sent.append, 2)
        for seq in (4, 5):
            resumed(messages.run_event("r", seq, "delta"))
        resumed.replay([messages.run_event("r", s, "delta") for s in (4, 2, 3)])
        resumed(messages.run_event("r", 6, "delta"))
        self.assertEqual([m.seq for m in sent], [3, 4, 5, 6])

    def test_kept_terminal(self):
        """
        The terminal of a run that ended before it was re-attached ends a
        history that lacks it, and is not repeated after one that has it
        (nor sent when the Edge had it).
        """
        terminal = messages.run_event("r", 4, "complete")
        for history, after, expected in (
            ([3], 2, [3, 4]),
            ([], 2, [4]),
            ([3, 4], 2, [3, 4]),
            ([], 4, []),
        ):
            sent: list[messages.RunEvent] = []
            resumed = Resumed(sent.append, after, terminal)
            resumed.replay([messages.run_event("r", s, "delta" if s < 4 else "complete") for s in history])
            self.assertEqual([m.seq for m in sent], expected)


class OlderNextEdgeTests(SynchronousTestCase):
    def test_next_edge_older_cancels_the_kept_runs(self):
        """
        Background runs kept from a version-4 Edge's lost link, when the
        next ready session is with an Edge that can never ask for them
        back (wire version 3), are ended then — as the Edge that waited
        for them ends them for their callers (C{node_disconnected}) — and
        their capacity slots freed: nothing else would ever release a run
        that does not end by itself, and the older Edge, unaware of it,
        would find its adapter full.
        """
        store = RecordingStore()
        session, edge, pump, context = ready_node(store=store)
        adapter = manual(context.host, "manual")
        edge.connection.send(run_request("bg", background=True))
        pump.flush()
        edge.lose_connection()
        pump.flush()
        self.assertIn("bg", context.detached)
        older = FakeEdge(accepted(node_config(adapter_config("manual")), 3), READY_OK)
        session, pump = connect(context, older)
        pump.flush()
        self.assertTrue(session.ready.called)
        self.assertEqual(older.kinds(), ["register_request", "node_ready_request"])
        self.assertEqual(adapter.cancelled, ["bg"])
        self.assertEqual(len(context.detached), 0)
        self.assertEqual(hosted(context.host, "manual").gate.in_use, 0)
        self.assertEqual(store.rows["bg"]["error_code"], "node_disconnected")
