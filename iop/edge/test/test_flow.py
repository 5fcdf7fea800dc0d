"""
The Edge's side of per-stream flow control (wire version 3): requests to a
version-3 Node carry the window, body bytes handed to the caller are
granted back in halves of the window while the caller's connection
drains, and not while it is paused.
"""

from google.protobuf.message import Message
from twisted.trial.unittest import SynchronousTestCase

from iop.edge.flow import ReceiveWindow
from iop.edge.spec import RunSpec
from iop.protocols import messages
from iop.protocols.wire import STREAM_WINDOW_BYTES
from iop.testing.edge import EdgeHarness, Recorder


class ReceiveWindowTests(SynchronousTestCase):
    def setUp(self):
        self.sent: list[Message] = []
        self.window = ReceiveWindow(self.sent.append, "t1", 100)

    def grants(self):
        return [(m.id, m.bytes) for m in self.sent]

    def test_grants_in_halves(self):
        """
        Received bytes are granted back once half a window is due.
        """
        self.window.received(30)
        self.assertEqual(self.grants(), [])
        self.window.received(30)
        self.assertEqual(self.grants(), [("t1", 60)])

    def test_paused(self):
        """
        While the caller's connection is paused nothing is granted; resuming
        grants everything due.
        """
        self.window.pauseProducing()
        self.window.received(500)
        self.assertEqual(self.grants(), [])
        self.window.resumeProducing()
        self.assertEqual(self.grants(), [("t1", 500)])

    def test_closed(self):
        """
        A closed (ended, or stopped) window grants nothing more.
        """
        self.window.received(10)
        self.window.close()
        self.window.received(100)
        self.window.resumeProducing()
        self.assertEqual(self.grants(), [])


class DispatchWindowTests(SynchronousTestCase):
    def start(self, wire_version):
        edge = EdgeHarness()
        node, pump, _ = edge.register(wire_version=wire_version)
        recorder = Recorder()
        spec = RunSpec(messages=[{"role": "user", "content": "x"}], adapter="echo", node="n1")
        self.successResultOf(edge.service.submit(spec, recorder.for_run))
        pump.flush()
        return edge, node, pump, recorder

    def test_version_3(self):
        """
        A run on a version-3 Node carries the window; its delta text is
        granted back as the caller takes it.
        """
        edge, node, pump, recorder = self.start(3)
        (request,) = node.of("run_request")
        self.assertEqual(request.window_bytes, STREAM_WINDOW_BYTES)
        text = "x" * (STREAM_WINDOW_BYTES // 2)
        node.wire.send(messages.run_event(run_id=request.run_id, seq=1, type="delta", text=text))
        pump.flush()
        self.assertEqual([(u.id, u.bytes) for u in node.of("window_update")], [(request.run_id, len(text))])

    def test_version_2(self):
        """
        A version-2 Node gets no window and no C{WindowUpdate}.
        """
        edge, node, pump, recorder = self.start(2)
        (request,) = node.of("run_request")
        self.assertEqual(request.window_bytes, 0)
        node.wire.send(messages.run_event(run_id=request.run_id, seq=1, type="delta", text="x" * STREAM_WINDOW_BYTES))
        pump.flush()
        self.assertEqual(node.of("window_update"), [])
        self.assertEqual(recorder.types(), ["delta"])
