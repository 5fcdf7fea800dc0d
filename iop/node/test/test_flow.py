"""
The Node's side of per-stream flow control (wire version 3): frames wait
for credit in order, the adapter's producer is paused meanwhile, a
C{WindowUpdate} lets them go, the terminal waits behind them, and a
cancel drops what is no longer wanted.
"""

from twisted.trial.unittest import SynchronousTestCase

from iop.node.flow import SendWindow
from iop.protocols import messages
from iop.run import DELTA, RunEventData
from iop.testing.node import manual, ready_node, run_request, tunnel_request
from iop.testing.producers import RecordingProducer


class SendWindowTests(SynchronousTestCase):
    def setUp(self):
        self.sent = []
        self.producer = RecordingProducer()

    def test_unlimited(self):
        """
        Without a window everything goes out at once and nothing is paused.
        """
        flow = SendWindow(self.sent.append, 0)
        flow.register_producer(self.producer)
        for i in range(5):
            flow.send(i, 10_000)
        self.assertEqual(self.sent, [0, 1, 2, 3, 4])
        self.assertEqual(self.producer.calls, [])

    def test_waits_for_credit_in_order(self):
        """
        With credit left a frame goes (even past the credit); then frames,
        bodiless ones too, wait in order and the producer is paused; a
        grant sends what fits and resumes the producer once all is out.
        """
        flow = SendWindow(self.sent.append, 100)
        flow.register_producer(self.producer)
        flow.send("a", 60)
        flow.send("b", 60)
        self.assertEqual(self.sent, ["a", "b"])
        self.assertEqual(self.producer.calls, ["pause"])
        flow.send("c", 60)
        flow.send("usage", 0)
        flow.send("d", 10)
        self.assertEqual(self.sent, ["a", "b"])
        flow.grant(30)  # credit 10: c goes, then the bodiless usage; d waits
        self.assertEqual(self.sent, ["a", "b", "c", "usage"])
        flow.grant(100)
        self.assertEqual(self.sent, ["a", "b", "c", "usage", "d"])
        self.assertEqual(self.producer.calls, ["pause", "resume"])

    def test_abandon(self):
        """
        Abandoning drops the waiting body frames, sends the others, resumes
        the producer and lifts the limit.
        """
        flow = SendWindow(self.sent.append, 10)
        flow.register_producer(self.producer)
        idle = []
        flow.send("a", 20)
        flow.send("b", 20)
        flow.send("end", 0)
        flow.when_idle(lambda: idle.append(True))
        self.assertEqual(idle, [])
        flow.abandon()
        self.assertEqual(self.sent, ["a", "end"])
        self.assertEqual(idle, [True])
        self.assertEqual(self.producer.calls, ["pause", "resume"])
        flow.send("late", 1000)
        self.assertEqual(self.sent[-1], "late")

    def test_flush(self):
        """
        Flushing (work that already ended, cancelled while its rest waits)
        sends everything queued, body too, and lifts the limit.
        """
        flow = SendWindow(self.sent.append, 10)
        flow.register_producer(self.producer)
        idle = []
        flow.send("a", 20)
        flow.send("b", 20)
        flow.send("end", 0)
        flow.when_idle(lambda: idle.append(True))
        flow.flush()
        self.assertEqual(self.sent, ["a", "b", "end"])
        self.assertEqual(idle, [True])
        self.assertEqual(self.producer.calls, ["pause", "resume"])

    def test_producer_registered_while_blocked(self):
        """
        A producer registered while frames wait is paused at once.
        """
        flow = SendWindow(self.sent.append, 1)
        flow.send("a", 5)
        flow.register_producer(self.producer)
        self.assertEqual(self.producer.calls, ["pause"])


class RelayFlowTests(SynchronousTestCase):
    def setUp(self):
        self.session, self.edge, self.pump, self.context = ready_node()
        self.adapter = manual(self.context.host, "manual")

    def grant(self, work_id, size):
        self.edge.connection.send(messages.window_update(work_id, size))
        self.pump.flush()

    def body_bytes(self):
        return sum(len(f.body) for f in self.edge.of("provider_tunnel_frame") if f.WhichOneof("frame") == "body")

    def test_tunnel(self):
        """
        A tunnel with a 1000-byte window sends about one window of body,
        pauses the adapter's producer, and goes on as the Edge grants; its
        terminal waits behind the body, and it stays in flight until the
        terminal is out.
        """
        request = tunnel_request()
        request.window_bytes = 1000
        self.edge.connection.send(request)
        self.pump.flush()
        _, sink, d = self.adapter.tunnels[-1]
        producer = RecordingProducer()
        sink.register_producer(producer)
        sink.status(200)
        for _ in range(10):
            sink.body(b"x" * 300)
        d.callback(None)
        self.pump.flush()
        self.assertEqual(self.body_bytes(), 1200)
        self.assertEqual(producer.calls, ["pause"])
        self.assertIn("t1", self.session.inflight)
        self.grant("t1", 1200)
        self.assertEqual(self.body_bytes(), 2400)
        self.grant("t1", 10_000)
        self.assertEqual(self.body_bytes(), 3000)
        kinds = [f.WhichOneof("frame") for f in self.edge.of("provider_tunnel_frame")]
        self.assertEqual(kinds[-1], "end")
        self.assertEqual([f.seq for f in self.edge.of("provider_tunnel_frame")], list(range(1, 13)))
        self.assertNotIn("t1", self.session.inflight)
        self.assertEqual(producer.calls, ["pause", "resume"])

    def test_cancel_drops_what_waits(self):
        """
        Cancelling a tunnel whose body waits for credit sends its terminal
        at once and drops the rest of the body.
        """
        request = tunnel_request()
        request.window_bytes = 100
        self.edge.connection.send(request)
        self.pump.flush()
        _, sink, d = self.adapter.tunnels[-1]
        sink.status(200)
        for _ in range(5):
            sink.body(b"y" * 100)
        self.pump.flush()
        self.edge.connection.send(messages.cancel_run("t1"))
        self.pump.flush()
        frames = self.edge.of("provider_tunnel_frame")
        self.assertEqual(frames[-1].error.code, "cancelled")
        self.assertEqual(self.body_bytes(), 100)
        self.assertNotIn("t1", self.session.inflight)

    def test_run_deltas(self):
        """
        A run's delta text spends its window the same way.
        """
        request = run_request()
        request.window_bytes = 10
        self.edge.connection.send(request)
        self.pump.flush()
        _, emit, d = self.adapter.runs[-1]
        for _ in range(4):
            emit(RunEventData(DELTA, text="abcdefgh"))
        d.callback(None)
        self.pump.flush()
        self.assertEqual([e.type for e in self.edge.of("run_event")], ["delta", "delta"])
        self.grant("r1", 100)
        self.assertEqual([e.type for e in self.edge.of("run_event")], ["delta"] * 4 + ["complete"])

    def test_no_window_no_limit(self):
        """
        A request without a window (an older Edge) is not limited.
        """
        self.edge.connection.send(tunnel_request())
        self.pump.flush()
        _, sink, d = self.adapter.tunnels[-1]
        for _ in range(10):
            sink.body(b"z" * 100_000)
        self.pump.flush()
        self.assertEqual(self.body_bytes(), 1_000_000)
