"""
Tests for L{iop.httpclient}: the chunked decoder against Twisted's own on
the same input cut at random places, its errors, and the pool and agent
on a real loopback server.
"""

from io import BytesIO

from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.internet import defer, reactor
from twisted.internet.testing import StringTransport
from twisted.trial import unittest
from twisted.web import resource, server
from twisted.web._newclient import HTTP11ClientProtocol, Request
from twisted.web.client import FileBodyProducer, readBody
from twisted.web.http import _ChunkedTransferDecoder, _DataLoss, _MalformedChunkedDataError
from twisted.web.http_headers import Headers

from iop import httpclient
from iop.httpclient import MAX_SIZE_LINE, BytesBody, ChunkedDecoder, LeanConnectionPool, body_producer, lean_agent


def chunked(*pieces: bytes, trailers: bytes = b"", extension: bytes = b"") -> bytes:
    body = b"".join(b"%x%s\r\n%s\r\n" % (len(p), extension, p) for p in pieces if p)
    return body + b"0\r\n" + trailers + b"\r\n"


def decode(decoder_class, data: bytes, cuts: list[int]):
    """
    Feed C{data} cut at C{cuts}; @return: (body, finish rest or None,
    error class or None, reads with body).
    """
    body: list[bytes] = []
    finished: list[bytes] = []
    decoder = decoder_class(body.append, finished.append)
    error = None
    start = 0
    for cut in [*sorted(cuts), len(data)]:
        if cut <= start:
            continue
        try:
            decoder.dataReceived(data[start:cut])
        except (_MalformedChunkedDataError, RuntimeError) as e:
            error = type(e)
            break
        start = cut
    return b"".join(body), (finished[0] if finished else None), error, len(body)


class ChunkedDecoderTests(unittest.TestCase):
    def test_one_read_is_one_piece(self):
        data = chunked(b"data: a\n\n", b"data: b\n\n", b"data: [DONE]\n\n")
        body, rest, error, reads = decode(ChunkedDecoder, data, [])
        self.assertEqual((body, rest, error), (b"data: a\n\ndata: b\n\ndata: [DONE]\n\n", b"", None))
        self.assertEqual(reads, 1)

    def test_what_follows_the_body_is_the_rest(self):
        data = chunked(b"abc", trailers=b"X-Checksum: 1\r\n") + b"HTTP/1.1 200 OK\r\n"
        self.assertEqual(decode(ChunkedDecoder, data, [5, 9]), (b"abc", b"HTTP/1.1 200 OK\r\n", None, 2))

    def test_a_chunk_cut_anywhere(self):
        data = chunked(b"x" * 100, b"yz", extension=b";name=value")
        for cut in range(1, len(data)):
            self.assertEqual(decode(ChunkedDecoder, data, [cut])[:3], (b"x" * 100 + b"yz", b"", None), cut)

    @settings(max_examples=300, deadline=None)
    @given(
        st.lists(st.binary(max_size=40), max_size=8),
        st.lists(st.integers(min_value=0, max_value=400), max_size=12),
        st.sampled_from([b"", b";a=b", b"; x", b";\x7f", b";\x00"]),
        st.sampled_from([b"", b"T: 1\r\n", b"T: 1\r\nU: 2\r\n"]),
        st.sampled_from([None, b"g", b"-1", b" 5", b"0x5", b"\r", b"5\r\nabcdeXY"]),
    )
    def test_same_as_twisted(self, pieces, cuts, extension, trailers, corruption):
        """
        Whatever the input and however it is cut, the body, the rest and
        the error are Twisted's.
        """
        data = chunked(*pieces, trailers=trailers, extension=extension)
        if corruption is not None:
            at = cuts[0] % (len(data) + 1) if cuts else 0
            data = data[:at] + corruption + data[at:]
        ours = decode(ChunkedDecoder, data, cuts)
        theirs = decode(_ChunkedTransferDecoder, data, cuts)
        self.assertEqual(ours[:3], theirs[:3])

    def test_malformed(self):
        for data in [
            b"g\r\n",
            b"-1\r\n",
            b"\r\n",
            b"3\r\nabcX\r\n",
            b"3;\x01\r\nabc\r\n",
            b"1" * (MAX_SIZE_LINE + 1),
            b"1;" + b"a" * MAX_SIZE_LINE + b"\r\n",
        ]:
            self.assertEqual(decode(ChunkedDecoder, data, [])[2], _MalformedChunkedDataError, data[:20])

    def test_body_before_a_malformed_chunk_is_delivered(self):
        body, _, error, _ = decode(ChunkedDecoder, b"3\r\nabc\r\nzz\r\n", [])
        self.assertEqual((body, error), (b"abc", _MalformedChunkedDataError))

    def test_trailers_are_bounded(self):
        decoder = ChunkedDecoder(lambda data: None, lambda rest: None)
        decoder.dataReceived(b"0\r\n")
        with self.assertRaises(_MalformedChunkedDataError):
            for _ in range(2**16 // 1000 + 2):
                decoder.dataReceived(b"X-A: " + b"a" * 993 + b"\r\n")

    def test_trailer_without_line_end_is_bounded(self):
        decoder = ChunkedDecoder(lambda data: None, lambda rest: None)
        decoder.dataReceived(b"0\r\n")
        with self.assertRaises(_MalformedChunkedDataError):
            for _ in range(2**16 // 1000 + 2):
                decoder.dataReceived(b"a" * 1000)

    def test_cut_short(self):
        decoder = ChunkedDecoder(lambda data: None, lambda rest: None)
        decoder.dataReceived(b"5\r\nab")
        self.assertRaises(_DataLoss, decoder.noMoreData)

    def test_nothing_after_the_end(self):
        decoder = ChunkedDecoder(lambda data: None, lambda rest: None)
        decoder.dataReceived(chunked(b"ab"))
        decoder.noMoreData()
        self.assertRaises(RuntimeError, decoder.dataReceived, b"1\r\n")


class BytesBodyTests(unittest.TestCase):
    def test_written_with_the_headers(self):
        """
        The body goes out in the turn the request does, right after its
        headers (no cooperator between them), and the request's body is
        done at once.
        """
        transport = StringTransport()
        protocol = HTTP11ClientProtocol()
        protocol.makeConnection(transport)
        body = b'{"model": "m"}'
        protocol.request(Request(b"POST", b"/v1/chat", Headers({b"host": [b"p"]}), BytesBody(body)))
        sent = transport.value()
        self.assertIn(b"Content-Length: %d\r\n" % len(body), sent)
        self.assertTrue(sent.endswith(b"\r\n\r\n" + body), sent)

    def test_body_producer_for_treq(self):
        self.assertIsInstance(body_producer(b"{}"), BytesBody)
        self.assertEqual(body_producer(b"{}").length, 2)
        other = FileBodyProducer(BytesIO(b"{}"))
        self.assertIs(body_producer(other), other)


class Chunks(resource.Resource):
    isLeaf = True

    def render_GET(self, request):
        for word in (b"one ", b"two ", b"three"):
            request.write(word)
        request.finish()
        return server.NOT_DONE_YET


class CountedDecoder(ChunkedDecoder):
    made = 0

    def __init__(self, *args):
        super().__init__(*args)
        CountedDecoder.made += 1


class LeanAgentTests(unittest.TestCase):
    def setUp(self):
        # (twisted types listenTCP's factory more narrowly than a Site.)
        self.port = reactor.listenTCP(0, server.Site(Chunks()), interface="127.0.0.1")  # type: ignore[arg-type]
        self.number = self.port.getHost().port  # type: ignore[attr-defined]
        self.addCleanup(self.port.stopListening)
        self.pool = LeanConnectionPool(reactor, persistent=True)
        self.addCleanup(self.pool.closeCachedConnections)
        self.patch(httpclient, "_DECODERS", {b"chunked": CountedDecoder})
        self.patch(CountedDecoder, "made", 0)

    @defer.inlineCallbacks
    def test_bodies_decoded_here_and_endpoints_built_once(self):
        agent = lean_agent(reactor, self.pool, 5)
        endpoints = agent._endpointFactory
        url = b"http://127.0.0.1:%d/" % self.number
        for _ in range(2):
            response = yield agent.request(b"GET", url)
            self.assertEqual((yield readBody(response)), b"one two three")
        self.assertEqual(CountedDecoder.made, 2)
        self.assertEqual(list(endpoints.known), [(b"http", b"127.0.0.1", self.number)])
