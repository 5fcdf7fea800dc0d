"""
Normalized runs over a live (in-memory) wire: event order and numbering,
exactly one terminal, terminal synthesis, cancellation, the capacity gate,
and what is recorded.
"""

from typing import Any, cast

from twisted.internet import defer
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from iop.node.runs import run_input
from iop.protocols import messages
from iop.protocols.wire import FrameTooLarge
from iop.run import (
    COMPLETE,
    DELTA,
    ERROR,
    INCOMPLETE,
    STALL,
    START,
    TOOL_CALL,
    RunEventData,
    RunFailure,
    ToolCall,
    Usage,
)
from iop.testing.node import RecordingStore, adapter_config, hosted, manual, ready_node, run_request, session_wire


def events(edge, run_id=None):
    return [e for e in edge.of("run_event") if run_id is None or e.run_id == run_id]


class RunRelayTests(SynchronousTestCase):
    def test_echo_relay_order(self):
        """
        A run on the echo adapter arrives as start, its text and complete,
        numbered 1..n in order, with usage on the terminal: the echo
        adapter (no delay) emits a delta per word in one turn, which go out
        as one.
        """
        session, edge, pump, context = ready_node(adapter_config("echo", type="echo"))
        edge.connection.send(run_request("r1", adapter="echo", text="hello brave new world"))
        pump.flush()
        got = events(edge)
        self.assertEqual([e.type for e in got], ["start", "delta", "complete"])
        self.assertEqual([e.seq for e in got], [1, 2, 3])
        self.assertEqual("".join(e.text for e in got if e.type == "delta"), "hello brave new world")
        terminal = got[-1]
        self.assertEqual((terminal.usage.input_tokens, terminal.usage.output_tokens), (4, 4))
        self.assertFalse(terminal.usage.HasField("reasoning_tokens"))
        self.assertEqual(len(session.inflight), 0)

    def test_run_input(self):
        """
        The adapter sees the request's messages as dicts and options_json
        parsed.
        """
        request = run_request("r9", target="m", session_id="s", background=True, options_json='{"temperature": 0.5}')
        run = run_input(request)
        self.assertEqual(run.messages, [{"role": "user", "content": "hello"}])
        self.assertEqual((run.run_id, run.target, run.session_id, run.background), ("r9", "m", "s", True))
        self.assertEqual(run.options, {"temperature": 0.5})

    def test_breakdown_only_when_reported(self):
        """
        Usage breakdown fields are on the wire only when the adapter
        reported them: absent is not zero.
        """
        session, edge, pump, context = ready_node()
        edge.connection.send(run_request("r1"))
        pump.flush()
        run, emit, d = manual(context.host, "manual").runs[0]
        emit(RunEventData(COMPLETE, usage=Usage(3, 5, reasoning_tokens=2)))
        pump.flush()
        usage = events(edge)[-1].usage
        self.assertEqual(usage.reasoning_tokens, 2)
        self.assertTrue(usage.HasField("reasoning_tokens"))
        self.assertFalse(usage.HasField("cached_input_tokens"))

    def test_events_after_terminal_dropped(self):
        """
        Whatever an adapter emits after its terminal never reaches the wire.
        """
        session, edge, pump, context = ready_node()
        edge.connection.send(run_request("r1"))
        pump.flush()
        run, emit, d = manual(context.host, "manual").runs[0]
        emit(RunEventData(START))
        emit(RunEventData(COMPLETE))
        emit(RunEventData(DELTA, text="late"))
        emit(RunEventData(ERROR, error=RunFailure("x", "y")))
        d.callback(None)
        pump.flush()
        self.assertEqual([e.type for e in events(edge)], ["start", "complete"])

    def test_incomplete_on_the_wire(self):
        """
        A run that broke after its start ends with an C{error} coded
        C{incomplete}, keeping its deadline and the usage so far; it is
        counted as the provider's failure.
        """
        session, edge, pump, context = ready_node()
        edge.connection.send(run_request("r1"))
        pump.flush()
        run, emit, d = manual(context.host, "manual").runs[0]
        emit(RunEventData(START))
        emit(RunEventData(DELTA, text="par"))
        emit(RunEventData(ERROR, usage=Usage(2, 1), error=RunFailure(INCOMPLETE, "cut", deadline=STALL)))
        d.callback(None)
        pump.flush()
        terminal = events(edge)[-1]
        self.assertEqual(
            (terminal.type, terminal.error.code, terminal.error.deadline), ("error", "incomplete", "stall")
        )
        self.assertEqual(terminal.usage.output_tokens, 1)
        labels = {"adapter": "manual", "code": "incomplete", "deadline": "stall"}
        self.assertEqual(context.metrics.value("iop_node_provider_failures_total", labels), 1)

    def test_complete_synthesized(self):
        """
        An adapter whose Deferred succeeds without a terminal gets a
        synthesized C{complete}, carrying the last usage it reported.
        """
        session, edge, pump, context = ready_node()
        edge.connection.send(run_request("r1"))
        pump.flush()
        run, emit, d = manual(context.host, "manual").runs[0]
        emit(RunEventData(START))
        emit(RunEventData(DELTA, text="hi", usage=Usage(1, 1)))
        d.callback(None)
        pump.flush()
        got = events(edge)
        self.assertEqual([(e.seq, e.type) for e in got], [(1, "start"), (2, "delta"), (3, "complete")])
        self.assertEqual(got[-1].usage.output_tokens, 1)

    def test_error_synthesized(self):
        """
        An adapter whose Deferred fails without a terminal gets an C{error}
        terminal with code C{adapter_error} and the failure's message.
        """
        session, edge, pump, context = ready_node()
        edge.connection.send(run_request("r1"))
        pump.flush()
        run, emit, d = manual(context.host, "manual").runs[0]
        emit(RunEventData(START))
        d.errback(RuntimeError("back end exploded"))
        pump.flush()
        got = events(edge)
        self.assertEqual([e.type for e in got], ["start", "error"])
        self.assertEqual(got[-1].error.code, "adapter_error")
        self.assertIn("back end exploded", got[-1].error.message)
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)

    def test_execute_raising_synchronously(self):
        """
        An adapter whose C{execute} raises before returning also ends with
        one C{error} terminal, and its slot is freed.
        """
        session, edge, pump, context = ready_node()
        adapter = manual(context.host, "manual")

        def boom(run, emit):
            raise ValueError("bad input")

        self.patch(adapter, "execute", boom)

        edge.connection.send(run_request("r1"))
        pump.flush()
        self.assertEqual([e.type for e in events(edge)], ["error"])
        self.assertEqual(hosted(context.host, "manual").gate.in_use, 0)
        self.flushLoggedErrors(ValueError)

    def test_cancel(self):
        """
        CancelRequest(CANCEL_RUN) cancels the adapter's Deferred and the
        terminal is C{cancelled}.
        """
        session, edge, pump, context = ready_node()
        edge.connection.send(run_request("r1"))
        pump.flush()
        adapter = manual(context.host, "manual")
        run, emit, d = adapter.runs[0]
        emit(RunEventData(START))
        edge.connection.send(messages.cancel_run("r1"))
        pump.flush()
        self.assertEqual(adapter.cancelled, ["r1"])
        self.assertEqual([e.type for e in events(edge)], ["start", "cancelled"])
        self.assertEqual(hosted(context.host, "manual").gate.in_use, 0)

    def test_cancel_unknown_ignored(self):
        """
        Cancelling an unknown or finished run changes nothing and keeps the
        connection.
        """
        session, edge, pump, context = ready_node(adapter_config("echo", type="echo"))
        edge.connection.send(run_request("r1", adapter="echo"))
        edge.connection.send(messages.cancel_run("r1"))
        edge.connection.send(messages.cancel_run("nope"))
        pump.flush()
        self.assertEqual(events(edge)[-1].type, "complete")
        self.assertIsNone(edge.lost_reason)

    def test_unknown_adapter(self):
        """
        A run for an adapter the node does not have ends at once with one
        C{error} terminal, code C{unknown_adapter}.
        """
        session, edge, pump, context = ready_node()
        edge.connection.send(run_request("r1", adapter="nope"))
        pump.flush()
        [event] = events(edge)
        self.assertEqual((event.seq, event.type, event.error.code), (1, "error", "unknown_adapter"))

    def test_invalid_options(self):
        """
        A run whose options_json is not a JSON object ends with an error
        terminal and takes no capacity.
        """
        session, edge, pump, context = ready_node()
        edge.connection.send(run_request("r1", options_json="[1, 2]"))
        pump.flush()
        [event] = events(edge)
        self.assertEqual(event.error.code, "invalid_request")
        self.assertEqual(manual(context.host, "manual").runs, [])


class CapacityTests(SynchronousTestCase):
    def test_capacity_exceeded(self):
        """
        Beyond max_concurrency a run ends at once with C{error} code
        C{capacity_exceeded}; it is never queued on the node.
        """
        session, edge, pump, context = ready_node(adapter_config("manual", max_concurrency=1))
        edge.connection.send(run_request("r1"))
        edge.connection.send(run_request("r2"))
        pump.flush()
        adapter = manual(context.host, "manual")
        self.assertEqual(len(adapter.runs), 1)
        [event] = events(edge, "r2")
        self.assertEqual((event.type, event.error.code), ("error", "capacity_exceeded"))
        self.assertIn("max_concurrency of 1", event.error.message)

    def test_gate_shared_by_tunnel_and_run(self):
        """
        A tunnel and a run on the same adapter instance share one gate: with
        room for one, a tunnel in flight refuses the run and a run in flight
        refuses the tunnel.
        """
        from iop.testing.node import tunnel_request

        session, edge, pump, context = ready_node(adapter_config("manual", max_concurrency=1))
        edge.connection.send(tunnel_request("t1"))
        edge.connection.send(run_request("r1"))
        pump.flush()
        self.assertEqual(events(edge, "r1")[0].error.code, "capacity_exceeded")

        adapter = manual(context.host, "manual")
        adapter.tunnels[0][2].callback(None)
        edge.connection.send(run_request("r2"))
        edge.connection.send(tunnel_request("t2"))
        pump.flush()
        self.assertEqual(len(adapter.runs), 1)
        frames = [f for f in edge.of("provider_tunnel_frame") if f.tunnel_id == "t2"]
        self.assertEqual(frames[0].error.code, "capacity_exceeded")

    def test_slot_freed_before_terminal(self):
        """
        When the terminal is sent the slot is already free: an Edge that
        sends the next run in reaction to a terminal finds room.
        """
        session, edge, pump, context = ready_node(adapter_config("manual", max_concurrency=1))
        gate = hosted(context.host, "manual").gate
        seen = []
        wire = session_wire(session)
        send = wire.send

        def spy(message):
            if message.DESCRIPTOR.name == "RunEvent" and message.type in ("complete", "error", "cancelled"):
                seen.append(gate.in_use)
            send(message)

        self.patch(wire, "send", spy)
        edge.connection.send(run_request("r1"))
        edge.connection.send(run_request("r2"))
        pump.flush()
        adapter = manual(context.host, "manual")
        adapter.runs[0][1](RunEventData(COMPLETE))
        pump.flush()
        self.assertEqual(seen, [1, 0])

    def test_in_flight_gauge(self):
        """
        The in-flight gauge follows the gate.
        """
        from iop.node.host import AdapterHost
        from iop.node.metrics import NodeMetrics
        from iop.testing.node import build

        clock = Clock()
        metrics = NodeMetrics()
        session, edge, pump, context = ready_node(clock=clock, host=AdapterHost(clock, build, metrics), metrics=metrics)
        edge.connection.send(run_request("r1"))
        pump.flush()
        self.assertEqual(metrics.value("iop_node_in_flight", {"adapter": "manual"}), 1)
        manual(context.host, "manual").runs[0][2].callback(None)
        self.assertEqual(metrics.value("iop_node_in_flight", {"adapter": "manual"}), 0)
        self.assertEqual(metrics.value("iop_node_runs_total", {"adapter": "manual", "status": "complete"}), 1)


class DisconnectTests(SynchronousTestCase):
    def test_loss_cancels_in_flight(self):
        """
        Losing the connection cancels every run of the session, frees its
        slots, and sends nothing (the terminal could not be delivered); the
        store has them end as the Edge ended them, C{node_disconnected}.
        """
        store = RecordingStore()
        session, edge, pump, context = ready_node(store=store)
        edge.connection.send(run_request("r1"))
        edge.connection.send(run_request("r2"))
        pump.flush()
        adapter = manual(context.host, "manual")
        edge.received.clear()
        edge.lose_connection()
        pump.flush()
        self.assertEqual(sorted(adapter.cancelled), ["r1", "r2"])
        self.assertEqual(hosted(context.host, "manual").gate.in_use, 0)
        self.assertEqual(len(session.inflight), 0)
        # Stored as the Edge ended them for their callers.
        self.assertEqual(
            sorted(store.ends),
            [("r1", "error", "connection to the Edge lost"), ("r2", "error", "connection to the Edge lost")],
        )
        self.assertEqual({store.rows[r]["error_code"] for r in ("r1", "r2")}, {"node_disconnected"})

    def test_shutdown_cancels_and_tells(self):
        """
        A local shutdown cancels in-flight runs while the connection is
        still up, so the Edge gets their C{cancelled} terminals.
        """
        session, edge, pump, context = ready_node()
        edge.connection.send(run_request("r1"))
        pump.flush()
        session.shutdown("the node is shutting down")
        pump.flush()
        self.assertEqual([e.type for e in events(edge)], ["cancelled"])


class RecordingTests(SynchronousTestCase):
    def test_store_and_usage(self):
        """
        Each run is recorded at start and at its terminal, refused runs
        included, and the usage book counts outcomes and reported tokens.
        """
        store = RecordingStore()
        session, edge, pump, context = ready_node(adapter_config("echo", type="echo", max_concurrency=1), store=store)
        edge.connection.send(run_request("r1", adapter="echo", text="a b", target="t", session_id="s"))
        edge.connection.send(run_request("r2", adapter="nope"))
        pump.flush()
        self.assertEqual(store.starts, [("r1", "echo", "t", "s", False), ("r2", "nope", "", "", False)])
        self.assertEqual(store.ends[0], ("r1", "complete", None))
        self.assertEqual(store.ends[1][:2], ("r2", "error"))
        self.assertIn("unknown_adapter", store.ends[1][2])
        usage = context.usage.snapshot()["echo"]
        self.assertEqual((usage["input_tokens"], usage["output_tokens"]), (2, 2))
        self.assertEqual(usage["runs"]["complete"], 1)

    def test_events_recorded(self):
        """
        Every event sent is kept in the store under its wire seq, the
        refusal of a run that never started included, and the end carries
        the error code and usage.
        """
        store = RecordingStore()
        session, edge, pump, context = ready_node(adapter_config("echo", type="echo", max_concurrency=1), store=store)
        edge.connection.send(run_request("r1", adapter="echo", text="a b"))
        edge.connection.send(run_request("r2", adapter="nope"))
        pump.flush()
        sent = [(e.seq, e.type, e.text) for e in events(edge, "r1")]
        self.assertEqual([(seq, e.type, e.text) for seq, e in store.events["r1"]], sent)
        self.assertEqual([(seq, e.type) for seq, e in store.events["r2"]], [(1, "error")])
        self.assertEqual(store.rows["r1"]["usage"], {"input_tokens": 2, "output_tokens": 2})
        self.assertEqual(store.rows["r2"]["error_code"], "unknown_adapter")

    def test_store_failure_does_not_break_relay(self):
        """
        A store whose writes fail (or raise) never stops the relay.
        """

        class Failing(RecordingStore):
            def record_start(self, *a, **k):
                return defer.fail(RuntimeError("disk full"))

            def record_end(self, *a, **k):
                raise RuntimeError("disk still full")

        session, edge, pump, context = ready_node(adapter_config("echo", type="echo"), store=Failing())
        edge.connection.send(run_request("r1", adapter="echo", text="x"))
        pump.flush()
        self.assertEqual([e.type for e in events(edge)], ["start", "delta", "complete"])
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 2)


class UnsendableEventTests(SynchronousTestCase):
    """
    What an adapter emits that cannot go on the wire as it is.
    """

    def setUp(self):
        self.store = RecordingStore()
        self.clock = Clock()
        self.session, self.edge, self.pump, self.context = ready_node(store=self.store, clock=self.clock)
        self.adapter = manual(self.context.host, "manual")

    def start(self, run_id="r1"):
        self.edge.connection.send(run_request(run_id))
        self.pump.flush()
        return self.adapter.runs[-1][1:]

    def assert_ended_unsendable(self, run_id, kind):
        """
        C{run_id} ended with one plain C{error} coded C{adapter_error}
        naming the event that could not be sent, on the wire and in the
        store alike, its slot free and nothing of it in flight.
        """
        got = events(self.edge, run_id)
        terminal = got[-1]
        self.assertEqual((terminal.type, terminal.error.code), ("error", "adapter_error"))
        self.assertIn(f"{kind} event could not be sent", terminal.error.message)
        self.assertEqual([e.seq for e in got], list(range(1, len(got) + 1)))
        self.assertEqual([(seq, e.type) for seq, e in self.store.events[run_id]], [(e.seq, e.type) for e in got])
        self.assertEqual(
            (self.store.rows[run_id]["status"], self.store.rows[run_id]["error_code"]), ("error", "adapter_error")
        )
        self.assertEqual(hosted(self.context.host, "manual").gate.in_use, 0)
        self.assertEqual(len(self.session.inflight), 0)
        return got

    def test_terminal_that_cannot_be_encoded(self):
        """
        A terminal that cannot be encoded (a finish reason that is no
        text, a token count out of range) is not lost: a plain C{error}
        goes out in its stead, once, and the adapter's C{emit} does not
        raise; the usage that could not be sent is not counted.
        """
        for run_id, terminal in (
            ("r1", RunEventData(COMPLETE, finish_reason=cast(Any, 1))),
            ("r2", RunEventData(COMPLETE, usage=Usage(-1, 3))),
        ):
            emit, d = self.start(run_id)
            emit(RunEventData(START))
            emit(RunEventData(DELTA, text="hi"))
            emit(terminal)
            d.callback(None)
            self.pump.flush()
            got = self.assert_ended_unsendable(run_id, "complete")
            self.assertEqual([e.type for e in got], ["start", "delta", "error"])
            self.assertFalse(got[-1].HasField("usage"))
        self.assertEqual(len(self.flushLoggedErrors(TypeError, ValueError)), 2)
        usage = self.context.usage.snapshot()["manual"]
        self.assertEqual((usage["input_tokens"], usage["runs"]["error"]), (0, 2))

    def test_event_that_cannot_be_encoded_ends_the_run(self):
        """
        Any other event that cannot be encoded ends the run there: the
        text before it goes out, then the plain C{error}; the adapter's
        work is cancelled, and what it emits after is dropped.
        """
        emit, d = self.start()
        emit(RunEventData(START))
        self.adapter.runs[-1][1]._emit(RunEventData(DELTA, text="before"))
        arguments: Any = {"q": 1}  # no JSON text
        emit(RunEventData(TOOL_CALL, tool_call=ToolCall("c1", "lookup", arguments)))
        emit(RunEventData(DELTA, text="after"))
        emit(RunEventData(COMPLETE))
        self.pump.flush()
        self.assertEqual(self.adapter.cancelled, ["r1"])
        got = self.assert_ended_unsendable("r1", "tool_call")
        self.assertEqual([(e.type, e.text) for e in got][:2], [("start", ""), ("delta", "before")])
        self.assertEqual(len(got), 3)
        self.assertEqual(len(self.flushLoggedErrors(TypeError)), 1)

    def test_event_no_frame_carries(self):
        """
        An event larger than a frame (a tool call of 17 MiB of arguments)
        ends the run as unsendable: never a C{complete} that lacks it.
        """
        emit, d = self.start()
        emit(RunEventData(START))
        emit(RunEventData(TOOL_CALL, tool_call=ToolCall("c1", "f", '{"a": "' + "x" * (17 * 1024 * 1024) + '"}')))
        emit(RunEventData(COMPLETE, finish_reason="tool_calls"))
        self.pump.flush()
        got = self.assert_ended_unsendable("r1", "tool_call")
        self.assertEqual([e.type for e in got], ["start", "error"])
        self.assertEqual(len(self.flushLoggedErrors(FrameTooLarge)), 1)

    def test_text_of_the_wrong_type(self):
        """
        A text that is not a C{str} (protobuf would take C{bytes} for one,
        which the store's JSON cannot hold; an C{int} cannot be joined)
        ends the run as unsendable, held with other text of its turn or
        not: the wire and the store agree, seq after seq.
        """
        for run_id, text in (("r1", b"bytes"), ("r2", 5)):
            emit, d = self.start(run_id)
            emit(RunEventData(START))
            emit._emit(RunEventData(DELTA, text="a"))
            emit._emit(RunEventData(DELTA, text=cast(Any, text)))
            self.clock.advance(0)
            self.pump.flush()
            got = self.assert_ended_unsendable(run_id, "delta")
            self.assertEqual([(e.type, e.text) for e in got[:2]], [("start", ""), ("delta", "a")])
        arguments: Any = b"{}"
        emit, d = self.start("r3")
        emit(RunEventData(TOOL_CALL, tool_call=ToolCall("c1", "f", arguments)))
        self.pump.flush()
        self.assert_ended_unsendable("r3", "tool_call")
        self.assertEqual(len(self.flushLoggedErrors(TypeError)), 3)

    def test_unsendable_before_execute_returns(self):
        """
        An adapter that emits such an event before its C{execute} even
        returned gets its work cancelled as soon as it did.
        """
        cancelled = []
        returned: defer.Deferred[None] = defer.Deferred(lambda d: cancelled.append(d))

        def execute(run, emit):
            emit(RunEventData(START, usage=Usage(2**70, 0)))
            return returned

        self.patch(self.adapter, "execute", execute)
        self.edge.connection.send(run_request("r1"))
        self.pump.flush()
        self.assertEqual(cancelled, [returned])
        self.assert_ended_unsendable("r1", "start")
        self.flushLoggedErrors(ValueError)

    def test_lone_surrogate(self):
        """
        Text UTF-8 cannot carry (a lone surrogate, as a JSON text may hold
        one) goes out cleaned, U+FFFD in its place, and counts its bytes;
        the halves of a character joined in one turn become the
        character. Nothing fails: another run's text of the same turn goes
        out at the end of it as usual, and an error's message is cleaned
        the same way, its code kept.
        """
        (emit1, d1), (emit2, _) = self.start("r1"), self.start("r2")
        emit1(RunEventData(START))
        emit2(RunEventData(START))
        self.pump.flush()
        emit1._emit(RunEventData(DELTA, text="hello \ud83d"))
        emit1._emit(RunEventData(DELTA, text=" \ud83d"))
        emit1._emit(RunEventData(DELTA, text="\ude00"))
        emit2._emit(RunEventData(DELTA, text="r2 text"))
        self.clock.advance(0)
        self.pump.flush()
        self.assertEqual([e.text for e in events(self.edge, "r1")], ["", "hello \ufffd \U0001f600"])
        self.assertEqual([e.text for e in events(self.edge, "r2")], ["", "r2 text"])
        self.assertEqual(self.store.events["r1"][-1][1].text, "hello \ufffd \U0001f600")
        emit1(RunEventData(ERROR, error=RunFailure(INCOMPLETE, "cut at \udc00")))
        d1.callback(None)
        self.pump.flush()
        terminal = events(self.edge, "r1")[-1]
        self.assertEqual((terminal.seq, terminal.type, terminal.error.code), (3, "error", "incomplete"))
        self.assertEqual(terminal.error.message, "cut at \ufffd")
        emit2(RunEventData(DELTA, text=" more"))
        self.pump.flush()
        self.assertEqual([e.text for e in events(self.edge, "r2")], ["", "r2 text", " more"])

    def test_lone_surrogate_counts_against_the_window(self):
        """
        The credit a cleaned delta spends is the UTF-8 size of what went
        out.
        """
        self.edge.connection.send(run_request("r1", window_bytes=100))
        self.pump.flush()
        emit = self.adapter.runs[-1][1]
        emit(RunEventData(DELTA, text="ab\ud83d"))
        self.pump.flush()
        [relay] = self.session.inflight.works()
        self.assertEqual(relay.flow.credit, 100 - len("ab\ufffd".encode()))
