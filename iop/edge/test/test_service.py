"""
Edge service tests over in-memory connections: registration, readiness,
generation fencing, run relay, cancel and disconnects.
"""

import copy
import json
from typing import Any, cast

from twisted.internet.defer import CancelledError
from twisted.logger import capturedLogs, formatEvent
from twisted.trial.unittest import SynchronousTestCase

from iop.config import ConfigError
from iop.edge.config import token_digest
from iop.edge.errors import ServiceError
from iop.edge.registry import Wire
from iop.edge.spec import RunSpec
from iop.protocols import messages
from iop.testing.edge import EDGE_YAML, EdgeHarness, Recorder, edge_config


def hello():
    return RunSpec(messages=[{"role": "user", "content": "hello world"}], adapter="echo", node="n1")


class RegistrationTests(SynchronousTestCase):
    def setUp(self):
        self.edge = EdgeHarness()

    def test_accepted(self):
        """
        A known token is accepted with the node's configuration: its id,
        adapters (type-specific keys as JSON) and heartbeat timings.
        """
        node, _, _ = self.edge.register(ready=False)
        (response,) = node.of("register_response")
        self.assertTrue(response.accepted)
        self.assertEqual(response.config.node_id, "n1")
        self.assertEqual([(a.name, a.type, a.max_concurrency) for a in response.config.adapters], [("echo", "echo", 2)])
        self.assertEqual((response.config.heartbeat_interval_sec, response.config.heartbeat_timeout_sec), (2.0, 5.0))
        self.assertEqual(self.edge.node_events[-1]["event"], "registered")

    def test_unknown_token(self):
        """
        An unknown token is refused with UNKNOWN_TOKEN, published as a
        rejected lifecycle event, and the connection is closed.
        """
        node, pump, _ = self.edge.register(token="nope", ready=False)
        (response,) = node.of("register_response")
        self.assertFalse(response.accepted)
        self.assertEqual(response.code, messages.UNKNOWN_TOKEN)
        self.assertTrue(node.lost)
        self.assertEqual(self.edge.node_events[-1]["event"], "rejected")
        self.assertNotIn("nope", repr(self.edge.node_events))

    def test_token_sha256(self):
        """
        A node configured with the SHA-256 of its token accepts the token.
        """
        data = dict(EDGE_YAML)
        data["nodes"] = [dict(EDGE_YAML["nodes"][0], token=None)]
        del data["nodes"][0]["token"]
        data["nodes"][0]["token_sha256"] = token_digest("secret").hex()
        data["model_groups"] = []
        edge = EdgeHarness(data)
        node, _, _ = edge.register(token="secret", ready=False)
        self.assertTrue(node.of("register_response")[0].accepted)

    def test_ready_ack(self):
        """
        Ready from the registered connection is acknowledged and makes the
        node connected in the snapshot.
        """
        node, _, _ = self.edge.register()
        self.assertTrue(node.of("node_ready_response")[0].ready)
        self.assertTrue(self.edge.service.status()["nodes"][0]["connected"])
        self.assertEqual([e["event"] for e in self.edge.node_events], ["registered", "ready"])

    def test_pending_excluded(self):
        """
        A registered but not ready node is excluded from dispatch: direct,
        fallback and pooled placement all fail, and it shows disconnected.
        """
        self.edge.register(ready=False)
        self.failureResultOf(
            self.edge.service.submit(RunSpec(messages=[], adapter="echo", node="n1"), Recorder().for_run), ServiceError
        )
        self.failureResultOf(
            self.edge.service.submit(RunSpec(messages=[], adapter="echo"), Recorder().for_run), ServiceError
        )
        f = self.failureResultOf(
            self.edge.service.submit(RunSpec(messages=[], model="grp"), Recorder().for_run), ServiceError
        )
        self.assertEqual(f.value.kind, "unavailable")
        self.assertFalse(self.edge.service.status()["nodes"][0]["connected"])

    def test_messages_before_ready_drop(self):
        """
        A run event from a pending connection is a protocol violation that
        closes it.
        """
        node, pump, edge_protocol = self.edge.register(ready=False)
        node.connection.send(messages.run_event("x", 0, "start"))
        pump.flush()
        self.assertTrue(node.lost)
        self.assertIn("run_event", edge_protocol.close_reason)


class FencingTests(SynchronousTestCase):
    def setUp(self):
        self.edge = EdgeHarness()

    def test_duplicate_register(self):
        """
        A second connection for a node with a live owner is refused as
        retryable (DUPLICATE_CONNECTION) and the owner is untouched.
        """
        first, _, _ = self.edge.register()
        second, _, _ = self.edge.register(ready=False)
        response = second.of("register_response")[0]
        self.assertEqual(response.code, messages.DUPLICATE_CONNECTION)
        self.assertFalse(first.lost)
        self.assertTrue(self.edge.service.status()["nodes"][0]["connected"])
        self.assertEqual(self.edge.node_events[-1]["event"], "rejected")

    def test_duplicate_ready(self):
        """
        A repeated ready from the owner is acknowledged and changes nothing
        (no second "ready" event, capacity not doubled).
        """
        node, pump, _ = self.edge.register()
        node.connection.send(messages.ready_request(node_id="n1"))
        pump.flush()
        self.assertEqual([r.ready for r in node.of("node_ready_response")], [True, True])
        self.assertEqual([e["event"] for e in self.edge.node_events].count("ready"), 1)
        provider = self.edge.service.status()["nodes"][0]["providers"][0]
        self.assertEqual(provider["capacity"]["normal"], 1)

    def test_ready_for_other_node(self):
        """
        A ready naming another node than the registration is refused.
        """
        node, pump, _ = self.edge.register(ready=False)
        node.connection.send(messages.ready_request(node_id="n2"))
        pump.flush()
        self.assertFalse(node.of("node_ready_response")[0].ready)
        self.assertFalse(self.edge.service.status()["nodes"][1]["connected"])

    def test_stale_ready(self):
        """
        A ready from a connection that is no longer the owner is refused.
        """
        # No wire: the link is lost before anything is sent on it.
        link = self.edge.service.registry.register("tok-1", wire=cast(Wire, None))
        self.edge.service.registry.lost(link)
        response, first = self.edge.service.links.ready(link, "n1")
        self.assertFalse(first)
        self.assertFalse(response.ready)
        self.assertIn("stale", response.reason)

    def test_stale_close_changes_nothing(self):
        """
        Closing a refused duplicate connection leaves the owner connected
        and its work running.
        """
        owner, _, _ = self.edge.register()
        recorder = Recorder()
        self.successResultOf(self.edge.service.submit(hello(), recorder.for_run))
        duplicate, dup_pump, _ = self.edge.register(ready=False)
        self.assertTrue(duplicate.lost)
        self.assertTrue(self.edge.service.status()["nodes"][0]["connected"])
        self.assertEqual(recorder.events, [])
        self.assertNotIn("disconnected", [e["event"] for e in self.edge.node_events])

    def test_lost_before_ready_is_logged(self):
        """
        A registered node whose connection closes before its ready (a Node
        that could not run its configuration and exited) leaves one line
        saying so, with the reason the wire gives; a ready node's loss is
        logged as a disconnect, not this.
        """
        node, pump, _ = self.edge.register(ready=False)
        with capturedLogs() as events:
            node.connection.transport.loseConnection()
            pump.flush()
        lines = [formatEvent(e) for e in events if "before it was ready" in e["log_format"]]
        self.assertEqual(
            lines,
            [
                "node n1 disconnected before it was ready (generation 1): Connection was closed cleanly: Connection done."
            ],
        )
        ready, pump, _ = self.edge.register()
        with capturedLogs() as events:
            ready.connection.transport.loseConnection()
            pump.flush()
        self.assertEqual([e for e in events if "before it was ready" in e["log_format"]], [])
        self.assertIn(
            "node n1 disconnected: Connection was closed cleanly: Connection done.", [formatEvent(e) for e in events]
        )

    def test_reconnect_new_generation(self):
        """
        After the owner is gone, a new registration is accepted under a new
        generation and its ready activates the node again.
        """
        first, pump, edge_protocol = self.edge.register()
        edge_protocol.transport.loseConnection()
        pump.flush()
        self.assertFalse(self.edge.service.status()["nodes"][0]["connected"])
        second, _, _ = self.edge.register()
        self.assertTrue(second.of("node_ready_response")[0].ready)
        owner = self.edge.service.registry.owner("n1")
        assert owner is not None
        self.assertEqual(owner.generation, 2)
        self.assertTrue(self.edge.service.status()["nodes"][0]["connected"])


class RunTests(SynchronousTestCase):
    def setUp(self):
        self.edge = EdgeHarness()
        self.node, self.pump, self.edge_protocol = self.edge.register()

    def reply(self, run_id, *events):
        for seq, (kind, text) in enumerate(events, 1):
            self.node.connection.send(messages.run_event(run_id=run_id, seq=seq, type=kind, text=text))
        self.pump.flush()

    def test_run_request_and_relay_order(self):
        """
        SubmitRun sends one RunRequest with the messages, and relays the
        Node's events to the listener in order, ending at the terminal.
        """
        recorder = Recorder()
        run = self.successResultOf(self.edge.service.submit(hello(), recorder.for_run))
        self.pump.flush()
        (request,) = self.node.of("run_request")
        self.assertEqual(request.run_id, run)
        self.assertEqual([(m.role, m.content) for m in request.messages], [("user", "hello world")])
        self.reply(run, ("start", ""), ("delta", "hello "), ("delta", "world"), ("complete", ""))
        self.assertEqual(recorder.types(), ["start", "delta", "delta", "complete"])
        self.assertEqual("".join(e.text for e in recorder.events), "hello world")
        self.assertNotIn(run, self.edge.service.inflight)

    def test_events_after_terminal_ignored(self):
        """
        Nothing reaches the listener after the terminal.
        """
        recorder = Recorder()
        run = self.successResultOf(self.edge.service.submit(hello(), recorder.for_run))
        self.reply(run, ("complete", ""), ("delta", "late"))
        self.assertEqual(recorder.types(), ["complete"])

    def test_single_node_fallback(self):
        """
        Without a node, the single ready node is chosen; with two ready
        nodes the caller must name one.
        """
        recorder = Recorder()
        spec = RunSpec(messages=[{"role": "user", "content": "x"}], adapter="echo")
        run = self.successResultOf(self.edge.service.submit(spec, recorder.for_run))
        dispatch = self.edge.service.inflight.get(run)
        assert dispatch is not None
        self.assertEqual(dispatch.link.node_id, "n1")
        self.edge.register(token="tok-2")
        f = self.failureResultOf(self.edge.service.submit(spec, Recorder().for_run), ServiceError)
        self.assertIn("name a node", f.value.message)

    def test_cancel(self):
        """
        Cancel sends CancelRequest(CANCEL_RUN) for the run; the Node's
        cancelled terminal ends it.
        """
        recorder = Recorder()
        run = self.successResultOf(self.edge.service.submit(hello(), recorder.for_run))
        self.assertTrue(self.edge.service.cancel(run))
        self.pump.flush()
        (cancel,) = self.node.of("cancel_request")
        self.assertEqual((cancel.kind, cancel.run_id), (messages.CANCEL_RUN, run))
        self.reply(run, ("cancelled", ""))
        self.assertEqual(recorder.types(), ["cancelled"])
        self.assertFalse(self.edge.service.cancel(run))

    def test_cancel_without_answer(self):
        """
        A cancel the Node never confirms still ends the run as cancelled
        after the grace period, returning its lease.
        """
        recorder = Recorder()
        spec = RunSpec(messages=[{"role": "user", "content": "x"}], model="grp")
        run = self.successResultOf(self.edge.service.submit(spec, recorder.for_run))
        self.edge.service.cancel(run)
        self.edge.clock.advance(self.edge.config.run_grace_sec)
        self.assertEqual(recorder.types(), ["cancelled"])
        self.assertEqual(self.edge.service.pool.active_leases(), [])

    def test_disconnect_ends_runs(self):
        """
        When the ready owner disconnects, its in-flight runs end at once
        with an error saying so, its leases return, it leaves dispatch,
        and a disconnected event is published.
        """
        recorder = Recorder()
        spec = RunSpec(messages=[{"role": "user", "content": "x"}], model="grp")
        self.successResultOf(self.edge.service.submit(spec, recorder.for_run))
        self.assertEqual(len(self.edge.service.pool.active_leases()), 1)
        self.edge_protocol.transport.loseConnection()
        self.pump.flush()
        self.assertEqual(recorder.types(), ["error"])
        error = recorder.events[0].error
        assert error is not None
        self.assertEqual(error.code, "node_disconnected")
        self.assertEqual(self.edge.service.pool.active_leases(), [])
        self.assertEqual(self.edge.node_events[-1]["event"], "disconnected")
        status = self.edge.service.status()["nodes"][0]
        self.assertFalse(status["connected"])
        self.assertEqual(status["providers"][0]["status"], "unavailable")

    def test_lease_returned_on_terminal(self):
        """
        A pooled run's lease returns exactly once, on its terminal.
        """
        spec = RunSpec(messages=[{"role": "user", "content": "x"}], model="grp")
        run = self.successResultOf(self.edge.service.submit(spec, Recorder().for_run))
        dispatch = self.edge.service.inflight.get(run)
        assert dispatch is not None
        lease = dispatch.placement.lease
        assert lease is not None
        self.reply(run, ("complete", ""))
        self.assertEqual(self.edge.service.pool.active_leases(), [])
        self.assertFalse(lease.release())

    def test_send_failure_returns_lease(self):
        """
        A RunRequest too large for one frame returns the lease and fails
        the submit as the caller's mistake (413 C{request_too_large}).
        """
        spec = RunSpec(messages=[{"role": "user", "content": "x" * (17 * 1024 * 1024)}], model="grp")
        f = self.failureResultOf(self.edge.service.submit(spec, Recorder().for_run), ServiceError)
        self.assertEqual((f.value.kind, f.value.code), ("too_large", "request_too_large"))
        self.assertEqual(self.edge.service.pool.active_leases(), [])
        self.assertEqual(len(self.edge.service.inflight), 0)

    def test_command(self):
        """
        A node command is sent and its response's JSON result returned.
        """
        d = self.edge.service.command("n1", "capabilities")
        self.pump.flush()
        (request,) = self.node.of("node_command_request")
        self.node.connection.send(messages.command_result(request.request_id, '{"a": 1}'))
        self.pump.flush()
        self.assertEqual(self.successResultOf(d), {"a": 1})

    def test_terminate_session(self):
        """
        Terminate-session is sent as CancelRequest(TERMINATE_SESSION) and
        the Node's answer (here "not supported", with its code) comes back;
        an answer without a code (an older Node) counts as C{failed}. The
        caller it names goes with it.
        """
        d = self.edge.service.terminate_session("n1", "echo", "", "s1", "alice")
        self.pump.flush()
        (request,) = self.node.of("cancel_request")
        self.assertEqual((request.kind, request.caller), (messages.TERMINATE_SESSION, "alice"))
        answer = messages.cancel_response(request_id=request.request_id, ok=False, reason="no", code="not_supported")
        self.node.connection.send(answer)
        self.pump.flush()
        self.assertEqual(self.successResultOf(d), (False, "no", "not_supported"))
        d = self.edge.service.terminate_session("n1", "echo", "", "s1", "")
        self.pump.flush()
        request = self.node.of("cancel_request")[-1]
        self.node.connection.send(messages.cancel_response(request_id=request.request_id, ok=False, reason="?"))
        self.pump.flush()
        self.assertEqual(self.successResultOf(d), (False, "?", "failed"))

    def test_command_failure_codes(self):
        """
        A command the Node refuses as the caller's mistake is an C{invalid}
        (400) failure with the Node's code; an unknown adapter is
        C{not_found}; anything else is C{failed} (502).
        """
        for code, kind in [
            ("unknown_command", "invalid"),
            ("not_supported", "invalid"),
            ("unknown_adapter", "not_found"),
            ("failed", "failed"),
        ]:
            d = self.edge.service.command("n1", "x")
            self.pump.flush()
            request = self.node.of("node_command_request")[-1]
            self.node.connection.send(messages.command_error(request.request_id, code, "e"))
            self.pump.flush()
            failure = self.failureResultOf(d, ServiceError)
            self.assertEqual((failure.value.kind, failure.value.code), (kind, code))

    def test_command_timeout_aborts_on_node(self):
        """
        A command that outlives its timeout fails with C{timeout} (504) and
        the Node is told to abort it (CANCEL_COMMAND with its id); a late
        answer is ignored.
        """
        d = self.edge.service.command("n1", "capabilities")
        self.edge.advance(10)
        failure = self.failureResultOf(d, ServiceError)
        self.assertEqual(failure.value.kind, "timeout")
        (request,) = self.node.of("node_command_request")
        (abort,) = self.node.of("cancel_request")
        self.assertEqual((abort.kind, abort.request_id), (messages.CANCEL_COMMAND, request.request_id))

    def test_command_progress(self):
        """
        A command asked with C{progress} sets C{stream} on the wire; the
        Node's progress answers reach the callback in order before the
        final answer fires the Deferred; a cancel aborts it on the Node.
        """
        updates: list[dict[str, Any]] = []
        d = self.edge.service.command("n1", "ollama_pull", "ollama", {"model": "m"}, progress=updates.append)
        self.pump.flush()
        (request,) = self.node.of("node_command_request")
        self.assertTrue(request.stream)
        for n in (1, 2):
            self.node.connection.send(messages.command_result(request.request_id, f'{{"n": {n}}}', progress=True))
        self.pump.flush()
        self.assertEqual(updates, [{"n": 1}, {"n": 2}])
        self.assertNoResult(d)
        d.cancel()
        self.failureResultOf(d, CancelledError)
        self.pump.flush()
        self.assertEqual(self.node.of("cancel_request")[-1].request_id, request.request_id)

    def test_progress_that_is_not_json_fails_the_command_alone(self):
        """
        A progress answer whose C{result_json} is not JSON fails that
        command (C{protocol_error}) and tells the Node to stop it; the
        Node's link stays up.
        """
        d = self.edge.service.command("n1", "ollama_pull", "ollama", {"model": "m"}, progress=lambda update: None)
        self.pump.flush()
        (request,) = self.node.of("node_command_request")
        self.node.connection.send(messages.command_result(request.request_id, '{"status": "pull', progress=True))
        self.pump.flush()
        failure = self.failureResultOf(d, ServiceError)
        self.assertEqual(failure.value.code, "protocol_error")
        self.assertEqual(self.node.of("cancel_request")[-1].request_id, request.request_id)
        self.assertFalse(self.node.lost)
        self.assertTrue(self.edge.service.status()["nodes"][0]["connected"])

    def test_status_keeps_offline_nodes(self):
        """
        The snapshot lists every configured node; an offline one shows
        connected=false and its providers unavailable/offline with zeros.
        """
        nodes = {n["id"]: n for n in self.edge.service.status()["nodes"]}
        self.assertTrue(nodes["n1"]["connected"])
        self.assertFalse(nodes["n2"]["connected"])
        (provider,) = nodes["n2"]["providers"]
        self.assertEqual((provider["status"], provider["health"]), ("unavailable", "offline"))
        self.assertEqual(provider["capacity"], {"normal": 0, "long": 0})
        self.assertEqual(provider["in_use"], {"normal": 0, "long": 0})


class ReadyOrderTests(SynchronousTestCase):
    def test_ready_ack_before_queued_work(self):
        """
        A waiter served by a node's ready is sent to it only after the
        NodeReadyResponse: the Node never sees work before its ack.
        """
        edge = EdgeHarness()
        edge.register(token="tok-2")
        spec = RunSpec(messages=[{"role": "user", "content": "x"}], model="grp")
        self.successResultOf(edge.service.submit(spec, Recorder().for_run))
        waiting = edge.service.submit(spec, Recorder().for_run)
        self.assertNoResult(waiting)
        node, _, _ = edge.register(token="tok-1")
        run = self.successResultOf(waiting)
        dispatch = edge.service.inflight.get(run)
        assert dispatch is not None
        self.assertEqual(dispatch.link.node_id, "n1")
        kinds = [kind for kind, _ in node.received]
        self.assertEqual(kinds, ["register_response", "node_ready_response", "run_request"])


class ReloadTests(SynchronousTestCase):
    def setUp(self):
        self.edge = EdgeHarness()
        self.ready, self.pump, _ = self.edge.register(token="tok-1")
        self.pending, self.pending_pump, _ = self.edge.register(token="tok-2", ready=False)

    def changed(self, mutate):
        data = copy.deepcopy(EDGE_YAML)
        mutate(data)
        return edge_config(data)

    def test_adapter_change_pushed_to_ready_node(self):
        """
        Changed adapter settings are pushed as ConfigRefresh to a ready
        node, not to a pending one; a node that registers later gets them
        in its registration answer.
        """

        def mutate(data):
            for node in data["nodes"]:
                node["adapters"][0].update(max_concurrency=7, delay_ms=5)

        pushed = self.edge.service.reload(self.changed(mutate))
        self.pump.flush()
        self.pending_pump.flush()
        self.assertEqual(pushed, ["n1"])
        (refresh,) = self.ready.of("config_refresh")
        adapter = refresh.config.adapters[0]
        self.assertEqual((adapter.max_concurrency, json.loads(adapter.options_json)), (7, {"delay_ms": 5}))
        self.assertEqual(self.pending.of("config_refresh"), [])
        self.assertEqual(self.edge.service.links.config_payload("n2").adapters[0].max_concurrency, 7)

    def refresh(self, answer=None):
        """
        Push a max_concurrency change (7) to n1 and answer it with
        C{answer} (a NodeCommandResponse, or nothing).
        """

        def mutate(data):
            data["nodes"][0]["adapters"][0].update(max_concurrency=7)

        self.edge.service.reload(self.changed(mutate))
        self.pump.flush()
        (refresh,) = self.ready.of("config_refresh")
        if answer is not None:
            answer.request_id = refresh.request_id
            self.ready.connection.send(answer)
            self.pump.flush()
        return self.edge.service.status()["nodes"][0]

    def test_refresh_applied_shows_in_status(self):
        """
        A refresh the Node applied shows in the status: what the node runs
        now, and C{config_refresh: applied}.
        """
        node = self.refresh(messages.command_result("", '{"applied": ["echo"]}'))
        self.assertEqual(node["config_refresh"], {"state": "applied"})
        self.assertEqual(node["adapters"][0]["max_concurrency"], 7)

    def test_refresh_refused_shows_in_status(self):
        """
        A refresh the Node refused leaves the status showing the adapters
        it still runs, and the Node's reason.
        """
        node = self.refresh(messages.command_error("", "refused", "adapter echo: no such thing"))
        self.assertEqual(node["config_refresh"], {"state": "refused", "reason": "adapter echo: no such thing"})
        self.assertEqual(node["adapters"][0]["max_concurrency"], 2)
        self.flushLoggedErrors()

    def test_refresh_unacknowledged(self):
        """
        A refresh the Node never answers (an older Node) is shown as
        pending, then unacknowledged after the timeout.
        """
        node = self.refresh()
        self.assertEqual(node["config_refresh"], {"state": "pending"})
        self.edge.advance(30)
        node = self.edge.service.status()["nodes"][0]
        self.assertEqual(node["config_refresh"]["state"], "unacknowledged")

    def test_added_adapter_is_a_resource_once_applied(self):
        """
        An adapter added by a reload (no provider names it) gets its
        implicit resource live on the connected node once the Node applied
        the refresh, so direct work on it holds a lease right away.
        """

        def mutate(data):
            data["nodes"][0]["adapters"].append({"name": "extra", "type": "echo", "max_concurrency": 3})

        self.edge.service.reload(self.changed(mutate))
        self.pump.flush()
        (refresh,) = self.ready.of("config_refresh")
        self.ready.connection.send(messages.command_result(refresh.request_id, '{"applied": ["extra"]}'))
        self.pump.flush()
        spec = RunSpec(messages=[{"role": "user", "content": "x"}], adapter="extra", node="n1")
        self.successResultOf(self.edge.service.submit(spec, Recorder().for_run))
        (extra,) = [p for p in self.edge.service.status()["nodes"][0]["providers"] if p["id"] == "extra"]
        self.assertEqual((extra["in_use"]["normal"], extra["capacity"]["normal"], extra["implicit"]), (1, 3, True))

    def test_removed_adapter_retired_once_applied(self):
        """
        An adapter a reload removes (no provider named it) takes no new
        work once the Node applied the refresh: its waiter fails at once,
        its running work keeps its lease, and it leaves the status when
        that work ends.
        """

        def with_extra(data):
            data["nodes"][0]["adapters"].append({"name": "extra", "type": "echo", "max_concurrency": 1})

        edge = EdgeHarness(copy.deepcopy(EDGE_YAML))
        edge.service.reload(self.changed(with_extra))
        node, pump, _ = edge.register(token="tok-1")
        spec = RunSpec(messages=[{"role": "user", "content": "x"}], adapter="extra", node="n1")
        running = edge.service.submit(spec, Recorder().for_run)
        self.successResultOf(running)
        waiting = edge.service.submit(
            RunSpec(messages=[{"role": "user", "content": "y"}], adapter="extra", node="n1"), Recorder().for_run
        )
        self.assertNoResult(waiting)
        edge.service.reload(edge_config())
        pump.flush()
        (refresh,) = node.of("config_refresh")
        node.connection.send(messages.command_result(refresh.request_id, '{"applied": []}'))
        pump.flush()
        self.failureResultOf(waiting)

        def extra():
            return [p for p in edge.service.status()["nodes"][0]["providers"] if p["id"] == "extra"]

        self.assertEqual([p["in_use"]["normal"] for p in extra()], [1])
        (request,) = [r for r in node.of("run_request") if r.adapter == "extra"]
        node.connection.send(messages.run_event(run_id=request.run_id, seq=1, type="complete"))
        pump.flush()
        self.assertEqual(extra(), [])

    def test_pending_node_gets_the_reload_when_ready(self):
        """
        A node registered but not ready when the reload came (it got the
        old adapters with its registration) is pushed the new ones when it
        becomes ready.
        """

        def mutate(data):
            for node in data["nodes"]:
                node["adapters"][0].update(max_concurrency=7)

        self.edge.service.reload(self.changed(mutate))
        self.pending_pump.flush()
        self.assertEqual(self.pending.of("config_refresh"), [])
        self.pending.connection.send(messages.ready_request("n2"))
        self.pending_pump.flush()
        (refresh,) = self.pending.of("config_refresh")
        self.assertEqual(refresh.config.adapters[0].max_concurrency, 7)

    def test_refused_refresh_changes_nothing_and_is_tried_again(self):
        """
        A refresh the Node refused leaves its direct work as the Node runs
        it (an added adapter gets no capacity); should the Node register
        again, it is sent what it ran (not what it could not build: that
        would stop it), and the configuration is pushed again once it is
        ready; applied, the adapter is live.
        """

        def mutate(data):
            data["nodes"][0]["adapters"].append({"name": "extra", "type": "echo", "max_concurrency": 3})

        def extra():
            providers = self.edge.service.status()["nodes"][0]["providers"]
            return [p["capacity"]["normal"] for p in providers if p["id"] == "extra"]

        self.edge.service.reload(self.changed(mutate))
        self.pump.flush()
        (refresh,) = self.ready.of("config_refresh")
        self.ready.connection.send(messages.command_error(refresh.request_id, "refused", "no extra here"))
        self.pump.flush()
        self.assertIn(extra(), ([], [0]))
        self.ready.connection.transport.loseConnection()
        self.pump.flush()
        again, pump, _ = self.edge.register(token="tok-1", ready=False)
        self.assertEqual([a.name for a in again.of("register_response")[0].config.adapters], ["echo"])
        again.connection.send(messages.ready_request("n1"))
        pump.flush()
        (retry,) = again.of("config_refresh")
        self.assertEqual([a.name for a in retry.config.adapters], ["echo", "extra"])
        again.connection.send(messages.command_result(retry.request_id, '{"applied": ["extra"]}'))
        pump.flush()
        self.assertEqual(extra(), [3])
        self.assertEqual(self.edge.service.reload(self.changed(mutate)), [])

    def test_an_adapter_not_yet_applied_is_not_served(self):
        """
        An adapter a reload added, that the Node has not applied (here: it
        refused it), is not listed as a model and work sent to it is
        refused as unavailable (503), by name alone or with its node.
        """

        def mutate(data):
            data["nodes"][0]["adapters"].append({"name": "extra", "type": "echo", "max_concurrency": 3})

        self.edge.service.reload(self.changed(mutate))
        self.pump.flush()
        self.assertNotIn("extra", self.edge.service.models())
        (refresh,) = self.ready.of("config_refresh")
        self.ready.connection.send(messages.command_error(refresh.request_id, "refused", "no extra here"))
        self.pump.flush()
        self.assertNotIn("extra", self.edge.service.models())
        for spec in (RunSpec(messages=[], adapter="extra"), RunSpec(messages=[], adapter="extra", node="n1")):
            f = self.failureResultOf(self.edge.service.submit(spec, Recorder().for_run), ServiceError)
            self.assertEqual(f.value.kind, "unavailable")
        self.flushLoggedErrors()

    def test_sighup_again_retries_a_refused_refresh(self):
        """
        After a refused refresh, reloading the same configuration (the
        operator fixed the Node) pushes it again.
        """

        def mutate(data):
            data["nodes"][0]["adapters"][0].update(max_concurrency=7)

        self.refresh(messages.command_error("", "refused", "adapter echo: no such thing"))
        self.assertEqual(self.edge.service.reload(self.changed(mutate)), ["n1"])

    def test_taking_back_a_refused_refresh(self):
        """
        After a refused refresh, reloading the configuration the Node runs
        (the operator took the change back) pushes nothing, and the status
        no longer shows the old refusal: the node runs its configuration.
        """
        self.refresh(messages.command_error("", "refused", "adapter echo: no such thing"))
        self.assertEqual(self.edge.service.reload(edge_config()), [])
        self.assertEqual(self.edge.service.status()["nodes"][0]["config_refresh"], {"state": "applied"})
        self.flushLoggedErrors()

    def test_unchanged_pushes_nothing(self):
        """
        Reloading the same configuration sends nothing.
        """
        self.assertEqual(self.edge.service.reload(edge_config()), [])
        self.pump.flush()
        self.assertEqual(self.ready.of("config_refresh"), [])

    def test_restart_only_changes_refused(self):
        """
        A change to model groups, tokens or listeners is refused as a whole
        with the reason, and nothing is applied or pushed.
        """
        for mutate, fragment in [
            (lambda d: d["model_groups"][0].update(queue_timeout_sec=1), "model_groups"),
            (lambda d: d["nodes"][0].update(token="other"), "nodes[n1].token"),
            (lambda d: d["listen"].update(http="tcp:1"), "listen.http changed"),
            (lambda d: d.update(heartbeat={"interval_sec": 1, "timeout_sec": 4}), "heartbeat.interval_sec changed"),
            (
                lambda d: d["nodes"].append(dict(d["nodes"][1], id="n3", token="tok-3", providers=[])),
                "nodes were added",
            ),
        ]:

            def both(data, mutate=mutate):
                mutate(data)
                data["nodes"][0]["adapters"][0]["max_concurrency"] = 9

            error = self.assertRaises(ConfigError, self.edge.service.reload, self.changed(both))
            self.assertIn(fragment, str(error))
        self.pump.flush()
        self.assertEqual(self.ready.of("config_refresh"), [])
        self.assertEqual(self.edge.service.links.config_payload("n1").adapters[0].max_concurrency, 2)


class FollowingCapacityTests(SynchronousTestCase):
    """
    A provider configured without C{capacity.normal} takes what its
    adapter's C{max_concurrency} leaves, and follows it on a reload.
    """

    def config(self, max_concurrency, normal=None):
        data = copy.deepcopy(EDGE_YAML)
        node = data["nodes"][0]
        node["adapters"][0]["max_concurrency"] = max_concurrency
        node["providers"][0]["capacity"] = {"long": 1} if normal is None else {"normal": normal, "long": 1}
        return data

    def p1(self, edge):
        (provider,) = edge.service.status()["nodes"][0]["providers"]
        return provider["capacity"]

    def test_follows_max_concurrency_once_applied(self):
        """
        Raising the adapter's max_concurrency (2 to 5) is a reload, not a
        restart: once the Node applied it, the provider's normal capacity
        is what is left (4).
        """
        edge = EdgeHarness(self.config(2))
        node, pump, _ = edge.register(token="tok-1")
        self.assertEqual(self.p1(edge), {"normal": 1, "long": 1})
        self.assertEqual(edge.service.reload(edge_config(self.config(5))), ["n1"])
        pump.flush()
        self.assertEqual(self.p1(edge), {"normal": 1, "long": 1})  # (the Node's gate is still 2)
        (refresh,) = node.of("config_refresh")
        node.connection.send(messages.command_result(refresh.request_id, '{"applied": ["echo"]}'))
        pump.flush()
        self.assertEqual(self.p1(edge), {"normal": 4, "long": 1})

    def test_declared_capacity_still_needs_a_restart(self):
        """
        A provider's capacity the operator wrote is the provider's: changing
        it, or writing one where there was none, is refused.
        """
        edge = EdgeHarness(self.config(2))
        error = self.assertRaises(ConfigError, edge.service.reload, edge_config(self.config(2, normal=1)))
        self.assertIn("nodes[n1].providers changed", str(error))


class ReconcileTests(SynchronousTestCase):
    """
    Background runs a Node kept across a lost link (wire version 4), and
    what the Edge takes back when the Node reports them.
    """

    def setUp(self):
        self.edge = EdgeHarness()
        self.service = self.edge.service

    def come_back(self, *runs):
        """
        Node n1 registers, reports C{runs} (C{ReconciledRun}s) and is
        ready. @return: its node and pump.
        """
        node, pump, _ = self.edge.register(ready=False)
        node.connection.send(messages.run_reconcile(runs))
        node.connection.send(messages.ready_request(node_id="n1"))
        pump.flush()
        return node, pump

    def test_cancelled_before_the_loss(self):
        """
        A background run whose cancel the Node had not confirmed when its
        link was lost ends cancelled at once and waits for nothing; when
        the Node reports it still running it is cancelled there and takes
        no lease, and the Edge is idle.
        """
        node, pump, edge_protocol = self.edge.register()
        spec = RunSpec(messages=[{"role": "user", "content": "x"}], model="grp", background=True)
        run = self.successResultOf(self.service.submit(spec, Recorder().for_run))
        node.connection.send(messages.run_event(run_id=run, seq=1, type="start"))
        pump.flush()
        self.assertTrue(self.service.cancel(run))
        edge_protocol.transport.loseConnection()
        pump.flush()
        record = self.service.runs.get(run)
        assert record is not None
        self.assertEqual(record.status, "cancelled")
        self.assertEqual(self.service.inflight.detached_on("n1"), [])
        back, back_pump = self.come_back(messages.reconciled_run(run, "echo", "t1", "running", 1, ""))
        self.assertEqual([(m.run_id, m.error_code) for m in back.of("cancel_request")], [(run, "")])
        self.assertEqual(back.of("run_resume"), [])
        back.connection.send(messages.run_event(run_id=run, seq=2, type="cancelled"))
        back_pump.flush()
        self.assertEqual(self.service.pool.active_leases(), [])
        self.successResultOf(self.service.inflight.when_idle())

    def started_then_link_lost(self) -> str:
        """
        A background run that started on the Node, whose link then went.
        @return: its id.
        """
        node, pump, edge_protocol = self.edge.register()
        spec = RunSpec(messages=[{"role": "user", "content": "x"}], model="grp", background=True)
        run = self.successResultOf(self.service.submit(spec, Recorder().for_run))
        node.connection.send(messages.run_event(run_id=run, seq=1, type="start"))
        pump.flush()
        edge_protocol.transport.loseConnection()
        pump.flush()
        return run

    def test_not_back_in_time_ends_there_as_here(self):
        """
        A background run whose Node did not come back within
        reattach_timeout_sec ended here with node_disconnected; when the
        Node reports it later, it is cancelled there with that verdict
        (so its store reads back as the Edge said), where a run cancelled
        here is plainly cancelled (above).
        """
        run = self.started_then_link_lost()
        self.edge.advance(self.service.config.reattach_timeout_sec + 1)
        record = self.service.runs.get(run)
        assert record is not None and record.error is not None
        self.assertEqual((record.status, record.error["code"]), ("error", "node_disconnected"))
        back, _ = self.come_back(messages.reconciled_run(run, "echo", "t1", "running", 1, ""))
        (cancel,) = back.of("cancel_request")
        self.assertEqual((cancel.run_id, cancel.error_code), (run, "node_disconnected"))
        self.assertEqual(cancel.error_message, record.error["message"])

    def test_not_back_in_time_and_forgotten(self):
        """
        A background run the Edge ended while its Node was away is not
        taken back when the Node reports it after the run book forgot the
        run (C{run_log.max_age_sec} passed): it is cancelled there, with
        no lease, no RunResume and no new record.
        """
        run = self.started_then_link_lost()
        self.edge.advance(self.service.config.reattach_timeout_sec + self.service.config.run_log.max_age_sec + 1)
        self.assertIsNone(self.service.runs.get(run))
        back, _ = self.come_back(messages.reconciled_run(run, "echo", "t1", "running", 1, ""))
        self.assertEqual([m.run_id for m in back.of("cancel_request")], [run])
        self.assertEqual(back.of("run_resume"), [])
        self.assertEqual(self.service.pool.active_leases(), [])
        self.assertIsNone(self.service.runs.get(run))

    def test_adopted_run_listed_from_its_start(self):
        """
        A run this Edge never heard of (it restarted) is on record from
        when the Node took it, not from when it came back.
        """
        self.edge.advance(5000)
        self.come_back(messages.reconciled_run("run-x", "echo", "t1", "running", 3, "alice", 1000.0))
        record = self.service.runs.get("run-x")
        assert record is not None
        self.assertEqual((record.created_at, record.caller), (1000.0, "alice"))

    def test_run_reported_twice(self):
        """
        A run named twice in one C{RunReconcile} is taken back once: one
        lease and one C{RunResume}, no cancel; its terminal returns the
        lease.
        """
        run = messages.reconciled_run("run-x", "echo", "t1", "running", 3, "")
        node, pump = self.come_back(run, run)
        sent = [kind for kind, _ in node.received if kind in ("run_resume", "cancel_request")]
        self.assertEqual(sent, ["run_resume"])
        self.assertEqual(len(self.service.pool.active_leases()), 1)
        node.connection.send(messages.run_event(run_id="run-x", seq=4, type="complete"))
        pump.flush()
        self.assertEqual(self.service.pool.active_leases(), [])
        self.assertEqual(len(self.service.inflight), 0)
