"""
Failover and provider health on the in-memory Edge: work whose provider
fails before answering is placed on another provider of its group (once by
default); after that nothing is retried; a provider that keeps failing is
ejected for a cooldown, and comes back on its first answer.
"""

import copy
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from iop.edge.spec import RunSpec, TunnelSpec
from iop.protocols import messages
from iop.testing.edge import EDGE_YAML, EdgeHarness, Recorder
from iop.testing.tunnels import TunnelRecorder


def config(retries=None, tunnel=False):
    data: dict[str, Any] = copy.deepcopy(EDGE_YAML)
    if tunnel:
        for node in data["nodes"]:
            node["adapters"] = [
                {"name": "echo", "type": "openai_compat", "max_concurrency": 2, "base_url": "http://p.invalid"}
            ]
    if retries is not None:
        data["model_groups"][0]["retries"] = retries
    return data


class FailoverTests(SynchronousTestCase):
    def start(self, retries=None, tunnel=False):
        self.edge = EdgeHarness(config(retries, tunnel))
        self.service = self.edge.service
        self.n1, self.pump1, _ = self.edge.register(token="tok-1")
        self.n2, self.pump2, _ = self.edge.register(token="tok-2")
        self.nodes = {"n1": (self.n1, self.pump1), "n2": (self.n2, self.pump2)}
        self.seen = {}

    def submit_run(self, **kwargs):
        recorder = Recorder()
        spec = RunSpec(messages=[{"role": "user", "content": "x"}], model="grp", **kwargs)
        self.successResultOf(self.service.submit(spec, recorder.for_run))
        self.edge.flush()
        return recorder

    def last_request(self, kind="run_request"):
        """
        The node that got a request of C{kind} since the last call, and
        that request.
        """
        for node_id, (node, _) in self.nodes.items():
            requests = node.of(kind)
            if len(requests) > self.seen.get((node_id, kind), 0):
                self.seen[(node_id, kind)] = len(requests)
                return node_id, requests[-1]
        raise AssertionError(f"no new {kind}")

    def answer(self, node_id, run_id, *events, error=None):
        node, pump = self.nodes[node_id]
        for seq, kind in enumerate(events, 1):
            message = messages.run_event(run_id=run_id, seq=seq, type=kind)
            if kind == "error" and error is not None:
                message.error.CopyFrom(error)
            node.connection.send(message)
        pump.flush()
        self.edge.flush()

    def provider(self, node_id):
        (provider,) = [p for n in self.service.status()["nodes"] if n["id"] == node_id for p in n["providers"]]
        return provider

    def test_unreachable_provider_fails_over(self):
        """
        A run whose provider cannot be reached is placed on the other
        provider of its group; the caller sees only the second attempt, and
        the first provider's failure is recorded.
        """
        self.start()
        recorder = self.submit_run()
        first_node, first = self.last_request()
        self.answer(
            first_node, first.run_id, "error", error=messages.run_error(code="provider_unreachable", message="refused")
        )
        other, second = self.last_request()
        self.assertNotEqual(other, first_node)
        self.assertEqual(second.run_id, first.run_id + "-2")
        self.answer(other, second.run_id, "start", "complete")
        self.assertEqual(recorder.types(), ["start", "complete"])
        self.assertEqual(self.provider(first_node)["last_error"], "provider_unreachable: refused")
        self.assertEqual(self.service.pool.active_leases(), [])

    def test_tunnel_5xx_before_body_fails_over(self):
        """
        A tunnel whose provider answers 503 before its body is abandoned on
        its node (cancelled) and placed on the other provider; the caller
        gets the second provider's answer only.
        """
        self.start(tunnel=True)
        listener = TunnelRecorder()
        spec = RunSpec(
            messages=[], model="grp", tunnel=TunnelSpec("POST", "/chat/completions", [], {"model": "grp"}), runs=False
        )
        self.successResultOf(self.service.submit(spec, listener.for_work))
        self.edge.flush()
        first_node, first = self.last_request("provider_tunnel_request")
        node, pump = self.nodes[first_node]
        node.connection.send(messages.tunnel_frame(first.tunnel_id, 1, status=503))
        # (A failure status is decided on at the frame after its headers.)
        node.connection.send(messages.tunnel_frame(first.tunnel_id, 2, body=b"down"))
        self.edge.flush()
        self.assertEqual([c.run_id for c in node.of("cancel_request")], [first.tunnel_id])
        other, second = self.last_request("provider_tunnel_request")
        self.assertNotEqual(other, first_node)
        other_node, other_pump = self.nodes[other]
        for frame in (dict(status=200), dict(body=b"ok"), dict(end=True)):
            other_node.connection.send(messages.tunnel_frame(second.tunnel_id, 0, **frame))
        other_pump.flush()
        self.assertEqual(listener.calls, [("status", 200), ("body", b"ok"), ("end",)])
        # A late frame of the abandoned attempt reaches nobody.
        node.connection.send(messages.tunnel_frame(first.tunnel_id, 3, body=b"stale"))
        pump.flush()
        self.assertEqual(len(listener.calls), 3)

    def test_failure_after_first_byte_not_retried(self):
        """
        Once the caller saw output, a failure is the caller's answer: no
        second attempt.
        """
        self.start()
        recorder = self.submit_run()
        node_id, request = self.last_request()
        error = messages.run_error(code="provider_error", message="lost", status=502)
        self.answer(node_id, request.run_id, "start", "error", error=error)
        self.assertEqual(recorder.types(), ["start", "error"])
        self.assertRaises(AssertionError, self.last_request)

    def test_retries_bound(self):
        """
        With the default of one retry, a second provider failure reaches the
        caller; with C{retries: 0} the first one does.
        """
        self.start()
        recorder = self.submit_run()
        error = messages.run_error(code="provider_error", message="down", status=500)
        node_id, request = self.last_request()
        self.answer(node_id, request.run_id, "error", error=error)
        node_id, request = self.last_request()
        self.answer(node_id, request.run_id, "error", error=error)
        self.assertEqual(recorder.types(), ["error"])
        self.assertEqual(recorder.events[0].error.status, 500)
        self.start(retries=0)
        recorder = self.submit_run()
        node_id, request = self.last_request()
        self.answer(node_id, request.run_id, "error", error=error)
        self.assertEqual(recorder.types(), ["error"])

    def test_client_error_not_retried(self):
        """
        A 4xx from the provider (other than 429) is the caller's answer.
        """
        self.start()
        recorder = self.submit_run()
        node_id, request = self.last_request()
        self.answer(
            node_id, request.run_id, "error", error=messages.run_error(code="provider_error", message="bad", status=400)
        )
        self.assertEqual(recorder.types(), ["error"])

    def test_ejected_after_failures_then_back(self):
        """
        Three consecutive failures eject a provider for its cooldown: the
        status shows it with its last error, work goes to the other one;
        after the cooldown it is tried again and its first answer makes it
        healthy.
        """
        self.start(retries=0)
        error = messages.run_error(code="provider_unreachable", message="refused")
        for _ in range(3):
            self.submit_run(node="n1")
            node_id, request = self.last_request()
            self.assertEqual(node_id, "n1")
            self.answer("n1", request.run_id, "error", error=error)
        provider = self.provider("n1")
        self.assertEqual((provider["health"], provider["last_error"]), ("ejected", "provider_unreachable: refused"))
        self.submit_run()
        self.assertEqual(self.last_request()[0], "n2")
        self.edge.advance(30)
        self.assertEqual(self.provider("n1")["health"], "ok")
        self.submit_run(node="n1")
        node_id, request = self.last_request()
        self.answer("n1", request.run_id, "start", "complete")
        self.assertNotIn("last_error", self.provider("n1"))

    def test_cancel_crossing_an_early_failure(self):
        """
        A provider failure before output that crossed the run's cancel
        (the Node failed it before it saw the cancel) is not placed again:
        the run ends cancelled, its lease returned once, and the cancel's
        grace ends nothing more.
        """
        self.start()
        recorder = self.submit_run()
        node_id, request = self.last_request()
        dispatch = self.service.inflight.get(request.run_id)
        assert dispatch is not None and dispatch.placement.lease is not None
        self.assertTrue(self.service.cancel(recorder.work_id))
        error = messages.run_error(code="provider_unreachable", message="refused")
        self.answer(node_id, request.run_id, "error", error=error)
        self.assertRaises(AssertionError, self.last_request)
        self.assertEqual(recorder.types(), ["cancelled"])
        self.assertEqual(self.service.pool.active_leases(), [])
        self.assertFalse(dispatch.placement.lease.release())
        self.edge.clock.advance(self.edge.config.run_grace_sec)
        self.assertEqual(recorder.types(), ["cancelled"])
        # (The provider's failure still counts against its health.)
        self.assertEqual(self.provider(node_id)["last_error"], "provider_unreachable: refused")

    def test_tunnel_cancel_crossing_a_failure_status(self):
        """
        A tunnel whose provider answered 503 before the Node saw its cancel
        ends cancelled, not placed again.
        """
        self.start(tunnel=True)
        listener = TunnelRecorder()
        spec = RunSpec(
            messages=[], model="grp", tunnel=TunnelSpec("POST", "/chat/completions", [], {"model": "grp"}), runs=False
        )
        work_id = self.successResultOf(self.service.submit(spec, listener.for_work))
        self.edge.flush()
        node_id, first = self.last_request("provider_tunnel_request")
        self.assertTrue(self.service.cancel(work_id))
        node, pump = self.nodes[node_id]
        node.connection.send(messages.tunnel_frame(first.tunnel_id, 1, status=503))
        node.connection.send(messages.tunnel_frame(first.tunnel_id, 2, body=b"down"))
        self.edge.flush()
        self.assertRaises(AssertionError, self.last_request, "provider_tunnel_request")
        self.assertEqual([c[0] for c in listener.calls], ["error"])
        self.assertEqual(listener.calls[0][1].code, "cancelled")
        self.assertEqual(self.service.pool.active_leases(), [])

    def test_reconciled_retry_the_edge_cancelled(self):
        """
        A background run placed again after a failure goes on the wire as
        C{<id>-2}; cancelled while its Node was away, it is recognised by
        that id when the Node reports it running: cancelled there, with no
        lease, no RunResume and no new record.
        """
        self.start()
        recorder = self.submit_run(background=True)
        first_node, first = self.last_request()
        error = messages.run_error(code="provider_unreachable", message="refused")
        self.answer(first_node, first.run_id, "error", error=error)
        node_id, second = self.last_request()
        self.assertEqual(second.run_id, f"{recorder.work_id}-2")
        self.answer(node_id, second.run_id, "start")
        node, pump = self.nodes[node_id]
        node.transport.loseConnection()
        pump.flush()
        self.assertTrue(self.service.cancel(recorder.work_id))
        back, back_pump, _ = self.edge.register(token={"n1": "tok-1", "n2": "tok-2"}[node_id], ready=False)
        back.connection.send(
            messages.run_reconcile([messages.reconciled_run(second.run_id, "echo", "", "running", 1, "")])
        )
        back.connection.send(messages.ready_request(node_id))
        back_pump.flush()
        self.assertEqual([m.run_id for m in back.of("cancel_request")], [second.run_id])
        self.assertEqual(back.of("run_resume"), [])
        self.assertEqual(self.service.pool.active_leases(), [])
        self.assertIsNone(self.service.runs.get(second.run_id))
        record = self.service.runs.get(recorder.work_id)
        assert record is not None
        self.assertEqual(record.status, "cancelled")


class CancelWhilePlacedAgainTests(SynchronousTestCase):
    """
    A run cancelled while it waits to be placed again (out of any Node's
    hands) ends with a terminal its caller's listener hears too.
    """

    def test_cancel_during_retry_after(self):
        """
        A run whose only provider answered 503 with a Retry-After waits it
        out before it is placed again; cancelled meanwhile (by an API call,
        while its caller still streams), its listener gets the
        C{cancelled} terminal the run book logs, and it is not placed again.
        """
        edge = EdgeHarness(config())
        node, pump, _ = edge.register(token="tok-1")
        recorder = Recorder()
        spec = RunSpec(messages=[{"role": "user", "content": "x"}], model="grp")
        work_id = self.successResultOf(edge.service.submit(spec, recorder.for_run))
        edge.flush()
        (request,) = node.of("run_request")
        failed = messages.run_event(run_id=request.run_id, seq=1, type="error")
        failed.error.CopyFrom(messages.run_error("provider_error", "busy", status=503, retry_after_sec=2))
        node.connection.send(failed)
        pump.flush()
        self.assertEqual(recorder.types(), [])
        self.assertTrue(edge.service.cancel(work_id))
        self.assertEqual(recorder.types(), ["cancelled"])
        edge.advance(3)
        self.assertEqual(len(node.of("run_request")), 1)
        record = edge.service.runs.get(work_id)
        assert record is not None
        self.assertEqual(record.status, "cancelled")
        self.assertEqual(edge.service.pool.active_leases(), [])

    def test_tunnel_cancel_during_retry_after(self):
        """
        The same for a tunnel: its listener gets a C{cancelled} error.
        """
        edge = EdgeHarness(config(tunnel=True))
        node, pump, _ = edge.register(token="tok-1")
        listener = TunnelRecorder()
        spec = RunSpec(
            messages=[], model="grp", tunnel=TunnelSpec("POST", "/chat/completions", [], {"model": "grp"}), runs=False
        )
        work_id = self.successResultOf(edge.service.submit(spec, listener.for_work))
        edge.flush()
        (request,) = node.of("provider_tunnel_request")
        error = messages.run_error("provider_error", "busy", status=503, retry_after_sec=2)
        node.connection.send(messages.tunnel_frame(request.tunnel_id, 1, error=error))
        pump.flush()
        self.assertEqual(listener.calls, [])
        self.assertTrue(edge.service.cancel(work_id))
        self.assertEqual([(c[0], c[1].code) for c in listener.calls], [("error", "cancelled")])
        edge.advance(3)
        self.assertEqual(len(node.of("provider_tunnel_request")), 1)
        record = edge.service.runs.get(work_id)
        assert record is not None
        self.assertEqual(record.status, "cancelled")
