"""
Server-Timing (L{iop.edge.timing}): where a request's time went, from the
marks the service and the Node's first frame leave on it, sent with the
answer's headers by L{iop.edge.http.request.EdgeRequest}; and the marks a
real run through the in-memory gateway leaves.
"""

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.resource import Resource
from twisted.web.server import Site
from twisted.web.test.requesthelper import DummyChannel

from iop.edge.http.request import EdgeRequest
from iop.edge.spec import RunSpec
from iop.edge.timing import Timing, server_timing
from iop.testing.edge import Recorder
from iop.testing.gateway import Gateway


class TimingTests(SynchronousTestCase):
    def test_every_stage(self):
        """
        Arrived at 10.000, submitted at 10.001, a lease at 10.011, sent at
        10.012, the Node's first frame at 10.212 saying the provider took
        150 ms: queue 10 ms, place 1 ms, node 50 ms, provider 150 ms, and
        the rest of the 215 ms by then is the Edge's own (4 ms).
        """
        timing = Timing(arrived=10.0, submitted=10.001)
        timing.place(10.011)
        timing.sent = 10.012
        timing.heard(10.212, 150.0)
        parts = dict(timing.parts(10.215))
        self.assertEqual(list(parts), ["queue", "place", "node", "provider", "edge"])
        for name, ms in {"queue": 10, "place": 1, "node": 50, "provider": 150, "edge": 4}.items():
            self.assertAlmostEqual(parts[name], ms, places=6)
        self.assertAlmostEqual(timing.gateway_seconds(10.215), 0.005, places=9)

    def test_only_the_first_frame_counts(self):
        """
        Later frames do not move the Node's answer; a frame before the
        request was sent (there is none) is not an answer.
        """
        timing = Timing(arrived=0.0, submitted=0.0)
        timing.place(0.0)
        timing.heard(0.5, 1.0)
        self.assertIsNone(timing.answered)
        timing.sent = 0.1
        timing.heard(0.2, 50.0)
        timing.heard(0.9, 700.0)
        self.assertEqual((timing.answered, timing.first_byte_ms), (0.2, 50.0))

    def test_answer_sent_whole(self):
        """
        An answer whose headers go out once it is whole (non-streamed): the
        time from the Node's first frame to its last is C{generate}, the
        back end's, not the Edge's.
        """
        timing = Timing(arrived=0.0, submitted=0.0)
        timing.place(0.0)
        timing.sent = 0.0
        timing.heard(0.1, 50.0)
        timing.heard(1.0, 0.0)
        timing.heard(2.1, 0.0)
        parts = dict(timing.parts(2.102))
        self.assertEqual(list(parts), ["queue", "place", "node", "provider", "generate", "edge"])
        self.assertAlmostEqual(parts["generate"], 2000.0, places=6)
        self.assertAlmostEqual(parts["edge"], 2.0, places=6)
        self.assertAlmostEqual(timing.gateway_seconds(2.102), 0.002, places=9)

    def test_forwarded(self):
        """
        At an Edge that forwarded the request to the Edge serving it, the
        time from the forward on is C{forward}, not its own.
        """
        timing = Timing(arrived=0.0, forwarded=0.001)
        self.assertEqual([(n, round(ms, 6)) for n, ms in timing.parts(3.0)], [("forward", 2999.0), ("edge", 1.0)])
        self.assertAlmostEqual(timing.gateway_seconds(3.0), 0.001, places=9)

    def test_provider_never_more_than_the_round_trip(self):
        """
        A Node whose clock says the provider took longer than the whole
        round trip the Edge measured is believed only up to that.
        """
        timing = Timing(arrived=0.0, submitted=0.0, placed=0.0, sent=0.0)
        timing.heard(0.1, 5000.0)
        parts = dict(timing.parts(0.1))
        self.assertAlmostEqual(parts["provider"], 100.0)
        self.assertAlmostEqual(parts["node"], 0.0)

    def test_a_later_attempt_counts(self):
        """
        Placed again (the first provider failed before answering), the
        stages after the queue are the last attempt's.
        """
        timing = Timing(arrived=0.0, submitted=0.0)
        timing.place(1.0)
        timing.sent = 1.0
        timing.heard(2.0, 10.0)
        timing.place(3.0)
        self.assertIsNone(timing.answered)
        self.assertEqual([name for name, _ in timing.parts(3.0)], ["queue", "edge"])

    def test_answered_by_the_edge_itself(self):
        """
        A request that never reached a Node (status, an error) has only
        the Edge's time.
        """
        self.assertEqual(Timing(arrived=1.0).parts(1.25), [("edge", 250.0)])
        self.assertEqual(Timing().parts(1.0), [])

    def test_header(self):
        self.assertEqual(
            server_timing([("queue", 1.5), ("provider", 120.0), ("edge", 0.25)]),
            'queue;dur=1.500, provider;dur=120.000;desc="first byte", edge;dur=0.250',
        )


class HeaderTests(SynchronousTestCase):
    def request(self, clock):
        channel = DummyChannel()
        channel.site = Site(Resource(), reactor=clock)
        request = EdgeRequest(channel)
        request.method, request.uri, request.clientproto = b"GET", b"/v1/status", b"HTTP/1.1"
        # What requestReceived notes before it renders the resource.
        request.timing.arrived = clock.seconds()
        return request, channel

    def test_sent_with_the_headers(self):
        """
        The first write of an answer carries its Server-Timing, after any
        already there (a provider's own, relayed), and notes the gateway's
        own time for its histogram.
        """
        clock = Clock()
        clock.advance(100)
        request, channel = self.request(clock)
        request.responseHeaders.addRawHeader(b"server-timing", b"upstream;dur=3")
        clock.advance(0.002)
        request.write(b"{}")
        request.write(b"more")
        written = channel.transport.written.getvalue()
        self.assertIn(b"server-timing: upstream;dur=3\r\n", written.lower())
        self.assertIn(b"server-timing: edge;dur=2.000\r\n", written.lower())
        self.assertEqual(written.lower().count(b"server-timing"), 2)
        self.assertAlmostEqual(request.gateway_seconds, 0.002)

    def test_finish_without_body(self):
        """
        An answer with no body (C{finish} alone) has it too.
        """
        request, channel = self.request(Clock())
        request.finish()
        self.assertIn(b"server-timing: edge;dur=0.000", channel.transport.written.getvalue().lower())


class MarksTests(SynchronousTestCase):
    def test_a_run_leaves_its_marks(self):
        """
        A run through the in-memory gateway (real service, wire and Node
        session) is marked submitted, placed, sent and answered, in that
        order, and its first frame says how long the Node took.
        """
        gateway = Gateway()
        gateway.node()
        gateway.advance(0.5)
        listener = Recorder()
        spec = RunSpec(messages=[{"role": "user", "content": "one two"}], model="talk")
        spec.timing.arrived = gateway.clock.seconds()
        gateway.service.submit(spec, listener.for_run)
        gateway.advance(1)
        timing = spec.timing
        self.assertEqual(listener.types()[-1], "complete")
        marks = [timing.arrived, timing.submitted, timing.placed, timing.sent, timing.answered]
        self.assertNotIn(None, marks)
        self.assertEqual(marks, sorted(marks))
        self.assertGreaterEqual(timing.first_byte_ms, 0.0)
        assert timing.last_heard is not None and timing.answered is not None
        self.assertGreaterEqual(timing.last_heard, timing.answered)
        self.assertEqual([name for name, _ in timing.parts(gateway.clock.seconds())][-1], "edge")
