"""
The whole path in memory (L{iop.testing.gateway}): callers over HTTP, the
real Edge service, the wire, real Node sessions and adapters, on one
clock. Each test follows one piece of work from the caller to the adapter
and back, and checks that every lease is back at rest.
"""

import json

from twisted.trial.unittest import SynchronousTestCase

from iop.run import DELTA, START, RunEventData
from iop.testing.gateway import Gateway

TEXT = "one two three four"


def sse_payloads(body):
    return [line[6:] for line in body.decode().split("\n") if line.startswith("data: ")]


class GatewayTests(SynchronousTestCase):
    def setUp(self):
        self.gateway = Gateway()
        self.node = self.gateway.node()

    def in_use(self):
        return {
            (p["node"], p["id"]): p["in_use"]["normal"] for p in self.gateway.service.status()["nodes"][0]["providers"]
        }

    def result(self, d):
        return self.successResultOf(self.gateway.read(d))

    def test_node_ready_through_the_real_session(self):
        """
        A real Node session registers and becomes ready: the Edge shows it
        connected with its providers available.
        """
        status = self.gateway.service.status()["nodes"][0]
        self.assertTrue(status["connected"])
        self.assertEqual({p["status"] for p in status["providers"]}, {"available"})

    def test_streamed_run(self):
        """
        A streamed chat completion on an echo provider: the lease is held
        while it runs, the chunks join to the input, then C{[DONE]}, and
        the lease is back.
        """
        d = self.gateway.post(
            "/v1/chat/completions",
            {"model": "talk", "stream": True, "messages": [{"role": "user", "content": TEXT}]},
        )
        self.assertEqual(self.in_use()[("n1", "echo")], 1)
        self.gateway.advance(1)
        code, _, body = self.result(d)
        self.assertEqual(code, 200)
        payloads = sse_payloads(body)
        self.assertEqual(payloads[-1], "[DONE]")
        chunks = [json.loads(p) for p in payloads[:-1]]
        self.assertEqual("".join(c["choices"][0]["delta"].get("content", "") for c in chunks), TEXT)
        self.assertEqual(self.in_use()[("n1", "echo")], 0)
        self.assertEqual(self.node.store.unfinished(), [])

    def test_tunnel(self):
        """
        A model group on an OpenAI-compatible provider is carried as a raw
        tunnel: the provider sees the caller's body with C{model} rewritten
        to its target, and the caller gets the provider's bytes unchanged.
        """
        d = self.gateway.post("/v1/chat/completions", {"model": "big", "messages": [{"role": "user", "content": "hi"}]})
        (request, sink, done), *_ = self.node.adapter("llm").tunnels
        self.assertEqual(json.loads(request.body)["model"], "big-v2")
        self.assertEqual(self.in_use()[("n1", "llm")], 1)
        sink.status(201)
        sink.headers([("content-type", "application/json"), ("x-provider", "p")])
        sink.body(b'{"id": "x", ')
        sink.body(b'"choices": []}')
        done.callback(None)
        self.gateway.flush()
        code, headers, body = self.result(d)
        self.assertEqual((code, body), (201, b'{"id": "x", "choices": []}'))
        self.assertEqual(headers.getRawHeaders(b"x-provider"), [b"p"])
        self.assertEqual(self.in_use()[("n1", "llm")], 0)

    def test_tunnel_stream_cut(self):
        """
        A tunnelled event stream whose Node is lost after its first event
        ends the way the surface ends its own streams: the provider's bytes
        as they came, then an error event naming C{node_disconnected} and
        C{[DONE]}; the lease is back.
        """
        d = self.gateway.post(
            "/v1/chat/completions",
            {"model": "big", "stream": True, "messages": [{"role": "user", "content": "hi"}]},
        )
        (_, sink, _), *_ = self.node.adapter("llm").tunnels
        sink.status(200)
        sink.headers([("content-type", "text/event-stream")])
        sink.body(b'data: {"n": 1}\n\n')
        self.gateway.flush()
        self.node.session.close()
        self.gateway.flush()
        code, _, body = self.result(d)
        self.assertEqual(code, 200)
        self.assertTrue(body.startswith(b'data: {"n": 1}\n\n'))
        payloads = sse_payloads(body)
        self.assertEqual(payloads[-1], "[DONE]")
        error = json.loads(payloads[-2])["error"]
        self.assertEqual((error["type"], error["code"]), ("api_error", "node_disconnected"))
        self.assertEqual(self.in_use()[("n1", "llm")], 0)

    def test_tunnel_by_adapter_name(self):
        """
        An OpenAI-compatible adapter reached by its name (one node ready)
        is a tunnel too, holds a lease on the adapter's resource, and
        forwards the caller's C{model} unchanged (no target to rewrite to).
        """
        d = self.gateway.post("/v1/chat/completions", {"model": "llm", "messages": [{"role": "user", "content": "hi"}]})
        (request, sink, done), *_ = self.node.adapter("llm").tunnels
        self.assertEqual(json.loads(request.body)["model"], "llm")
        self.assertEqual(self.in_use()[("n1", "llm")], 1)
        sink.status(200)
        sink.headers([("content-type", "application/json")])
        sink.body(b"{}")
        done.callback(None)
        self.gateway.flush()
        self.assertEqual(self.result(d)[0], 200)
        self.assertEqual(self.in_use()[("n1", "llm")], 0)

    def test_cancel(self):
        """
        Cancelling a native run cancels the adapter's work on the Node; the
        stream ends C{cancelled} and the lease is back.
        """
        d = self.gateway.post("/v1/runs", {"model": "big", "input": "hi", "stream": True})
        (run, emit, _), *_ = self.node.adapter("llm").runs
        self.assertIn(run.run_id, self.gateway.service.inflight)
        cancel = self.gateway.post(f"/v1/runs/{run.run_id}/cancel", {})
        self.assertEqual(self.result(cancel)[0], 200)
        self.assertEqual(self.node.adapter("llm").cancelled, [run.run_id])
        code, _, body = self.result(d)
        events = [json.loads(p) for p in sse_payloads(body)]
        self.assertEqual([e["type"] for e in events], ["cancelled"])
        self.assertEqual(self.in_use()[("n1", "llm")], 0)

    def test_node_loss(self):
        """
        A Node whose connection drops mid-stream: the caller's stream ends
        with an error naming C{node_disconnected}, the node shows
        disconnected with its providers offline and nothing in use.
        """
        d = self.gateway.post("/v1/runs", {"model": "big", "input": "hi", "stream": True})
        (run, emit, _), *_ = self.node.adapter("llm").runs
        emit(RunEventData(START))
        emit(RunEventData(DELTA, text="partial"))
        self.gateway.flush()
        self.node.session.close()
        self.gateway.flush()
        code, _, body = self.result(d)
        events = [json.loads(p) for p in sse_payloads(body)]
        self.assertEqual([e["type"] for e in events], ["start", "delta", "error"])
        self.assertEqual(events[-1]["error"]["code"], "node_disconnected")
        status = self.gateway.service.status()["nodes"][0]
        self.assertFalse(status["connected"])
        self.assertEqual(self.in_use()[("n1", "llm")], 0)

    def test_drain(self):
        """
        Stopping the Edge with a run in flight: the Node is told the Edge is
        draining, the run finishes within the grace and reaches its caller
        whole, then the stop completes and the Node's link is closed.
        """
        d = self.gateway.post(
            "/v1/chat/completions",
            {"model": "talk", "stream": True, "messages": [{"role": "user", "content": TEXT}]},
        )
        stopped = self.gateway.service.stopService()
        self.gateway.flush()
        self.assertTrue(self.node.session.edge_draining)
        self.assertNoResult(stopped)
        self.gateway.advance(1)
        self.successResultOf(stopped)
        code, _, body = self.result(d)
        payloads = sse_payloads(body)
        self.assertEqual(payloads[-1], "[DONE]")
        chunks = [json.loads(p) for p in payloads[:-1]]
        self.assertEqual("".join(c["choices"][0]["delta"].get("content", "") for c in chunks), TEXT)
        self.assertEqual(self.node.session.state, "closed")
        self.assertEqual(self.in_use()[("n1", "echo")], 0)
