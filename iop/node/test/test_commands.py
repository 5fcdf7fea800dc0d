"""
Node commands and session termination, answered over the wire.
"""

import json

from twisted.trial.unittest import SynchronousTestCase

from iop.node.commands import ANSWER_MAX
from iop.protocols import messages
from iop.protocols.wire import MAX_FRAME_BYTES
from iop.run import COMPLETE, DELTA, START, RunEventData
from iop.testing.node import RecordingStore, adapter_config, manual, ready_node, run_request


class CommandTests(SynchronousTestCase):
    def setUp(self):
        self.session, self.edge, self.pump, self.context = ready_node(
            adapter_config("manual", max_concurrency=3, sessions=True),
            adapter_config("plain", type="plain", max_concurrency=1),
        )

    def command(self, command, adapter="", args=None, request_id="c1"):
        self.edge.connection.send(
            messages.command_request(
                request_id=request_id, command=command, adapter=adapter, args_json=json.dumps(args) if args else ""
            )
        )
        self.pump.flush()
        [response] = [r for r in self.edge.of("node_command_response") if r.request_id == request_id]
        return response

    def result(self, response):
        self.assertTrue(response.ok, response.error)
        return json.loads(response.result_json)

    def test_capabilities(self):
        """
        C{capabilities} lists every adapter with its type, concurrency,
        features and current use.
        """
        self.edge.connection.send(run_request("r1"))
        self.pump.flush()
        adapters = {a["name"]: a for a in self.result(self.command("capabilities"))["adapters"]}
        self.assertEqual(
            adapters["manual"],
            {
                "name": "manual",
                "type": "manual",
                "max_concurrency": 3,
                "sessions": True,
                "tunnel": True,
                "commands": ["manual_ping", "manual_wait"],
                "continuation": False,
                "in_use": 1,
            },
        )
        self.assertEqual(adapters["plain"]["in_use"], 0)
        self.assertFalse(adapters["plain"]["tunnel"])

    def test_transport_status(self):
        """
        C{transport_status} reports the node id, connection state and the
        heartbeat settings in use.
        """
        status = self.result(self.command("transport_status"))
        self.assertEqual(status["node_id"], "node-1")
        self.assertTrue(status["connected"])
        self.assertEqual(status["heartbeat"], {"interval_sec": 2.0, "timeout_sec": 5.0})
        self.assertNotIn("generation", json.dumps(status))

    def test_usage_status(self):
        """
        C{usage_status} reports per-adapter token totals and run outcomes.
        """
        from iop.run import COMPLETE, RunEventData, Usage

        self.edge.connection.send(run_request("r1"))
        self.pump.flush()
        manual(self.context.host, "manual").runs[0][1](RunEventData(COMPLETE, usage=Usage(10, 20)))
        usage = self.result(self.command("usage_status"))["adapters"]["manual"]
        self.assertEqual((usage["input_tokens"], usage["output_tokens"]), (10, 20))
        self.assertEqual(usage["runs"], {"complete": 1, "error": 0, "cancelled": 0})

    def test_session_list(self):
        """
        C{session_list} asks every adapter that keeps sessions.
        """
        result = self.result(self.command("session_list"))
        self.assertEqual(result, {"adapters": {"manual": [{"session_id": "s1"}]}})

    def test_session_list_on_sessionless_adapter(self):
        """
        C{session_list} for a named adapter without sessions is a clear
        error.
        """
        response = self.command("session_list", adapter="plain")
        self.assertFalse(response.ok)
        self.assertIn("does not support sessions", response.error)

    def test_adapter_command_forwarded(self):
        """
        A command that is not a node command goes to the named adapter
        with its parsed arguments.
        """
        result = self.result(self.command("manual_ping", adapter="manual", args={"x": 1}))
        self.assertEqual(result, {"pong": {"x": 1}})

    def test_adapter_command_not_supported(self):
        """
        A command another adapter of the node declares, sent to one that
        does not, answers ok=false with code C{not_supported}.
        """
        response = self.command("manual_ping", adapter="plain")
        self.assertEqual((response.ok, response.code), (False, "not_supported"))
        self.assertIn("has no command 'manual_ping'", response.error)

    def test_unknown_command(self):
        """
        A command no adapter of the node declares is C{unknown_command}.
        """
        response = self.command("frobnicate", adapter="manual")
        self.assertEqual((response.ok, response.code), (False, "unknown_command"))
        self.assertIn("'frobnicate'", response.error)

    def test_unknown_adapter_and_missing_adapter(self):
        """
        A command for an unknown adapter is C{unknown_adapter}; an adapter
        command with no adapter named is C{invalid_args}; both say so.
        """
        response = self.command("manual_ping", adapter="nope", request_id="c1")
        self.assertEqual((response.ok, response.code), (False, "unknown_adapter"))
        self.assertIn("no adapter named 'nope'", response.error)
        response = self.command("manual_ping", request_id="c2")
        self.assertEqual((response.ok, response.code), (False, "invalid_args"))
        self.assertIn("name the adapter", response.error)

    def test_progress_then_answer(self):
        """
        A request with C{stream} gets the adapter's progress as progress
        responses, in order, then exactly one final answer.
        """
        self.edge.connection.send(
            messages.command_request(request_id="c9", command="manual_wait", adapter="manual", stream=True)
        )
        self.pump.flush()
        progress, d = manual(self.context.host, "manual").waiting[-1]
        assert progress is not None
        progress({"completed": 1})
        progress({"completed": 2})
        d.callback({"status": "success"})
        self.pump.flush()
        responses = self.edge.of("node_command_response")
        self.assertEqual(
            [(r.progress, json.loads(r.result_json)) for r in responses],
            [
                (True, {"completed": 1}),
                (True, {"completed": 2}),
                (False, {"status": "success"}),
            ],
        )

    def test_no_progress_unless_asked(self):
        """
        Without C{stream}, the adapter is given no progress callback.
        """
        self.edge.connection.send(messages.command_request(request_id="c9", command="manual_wait", adapter="manual"))
        self.pump.flush()
        progress, _ = manual(self.context.host, "manual").waiting[-1]
        self.assertIsNone(progress)

    def test_cancel_command(self):
        """
        CANCEL_COMMAND from the Edge cancels the adapter's command (its
        back-end request is aborted); the answer says C{cancelled}.
        """
        self.edge.connection.send(messages.command_request(request_id="c9", command="manual_wait", adapter="manual"))
        self.pump.flush()
        self.edge.connection.send(messages.cancel_command("c9"))
        self.pump.flush()
        adapter = manual(self.context.host, "manual")
        self.assertEqual(adapter.cancelled, ["command:0"])
        (response,) = self.edge.of("node_command_response")
        self.assertEqual((response.ok, response.code), (False, "cancelled"))

    def test_answer_too_large(self):
        """
        An answer too large for a frame cannot be sent: the request is
        answered C{failed}, saying so, rather than not at all.
        """
        self.patch(self.session.commands, "answer_max", 100)
        response = self.command("manual_ping", adapter="manual", args={"text": "x" * 200})
        self.assertEqual((response.ok, response.code), (False, "failed"))
        self.assertIn("answer too large", response.error)
        self.assertIsNone(self.edge.lost_reason)
        self.assertTrue(self.result(self.command("manual_ping", "manual", {"text": "x"}, request_id="c2")))

    def test_bad_args(self):
        """
        Unparsable args_json is an error answer, not a dropped connection.
        """
        self.edge.connection.send(messages.command_request(request_id="c1", command="capabilities", args_json="{"))
        self.pump.flush()
        [response] = self.edge.of("node_command_response")
        self.assertFalse(response.ok)
        self.assertIn("args_json", response.error)
        self.assertIsNone(self.edge.lost_reason)


class TerminateSessionTests(SynchronousTestCase):
    def terminate(self, adapter, session_id="s1"):
        session, edge, pump, context = ready_node(
            adapter_config("manual", sessions=True), adapter_config("plain", type="plain")
        )
        edge.connection.send(
            messages.terminate_session(request_id="q1", adapter=adapter, target="t", session_id=session_id, caller="")
        )
        pump.flush()
        [response] = edge.of("cancel_response")
        self.assertEqual(response.request_id, "q1")
        return response, context

    def test_terminated(self):
        """
        An adapter with sessions ends the session and answers ok.
        """
        response, context = self.terminate("manual")
        self.assertTrue(response.ok)
        self.assertEqual(manual(context.host, "manual").terminated, [("t", "s1")])

    def test_unknown_session(self):
        """
        A session the adapter never knew answers ok=false with code
        C{unknown_session}, never "terminated".
        """
        response, _ = self.terminate("manual", session_id="ghost")
        self.assertEqual((response.ok, response.code), (False, "unknown_session"))
        self.assertIn("ghost", response.reason)

    def test_not_supported(self):
        """
        An adapter without sessions answers ok=false with a clear "not
        supported" reason naming the adapter.
        """
        response, context = self.terminate("plain")
        self.assertEqual((response.ok, response.code), (False, "not_supported"))
        self.assertIn("not supported", response.reason)
        self.assertIn("adapter plain", response.reason)

    def test_unknown_adapter(self):
        """
        An unknown adapter answers ok=false.
        """
        response, context = self.terminate("nope")
        self.assertFalse(response.ok)
        self.assertIn("nope", response.reason)


class RunHistoryCommandTests(SynchronousTestCase):
    def setUp(self):
        self.store = RecordingStore()
        self.session, self.edge, self.pump, self.context = ready_node(
            adapter_config("echo", type="echo", max_concurrency=2), store=self.store
        )

    def command(self, command, args=None):
        self.edge.connection.send(
            messages.command_request(request_id="c1", command=command, args_json=json.dumps(args or {}))
        )
        self.pump.flush()
        [response] = self.edge.of("node_command_response")
        self.edge.received.clear()
        return response

    def test_run_get(self):
        """
        C{run_get} answers a finished run from the store: its row with the
        whole output, and its events after C{after}.
        """
        self.edge.connection.send(run_request("r1", adapter="echo", text="a b c"))
        self.pump.flush()
        self.edge.received.clear()
        answer = json.loads(self.command("run_get", {"run_id": "r1", "after": 1}).result_json)
        self.assertEqual((answer["run"]["status"], answer["run"]["output"]), ("complete", "a b c"))
        self.assertEqual([e["seq"] for e in answer["events"]], [2, 3])
        self.assertEqual(answer["events"][-1]["type"], "complete")

    def long_run(self, deltas, size):
        """
        A finished run C{r1} on a manual adapter, C{deltas} deltas of
        C{size} characters each, one per turn (so one event each).
        """
        self.session, self.edge, self.pump, self.context = ready_node(store=self.store)
        self.edge.connection.send(run_request("r1"))
        self.pump.flush()
        emit = manual(self.context.host, "manual").runs[0][1]
        emit(RunEventData(START))
        for i in range(deltas):
            emit(RunEventData(DELTA, text=str(i % 10) * size))
        emit(RunEventData(COMPLETE))
        self.pump.flush()
        self.edge.received.clear()

    def test_run_get_of_a_long_run(self):
        """
        The answer of a run whose output and events would not fit in a
        frame together is cut to fit, and sent: the whole output, then the
        first events, with C{more_events}; the Edge gets the rest asking
        again after the last one it got.
        """
        self.long_run(9, 1024 * 1024)
        response = self.command("run_get", {"run_id": "r1"})
        self.assertTrue(response.ok, response.error)
        self.assertLessEqual(len(response.result_json), ANSWER_MAX)
        answer = json.loads(response.result_json)
        self.assertEqual(len(answer["run"]["output"]), 9 * 1024 * 1024)
        self.assertNotIn("output_truncated", answer["run"])
        self.assertTrue(answer["more_events"])
        seqs = [e["seq"] for e in answer["events"]]
        self.assertEqual(seqs, list(range(1, len(seqs) + 1)))
        self.assertLess(len(seqs), 11)
        rest = json.loads(self.command("run_get", {"run_id": "r1", "after": seqs[-1]}).result_json)
        self.assertNotIn("more_events", rest)
        self.assertEqual([e["seq"] for e in rest["events"]], list(range(seqs[-1] + 1, 12)))
        self.assertEqual(rest["events"][-1]["type"], "complete")
        self.assertLess(MAX_FRAME_BYTES - ANSWER_MAX, 1024 * 1024)

    def test_run_get_cut_by_size(self):
        """
        Cut to fit (here a small limit), the events are a prefix, in
        order, that fits with the output; without the output
        (C{"output": false}) more of them fit; an output too large alone is
        cut too, and the row says C{output_truncated}.
        """
        self.long_run(6, 40)
        self.patch(self.session.commands, "answer_max", 1000)
        response = self.command("run_get", {"run_id": "r1"})
        self.assertLessEqual(len(response.result_json), 1000)
        answer = json.loads(response.result_json)
        self.assertEqual(len(answer["run"]["output"]), 240)
        self.assertTrue(answer["more_events"])
        kept = len(answer["events"])
        self.assertEqual([e["seq"] for e in answer["events"]], list(range(1, kept + 1)))
        response = self.command("run_get", {"run_id": "r1", "output": False})
        self.assertLessEqual(len(response.result_json), 1000)
        bare = json.loads(response.result_json)
        self.assertNotIn("output", bare["run"])
        self.assertGreater(len(bare["events"]), kept)
        self.patch(self.session.commands, "answer_max", 500)
        response = self.command("run_get", {"run_id": "r1"})
        self.assertLessEqual(len(response.result_json), 500)
        cut = json.loads(response.result_json)
        self.assertTrue(cut["run"]["output_truncated"])
        self.assertTrue(answer["run"]["output"].startswith(cut["run"]["output"]))
        self.assertEqual((cut["events"], cut["more_events"]), ([], True))
        self.assertEqual(self.command("run_get", {"run_id": "r1", "output": 1}).code, "invalid_args")

    def test_run_list(self):
        """
        C{run_list} gives the latest runs, newest first, filtered by status
        and limited.
        """
        for run_id in ("r1", "r2", "r3"):
            self.edge.connection.send(run_request(run_id, adapter="echo", text="x"))
        self.edge.connection.send(run_request("bad", adapter="nope"))
        self.pump.flush()
        self.edge.received.clear()
        runs = json.loads(self.command("run_list", {"status": "complete", "limit": 2}).result_json)["runs"]
        self.assertEqual([r["run_id"] for r in runs], ["r3", "r2"])

    def test_run_list_by_caller(self):
        """
        The caller key a run belongs to (C{RunRequest.caller}) is recorded,
        and C{run_list} filters by it.
        """
        for run_id, caller in (("r1", "alice"), ("r2", "bob"), ("r3", "alice")):
            self.edge.connection.send(run_request(run_id, adapter="echo", text="x", caller=caller))
        self.pump.flush()
        self.edge.received.clear()
        runs = json.loads(self.command("run_list", {"caller": "alice"}).result_json)["runs"]
        self.assertEqual([(r["run_id"], r["caller"]) for r in runs], [("r3", "alice"), ("r1", "alice")])

    def test_errors(self):
        """
        An unknown run is C{unknown_run}; bad arguments C{invalid_args}.
        """
        self.assertEqual(self.command("run_get", {"run_id": "nope"}).code, "unknown_run")
        self.assertEqual(self.command("run_get", {}).code, "invalid_args")
        self.assertEqual(self.command("run_get", {"run_id": "r", "after": -1}).code, "invalid_args")
        self.assertEqual(self.command("run_list", {"limit": 0}).code, "invalid_args")
        self.assertEqual(self.command("run_list", {"status": 3}).code, "invalid_args")
        self.assertEqual(self.command("run_list", {"caller": 3}).code, "invalid_args")
