"""
Backpressure end to end, in memory (issue 12, finding 9): a caller that
stops reading a large tunnel makes the Edge stop granting credit, so the
Node sends at most one window more and pauses the provider; the Edge holds
about one window, not the response. Another stream on the same Node link
goes on meanwhile. When the caller reads again, everything arrives.
"""

import json

from twisted.trial.unittest import SynchronousTestCase

from iop.edge.flow import STALL_TIMEOUT_SEC
from iop.protocols.wire import STREAM_WINDOW_BYTES
from iop.testing.gateway import Gateway
from iop.testing.producers import RecordingProducer

PIECE = 64 * 1024


class BackpressureTests(SynchronousTestCase):
    def setUp(self):
        self.gateway = Gateway()
        self.node = self.gateway.node()

    def test_slow_caller_on_a_large_tunnel(self):
        """
        With the caller's connection paused, 2.5 MiB pushed by the provider
        reach the Edge only up to about one window; the rest waits on the
        Node with the provider paused; a run on the same link completes
        meanwhile; resumed, the caller gets every byte and the lease is
        back.
        """
        d = self.gateway.post(
            "/v1/chat/completions", {"model": "big", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
        )
        (_, sink, done), *_ = self.node.adapter("llm").tunnels
        provider = RecordingProducer()
        sink.register_producer(provider)
        sink.status(200)
        sink.headers([("content-type", "text/event-stream")])
        self.gateway.flush()
        (dispatch,) = self.gateway.service.inflight.all()
        channel = dispatch.listener.request.channel
        channel.pauseProducing()  # the caller's socket buffer is full

        total = 40 * PIECE
        for i in range(40):
            sink.body(bytes([65 + i % 26]) * PIECE)
        self.gateway.flush()
        relay = next(iter(self.node.session.inflight._work.values()))
        waiting = sum(size for _, size in relay.flow.queue)  # (a body frame spends its length)
        sent = total - waiting
        self.assertLessEqual(sent, STREAM_WINDOW_BYTES + PIECE)
        self.assertGreater(waiting, total - 2 * STREAM_WINDOW_BYTES)
        self.assertEqual(provider.calls, ["pause"])

        run = self.gateway.post("/v1/runs", {"model": "talk", "input": "still moving", "stream": False})
        self.gateway.advance(1)
        code, _, body = self.successResultOf(self.gateway.read(run))
        self.assertEqual((code, json.loads(body)["text"]), (200, "still moving"))

        channel.resumeProducing()
        self.gateway.flush()
        done.callback(None)
        self.gateway.flush()
        code, _, body = self.successResultOf(self.gateway.read(d))
        self.assertEqual((code, len(body)), (200, total))
        self.assertEqual(provider.calls, ["pause", "resume"])
        self.assertEqual(self.gateway.service.pool.active_leases(), [])
        self.assertEqual(len(self.node.session.inflight), 0)

    def test_caller_that_takes_nothing(self):
        """
        A caller whose connection stays paused for the stall timeout is cut
        off: its tunnel is cancelled on the Node and the lease comes back.
        """
        d = self.gateway.post(
            "/v1/chat/completions", {"model": "big", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
        )
        (_, sink, done), *_ = self.node.adapter("llm").tunnels
        sink.status(200)
        sink.headers([("content-type", "text/event-stream")])
        sink.body(b"data: " + b"x" * PIECE + b"\n\n")
        self.gateway.flush()
        (dispatch,) = self.gateway.service.inflight.all()
        dispatch.listener.request.channel.pauseProducing()
        self.gateway.advance(STALL_TIMEOUT_SEC - 1, step=1)
        self.assertEqual(len(self.gateway.service.inflight), 1)
        self.gateway.advance(2, step=1)
        self.failureResultOf(self.successResultOf(d).content())
        self.assertEqual(self.node.adapter("llm").cancelled, [dispatch.id])
        self.assertEqual(self.gateway.service.pool.active_leases(), [])
