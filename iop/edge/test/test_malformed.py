"""
Malformed messages from a ready Node (issue 12, finding 7): each is a
protocol violation of the one piece of work it names, which ends with
C{protocol_error} (its lease back, the Node asked to cancel it); the
connection and the other work on it go on. A listener that raises ends
only its own work.
"""

import copy

from twisted.trial.unittest import SynchronousTestCase

from iop.edge.errors import ServiceError
from iop.edge.spec import RunSpec, TunnelSpec
from iop.protocols import messages
from iop.testing.edge import EDGE_YAML, EdgeHarness, Recorder
from iop.testing.tunnels import TunnelRecorder

YAML: dict = copy.deepcopy(EDGE_YAML)
# Room for two runs at once on n1's echo provider (direct work leases too).
YAML["nodes"][0]["providers"][0]["capacity"]["normal"] = 2
YAML["nodes"][0]["adapters"].append(
    {"name": "llm", "type": "openai_compat", "max_concurrency": 2, "base_url": "http://x.invalid/v1"}
)
YAML["nodes"][0]["providers"].append({"id": "llm", "adapter": "llm", "capacity": {"normal": 2, "long": 0}})
YAML["model_groups"].append({"name": "big", "providers": [{"node": "n1", "provider": "llm"}]})


class MalformedTests(SynchronousTestCase):
    def setUp(self):
        self.edge = EdgeHarness(YAML)
        self.node, self.pump, self.edge_protocol = self.edge.register()
        self.service = self.edge.service

    def start_run(self, **kwargs):
        recorder = Recorder()
        spec = RunSpec(messages=[{"role": "user", "content": "hi"}], **kwargs)
        self.successResultOf(self.service.submit(spec, recorder.for_run))
        self.pump.flush()
        return recorder

    def tunnel(self):
        recorder = TunnelRecorder()
        spec = RunSpec(
            messages=[{"role": "user", "content": "hi"}],
            model="big",
            tunnel=TunnelSpec("POST", "/chat/completions", [], {"model": "big"}),
        )
        self.successResultOf(self.service.submit(spec, recorder.for_work))
        self.pump.flush()
        return recorder

    def send(self, *messages):
        for message in messages:
            self.node.connection.send(message)
        self.pump.flush()

    def cancels(self):
        return [m.run_id for m in self.node.of("cancel_request")]

    def assert_connection_alive(self):
        self.assertFalse(self.node.lost)
        self.assertIsNone(self.edge_protocol.close_reason)
        self.assertIsNotNone(self.service.registry.ready_link("n1"))

    def test_unknown_event_type(self):
        """
        A run event of an unknown type ends that run with
        C{protocol_error} and returns its lease; the Node is asked to
        cancel it; another run on the same connection completes.
        """
        bad = self.start_run(model="grp")
        good = self.start_run(adapter="echo", node="n1")
        self.send(messages.run_event(run_id=bad.work_id, seq=1, type="bogus"))
        self.assertEqual(bad.types(), ["error"])
        self.assertEqual(bad.events[0].error.code, "protocol_error")
        self.assertIn(bad.work_id, self.cancels())
        self.assertEqual([lease.group for lease in self.service.pool.active_leases()], ["n1/echo"])
        self.assert_connection_alive()
        self.send(messages.run_event(run_id=good.work_id, seq=1, type="complete"))
        self.assertEqual(good.types(), ["complete"])
        self.assertEqual(self.service.pool.active_leases(), [])

    def test_terminal_without_reason(self):
        """
        An C{error} or C{cancelled} terminal without its error gets a
        generic one: the caller gets a proper ending, nothing raises.
        """
        errored, cancelled = self.start_run(model="grp"), self.start_run(adapter="echo", node="n1")
        self.send(
            messages.run_event(run_id=errored.work_id, seq=1, type="error"),
            messages.run_event(run_id=cancelled.work_id, seq=1, type="cancelled"),
        )
        self.assertEqual(errored.events[0].error.code, "adapter_error")
        self.assertEqual(cancelled.events[0].error.code, "cancelled")
        self.assertEqual(self.service.pool.active_leases(), [])
        self.assert_connection_alive()

    def test_bad_tunnel_frames(self):
        """
        A tunnel status that is no HTTP status, a header that is no header
        and an empty frame each end their tunnel with C{protocol_error}.
        """
        frames = [
            messages.tunnel_frame("", 0, status=42),
            messages.tunnel_frame("", 0, status=99999),
            messages.tunnel_frame("", 0, headers=[("a b", "x")]),
            messages.tunnel_frame("", 0, headers=[("x-a", "1\r\nset-cookie: y")]),
            messages.tunnel_frame("", 0),
        ]
        for frame in frames:
            recorder = self.tunnel()
            frame.tunnel_id = recorder.work_id
            self.send(frame)
            self.assertEqual([c[0] for c in recorder.calls], ["error"], frame)
            self.assertEqual(recorder.calls[0][1].code, "protocol_error")
            self.assertIn(recorder.work_id, self.cancels())
            self.assertEqual(self.service.pool.active_leases(), [])
        self.assert_connection_alive()

    def test_second_tunnel_status(self):
        """
        A tunnel has one status: another one, mid-body (where the caller's
        answer would turn into a failure answer glued to the body it has)
        or before it, ends the tunnel with C{protocol_error} and its lease
        back, and it is on record as failed, not complete.
        """
        for before_body in (False, True):
            recorder = self.tunnel()
            tunnel_id = recorder.work_id
            self.send(
                messages.tunnel_frame(tunnel_id, 1, status=200),
                messages.tunnel_frame(tunnel_id, 2, headers=[("content-type", "application/json")]),
            )
            if not before_body:
                self.send(messages.tunnel_frame(tunnel_id, 3, body=b'{"id": "x", '))
            self.send(
                messages.tunnel_frame(tunnel_id, 4, status=500),
                messages.tunnel_frame(tunnel_id, 5, body=b'"choices": []}'),
                messages.tunnel_frame(tunnel_id, 6, end=True),
            )
            kinds = [c[0] for c in recorder.calls]
            self.assertEqual(kinds, ["error"] if before_body else ["status", "headers", "body", "error"])
            self.assertEqual(recorder.calls[-1][1].code, "protocol_error")
            self.assertIn(tunnel_id, self.cancels())
            self.assertEqual(self.service.pool.active_leases(), [])
            record = self.service.runs.get(tunnel_id)
            assert record is not None and record.error is not None
            self.assertEqual((record.status, record.error["code"]), ("error", "protocol_error"))
        self.assert_connection_alive()

    def test_bad_metadata_ignored(self):
        """
        Metadata that is not JSON is an observation lost, not a failure:
        the tunnel goes on.
        """
        recorder = self.tunnel()
        self.send(
            messages.tunnel_frame(recorder.work_id, 0, status=200),
            messages.tunnel_frame(recorder.work_id, 0, metadata_json="{nope"),
            messages.tunnel_frame(recorder.work_id, 0, end=True),
        )
        self.assertEqual([c[0] for c in recorder.calls], ["status", "end"])
        self.assert_connection_alive()

    def test_failure_observation_without_an_http_status_ignored(self):
        """
        A failure observation after a held 503 whose status is no HTTP
        status (infinite, below 100, above 599) is ignored like metadata
        that is not JSON: the 503 stands (the tunnel is placed again) and
        the connection goes on.
        """
        for status in ("Infinity", "-Infinity", "42", "600"):
            recorder = self.tunnel()
            failure = '{"failure": {"code": "provider_error", "message": "busy", "status": ' + status + "}}"
            self.send(
                messages.tunnel_frame(recorder.work_id, 1, status=503),
                messages.tunnel_frame(recorder.work_id, 2, metadata_json=failure),
            )
            self.assert_connection_alive()
            again = self.node.of("provider_tunnel_request")[-1].tunnel_id
            self.assertEqual(again, f"{recorder.work_id}-2", status)
            self.send(
                messages.tunnel_frame(again, 1, status=200),
                messages.tunnel_frame(again, 2, end=True),
            )
            self.assertEqual(recorder.calls, [("status", 200), ("end",)], status)
            self.assertEqual(self.service.pool.active_leases(), [])

    def test_listener_failure_ends_only_its_work(self):
        """
        A listener that raises (a bug) is logged as an error; its work ends
        with its lease back and a cancel to the Node, and the connection
        stays.
        """
        recorder = self.start_run(model="grp")

        def broken(event):
            raise ZeroDivisionError("bug")

        recorder.event = broken
        self.send(messages.run_event(run_id=recorder.work_id, seq=1, type="start"))
        self.assertEqual(len(self.flushLoggedErrors(ZeroDivisionError)), 1)
        self.assertNotIn(recorder.work_id, self.service.inflight)
        self.assertIn(recorder.work_id, self.cancels())
        self.assertEqual(self.service.pool.active_leases(), [])
        self.assert_connection_alive()

    def test_command_result_not_json(self):
        """
        A command answer whose result is not JSON is a 502
        C{protocol_error} for that command, not an internal error.
        """
        d = self.service.command("n1", "capabilities")
        self.pump.flush()
        request_id = self.node.of("node_command_request")[0].request_id
        self.send(messages.command_result(request_id, "{nope"))
        f = self.failureResultOf(d, ServiceError)
        self.assertEqual((f.value.kind, f.value.code), ("failed", "protocol_error"))
        self.assert_connection_alive()
