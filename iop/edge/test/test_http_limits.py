"""
The HTTP limits of one connection (issue 12, findings 3 and 8): a header
deadline that trickling bytes do not extend, a body deadline, a 413 for a
too-large body before it is read, and a cap on open connections. On the
Edge's real site and channel, with a Clock and string transports.
"""

from twisted.internet.address import IPv4Address
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.logger import capturedLogs
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET

from iop.edge.http.site import EdgeSite
from iop.edge.limits import Limits

LIMITS = Limits(header_timeout_sec=10, body_timeout_sec=60, max_http_connections=3, max_body_bytes=1024)


class Recording(Resource):
    isLeaf = True

    def __init__(self):
        super().__init__()
        self.bodies = []
        self.held = []

    def render_POST(self, request):
        self.bodies.append(request.content.read())
        self.args = request.args
        return b"ok"

    def render_GET(self, request):
        self.held.append(request)
        return NOT_DONE_YET


class HTTPLimitsTests(SynchronousTestCase):
    def setUp(self):
        self.clock = Clock()
        self.resource = Recording()
        self.site = EdgeSite(self.resource, limits=LIMITS, reactor=self.clock)

    def connect(self):
        """
        @return: the protocol and its transport; C{(None, None)} for a
            connection refused at the doors (the port closes it).
        """
        protocol = self.site.buildProtocol(IPv4Address("TCP", "203.0.113.9", 40000))
        if protocol is None:
            return None, None
        transport = StringTransport()
        protocol.makeConnection(transport)
        return protocol, transport

    def post(self, body, extra=b""):
        return b"POST /x HTTP/1.1\r\nHost: e\r\nContent-Length: %d\r\n%s\r\n" % (len(body), extra) + body

    def test_body_never_parsed_as_a_form(self):
        """
        A POST body is the API's JSON, never an HTML form: twisted.web's
        form parsing (which reads the Content-Type as an email header on
        every POST) is off.
        """
        protocol, transport = self.connect()
        protocol.dataReceived(self.post(b"a=1", b"Content-Type: application/x-www-form-urlencoded\r\n"))
        self.assertEqual(self.resource.bodies, [b"a=1"])
        self.assertEqual(self.resource.args, {})

    def test_slowloris(self):
        """
        Finding 3: a peer sending one header line every 2 s is closed when
        C{header_timeout_sec} has passed since the connection opened; one
        log line says so.
        """
        protocol, transport = self.connect()
        protocol.dataReceived(b"GET /x HTTP/1.1\r\n")
        with capturedLogs() as events:
            for i in range(4):
                self.clock.advance(2)
                protocol.dataReceived(b"X-Slow-%d: 1\r\n" % i)
            self.clock.advance(1.9)
            self.assertFalse(transport.disconnecting)
            self.clock.advance(0.1)
        self.assertTrue(transport.disconnected)
        self.assertEqual(self.resource.held, [])
        self.assertEqual(len([e for e in events if "header_timeout_sec" in str(e.get("key"))]), 1)

    def test_silent_connection(self):
        """
        A connection that sends nothing at all is closed at the header
        deadline too.
        """
        _, transport = self.connect()
        self.clock.advance(10)
        self.assertTrue(transport.disconnected)

    def test_keep_alive(self):
        """
        Headers in time are served; the deadline then starts again for the
        next request on the connection, so an idle keep-alive connection is
        closed after C{header_timeout_sec}, and a prompt second request is
        served.
        """
        protocol, transport = self.connect()
        self.clock.advance(9)
        protocol.dataReceived(self.post(b"{}"))
        self.assertEqual(self.resource.bodies, [b"{}"])
        self.clock.advance(9)
        protocol.dataReceived(self.post(b"[]"))
        self.assertEqual(self.resource.bodies, [b"{}", b"[]"])
        self.assertFalse(transport.disconnecting)
        self.clock.advance(10)
        self.assertTrue(transport.disconnected)

    def test_no_deadline_while_answering(self):
        """
        While a request is being answered (a long stream), no deadline
        runs.
        """
        protocol, transport = self.connect()
        protocol.dataReceived(b"GET /x HTTP/1.1\r\nHost: e\r\n\r\n")
        self.clock.advance(600)
        self.assertFalse(transport.disconnecting)
        request = self.resource.held[0]
        request.write(b"done")
        request.finish()
        self.clock.advance(10)
        self.assertTrue(transport.disconnected)

    def test_unread_answer_on_a_closing_connection(self):
        """
        A C{Connection: close} answer its peer never reads (the close waits
        for the bytes to leave) is cut off when C{header_timeout_sec} has
        passed since it ended, as a keep-alive connection's would be.
        """
        protocol, transport = self.connect()
        protocol.dataReceived(self.post(b"{}", b"Connection: close\r\n"))
        self.assertTrue(transport.disconnecting)
        self.clock.advance(9.9)
        self.assertFalse(transport.disconnected)
        self.clock.advance(0.1)
        self.assertTrue(transport.disconnected)

    def test_pipelined_bytes_bounded_while_the_answer_is_unread(self):
        """
        While a request is being answered, what the peer sends after it is
        kept for later only up to a small bound, then the connection is no
        longer read, also when the peer reads nothing of the answer (the
        transport has paused the channel): twisted.web would go on reading
        and keeping everything then. Once the answer is done and read,
        reading resumes and the kept bytes are served.
        """
        protocol, transport = self.connect()
        protocol.dataReceived(b"GET /x HTTP/1.1\r\nHost: e\r\n\r\n")
        protocol.pauseProducing()  # the transport's buffer is full
        protocol.dataReceived(self.post(b"{}"))
        self.assertEqual(transport.producerState, "producing")
        for _ in range(4):
            protocol.dataReceived(b"x" * 0x1000)
            if transport.producerState == "paused":
                break
        self.assertEqual(transport.producerState, "paused")
        request = self.resource.held[0]
        request.finish()
        self.assertEqual(transport.producerState, "paused")
        protocol.resumeProducing()  # the peer read the answer
        self.assertEqual(transport.producerState, "producing")
        self.assertEqual(self.resource.bodies, [b"{}"])

    def test_body_timeout(self):
        """
        A body that is not complete C{body_timeout_sec} after its headers
        closes the connection; the resource never sees the request.
        """
        protocol, transport = self.connect()
        protocol.dataReceived(b"POST /x HTTP/1.1\r\nHost: e\r\nContent-Length: 100\r\n\r\n" + b"x" * 10)
        self.clock.advance(30)
        protocol.dataReceived(b"x" * 10)
        self.clock.advance(29.9)
        self.assertFalse(transport.disconnecting)
        self.clock.advance(0.1)
        self.assertTrue(transport.disconnected)
        self.assertEqual(self.resource.bodies, [])

    def test_content_length_over_the_limit(self):
        """
        Finding 8: a C{Content-Length} above C{max_body_bytes} is answered
        413 with an OpenAI-style error as soon as the headers are in, and
        the connection closed; the body that follows is not read or kept.
        """
        protocol, transport = self.connect()
        protocol.dataReceived(b"POST /x HTTP/1.1\r\nHost: e\r\nContent-Length: 300000000\r\n\r\n")
        response = transport.value()
        self.assertTrue(response.startswith(b"HTTP/1.1 413 "), response)
        self.assertIn(b'"code": "too_large"', response)
        self.assertTrue(transport.disconnecting)
        protocol.dataReceived(b"x" * 100_000)
        self.assertEqual(self.resource.bodies, [])
        self.assertIsNone(protocol.requests[-1].content)

    def test_unread_413_is_cut_off(self):
        """
        A 413 its peer never reads (its close waits for the bytes to leave,
        and a TLS close for the peer's own close) is cut off when
        C{header_timeout_sec} has passed since it was answered, as any
        unread answer on a closing connection is: the refusal does not
        keep the connection's place for ever.
        """
        protocol, transport = self.connect()
        protocol.dataReceived(b"POST /x HTTP/1.1\r\nHost: e\r\nContent-Length: 300000000\r\n\r\n")
        self.assertTrue(transport.value().startswith(b"HTTP/1.1 413 "))
        self.assertTrue(transport.disconnecting)
        self.clock.advance(9.9)
        self.assertFalse(transport.disconnected)
        self.clock.advance(0.1)
        self.assertTrue(transport.disconnected)

    def test_unread_chunked_413_is_cut_off(self):
        """
        So is the 413 that cuts a chunked body.
        """
        protocol, transport = self.connect()
        protocol.dataReceived(b"POST /x HTTP/1.1\r\nHost: e\r\nTransfer-Encoding: chunked\r\n\r\n")
        protocol.dataReceived(b"800\r\n" + b"y" * 2048 + b"\r\n")
        self.assertTrue(transport.value().startswith(b"HTTP/1.1 413 "))
        self.clock.advance(10)
        self.assertTrue(transport.disconnected)

    def test_expect_continue_not_invited(self):
        """
        A too-large body announced with C{Expect: 100-continue} gets the
        413, never an invitation to send it.
        """
        protocol, transport = self.connect()
        protocol.dataReceived(b"POST /x HTTP/1.1\r\nHost: e\r\nExpect: 100-continue\r\nContent-Length: 5000\r\n\r\n")
        self.assertNotIn(b"100 Continue", transport.value())
        self.assertTrue(transport.value().startswith(b"HTTP/1.1 413 "))

    def test_chunked_body_over_the_limit(self):
        """
        A chunked body is cut with a 413 as soon as it passes the limit.
        """
        protocol, transport = self.connect()
        protocol.dataReceived(b"POST /x HTTP/1.1\r\nHost: e\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(3):
            protocol.dataReceived(b"200\r\n" + b"y" * 512 + b"\r\n")
        self.assertTrue(transport.value().startswith(b"HTTP/1.1 413 "))
        self.assertTrue(transport.disconnecting)
        self.assertEqual(self.resource.bodies, [])

    def test_body_at_the_limit(self):
        """
        A body of exactly C{max_body_bytes} is read and served.
        """
        protocol, transport = self.connect()
        protocol.dataReceived(self.post(b"z" * 1024))
        self.assertEqual(self.resource.bodies, [b"z" * 1024])

    def test_connection_cap(self):
        """
        Beyond C{max_http_connections} open connections, a new one is
        aborted at once; a closed one frees its place.
        """
        open_ = [self.connect() for _ in range(3)]
        protocol, _ = self.connect()
        self.assertIsNone(protocol)
        first, first_transport = open_[0]
        first.connectionLost(None)
        protocol, _ = self.connect()
        self.assertIsNotNone(protocol)
