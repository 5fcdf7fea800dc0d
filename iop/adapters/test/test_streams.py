"""
Tests for L{iop.adapters.streams}: the incremental parsers, fed one byte at
a time as framing tests should be, and error-body reading.
"""

from typing import cast

from twisted.internet import defer
from twisted.internet.error import ConnectionLost
from twisted.internet.protocol import Protocol
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.client import ResponseDone, ResponseFailed
from twisted.web.http_headers import Headers
from twisted.web.iweb import IResponse

from iop.adapters import streams
from iop.adapters.interface import AdapterConfigError
from iop.adapters.streams import (
    MAX_COUNT,
    HTTPAdapter,
    NDJSONParser,
    ProviderError,
    RunOutput,
    SSEParser,
    error_message,
    read_body,
    reported_count,
    stream_error,
)
from iop.httpheaders import relay_headers
from iop.run import COMPLETE, DELTA, REASONING_DELTA, START, TOOL_CALL, RunEventData, ToolCall, clean_text
from iop.turns import EndOfTurn


def feed_bytewise(parser, data):
    out = []
    for i in range(len(data)):
        out += parser.feed(data[i : i + 1])
    return out + parser.finish()


class SSEParserTests(SynchronousTestCase):
    def test_bytewise(self):
        """
        Events split at every byte still come out whole and in order, with
        multi-line data joined by newlines and comments ignored.
        """
        body = b": keepalive\n\ndata: one\n\ndata: two\ndata: lines\n\ndata:[DONE]\n\n"
        self.assertEqual(feed_bytewise(SSEParser(), body), ["one", "two\nlines", "[DONE]"])

    def test_line_endings(self):
        """
        CRLF, CR and LF all end lines, even when a CRLF is split between
        two pieces.
        """
        parser = SSEParser()
        self.assertEqual(parser.feed(b"data: a\r"), [])
        self.assertEqual(parser.feed(b"\n\r\ndata: b\r\rdata: c\n\n"), ["a", "b", "c"])

    def test_unterminated_last_event(self):
        """
        An event the body ends in without a blank line is still delivered
        at the end.
        """
        parser = SSEParser()
        self.assertEqual(parser.feed(b"data: x\n\ndata: y"), ["x"])
        self.assertEqual(parser.finish(), ["y"])

    def test_utf8_split(self):
        """
        A multi-byte character split across pieces decodes intact.
        """
        self.assertEqual(feed_bytewise(SSEParser(), "data: h\u00e9llo \u4e16\n\n".encode()), ["h\u00e9llo \u4e16"])

    def test_one_event_is_bounded(self):
        """
        The data lines of one event, without the blank line that ends it,
        are refused past the limit (a broken answer, 502), as one line is:
        a broken stream cannot grow the parser without bound.
        """
        self.patch(streams, "JSON_BODY_LIMIT", 1024)
        parser = SSEParser()
        line = b"data: " + b"x" * 100 + b"\n"
        self.assertEqual(parser.feed(line * 9), [])
        self.assertEqual(parser.feed(b"\n" + line * 9 + b"\n"), ["\n".join(["x" * 100] * 9)] * 2)
        error = self.assertRaises(ProviderError, parser.feed, line * 11)
        self.assertEqual(error.status, 502)
        self.assertRaises(ProviderError, SSEParser().feed, b"data: " + b"x" * 1100)


class NDJSONParserTests(SynchronousTestCase):
    def test_bytewise(self):
        """
        JSON lines fed one byte at a time parse whole; blank lines are
        skipped and a last line without newline is parsed at the end.
        """
        body = b'{"a": 1}\n\n{"b": "\xc3\xa9"}\n{"c": 3}'
        self.assertEqual(feed_bytewise(NDJSONParser(), body), [{"a": 1}, {"b": "\u00e9"}, {"c": 3}])

    def test_bad_line(self):
        """
        A line that is not JSON raises ValueError.
        """
        self.assertRaises(ValueError, NDJSONParser().feed, b"nope\n")

    def test_many_lines_in_one_piece(self):
        """
        A burst of lines parses as the same values as line by line; a line
        that is not one JSON value (two, or a bracket that only parses in
        a list) still raises.
        """
        body = b'{"a": 1}\n\n[2]\n"three"\n{"b": "\xc3\xa9"}\n'
        self.assertEqual(NDJSONParser().feed(body), [{"a": 1}, [2], "three", {"b": "\u00e9"}])
        for bad in (b'{"a": 1}\n1, 2\n', b'{"a": 1}\n]\n', b'{"a": 1}\n{nope\n'):
            self.assertRaises(ValueError, NDJSONParser().feed, bad)

    def test_line_is_bounded(self):
        """
        A line that does not end is refused past the limit (a broken
        answer, 502, not a ValueError), however it comes in pieces.
        """
        self.patch(streams, "JSON_BODY_LIMIT", 1024)
        parser = NDJSONParser()
        self.assertEqual(parser.feed(b'{"a": "' + b"x" * 1000), [])
        self.assertEqual(parser.feed(b'"}\n{"b": '), [{"a": "x" * 1000}])
        error = self.assertRaises(ProviderError, lambda: [parser.feed(b"1" * 100) for _ in range(11)])
        self.assertEqual(error.status, 502)
        self.assertRaises(ProviderError, NDJSONParser().feed, b"x" * 1025 + b"\r")


class ProviderValueTests(SynchronousTestCase):
    """
    What a provider's JSON may hold that the wire cannot carry.
    """

    def test_clean_text(self):
        """
        Text with a lone UTF-16 surrogate (legal JSON, not encodable as
        UTF-8) gets U+FFFD in its place, a pair of them the character they
        make; other text is the same object.
        """
        for text, clean in (
            ("\ud83d", "\ufffd"),
            ("a\ude00b", "a\ufffdb"),
            ("\ud83d\ude00", "\U0001f600"),
            ("\ud83d\ud83d\ude00 \u00e9", "\ufffd\U0001f600 \u00e9"),
        ):
            self.assertEqual(clean_text(text), clean)
            clean_text(text).encode("utf-8")
        for text in ("", "plain", "h\u00e9llo \u4e16 \U0001f600"):
            self.assertIs(clean_text(text), text)

    def test_reported_count(self):
        """
        A count is an integer from 0 to 2**63 - 1 (what can be sent and
        stored); anything else was not reported as one.
        """
        for value in (0, 7, MAX_COUNT):
            self.assertEqual(reported_count(value), value)
        for other in (-1, MAX_COUNT + 1, 2**64, True, 1.0, "3", None, [1]):
            self.assertIsNone(reported_count(other), other)

    def test_stream_error(self):
        """
        An in-band error object's code is its status only when it is an
        HTTP status; its message, like every provider error's, is cleaned.
        """
        self.assertEqual(stream_error({"message": "oom", "code": 500}).failure().status, 500)
        for code in (2**40, -1, 42, True, "server_error", None):
            self.assertEqual(stream_error({"message": "oom", "code": code}).failure().status, 0, code)
        self.assertEqual(stream_error("bad \ud83d").message, "bad \ufffd")
        self.assertEqual(ProviderError("x\udc00").incomplete().message, "the answer is incomplete: x\ufffd")


class RunOutputTests(SynchronousTestCase):
    """
    L{RunOutput}: start before the first event, and the text deltas of a
    read held until it is done.
    """

    def setUp(self) -> None:
        self.sent: list[tuple[str, str]] = []
        self.output = RunOutput(lambda event: self.sent.append((event.type, event.text)))

    def test_text_of_one_read_is_one_delta(self) -> None:
        for text in ("a", "b", "c"):
            self.output(RunEventData(DELTA, text=text))
        self.assertEqual(self.sent, [(START, "")])
        self.output.flush()
        self.output(RunEventData(DELTA, text="d"))
        self.output.flush()
        self.assertEqual(self.sent, [(START, ""), (DELTA, "abc"), (DELTA, "d")])

    def test_anything_else_goes_after_what_is_held(self) -> None:
        self.output(RunEventData(REASONING_DELTA, text="hm"))
        self.output(RunEventData(DELTA, text="x"))
        self.output(RunEventData(TOOL_CALL, tool_call=ToolCall("c1", "f", "{}")))
        self.output(RunEventData(DELTA, text="y"))
        self.output(RunEventData(COMPLETE))
        self.assertEqual(
            self.sent,
            [(START, ""), (REASONING_DELTA, "hm"), (DELTA, "x"), (TOOL_CALL, ""), (DELTA, "y"), (COMPLETE, "")],
        )


class ErrorMessageTests(SynchronousTestCase):
    def test_shapes(self):
        """
        The message is found in OpenAI, vLLM, Ollama and FastAPI error
        bodies; anything else is returned as text.
        """
        self.assertEqual(error_message(b'{"error": {"message": "bad", "type": "x"}}'), "bad")
        self.assertEqual(error_message(b'{"object": "error", "message": "vbad", "code": 400}'), "vbad")
        self.assertEqual(error_message(b'{"error": "model not found"}'), "model not found")
        self.assertEqual(error_message(b'{"detail": "Not Found"}'), "Not Found")
        self.assertEqual(error_message(b"Bad Gateway\n"), "Bad Gateway")


class RelayHeadersTests(SynchronousTestCase):
    def test_hop_by_hop(self):
        """
        Hop-by-hop headers, those named by Connection, and extra names are
        dropped case-insensitively; the rest keep their order and case.
        """
        pairs = [
            ("Content-Type", "text/event-stream"),
            ("Connection", "keep-alive, X-Hop"),
            ("Transfer-Encoding", "chunked"),
            ("x-hop", "1"),
            ("Host", "h"),
            ("X-Request-Id", "r1"),
        ]
        self.assertEqual(
            relay_headers(pairs, ("host",)), [("Content-Type", "text/event-stream"), ("X-Request-Id", "r1")]
        )


class HTTPAdapterConfigTests(SynchronousTestCase):
    def test_base_url(self):
        """
        base_url is required and must be an http(s) URL; errors name the key.
        """
        e = self.assertRaises(AdapterConfigError, HTTPAdapter, "p", 1, {}, None)
        self.assertIn("adapters[p].base_url", str(e))
        e = self.assertRaises(AdapterConfigError, HTTPAdapter, "p", 1, {"base_url": "localhost:8000"}, None)
        self.assertIn("adapters[p].base_url", str(e))

    def test_headers(self):
        """
        Configured headers and the API key become default request headers;
        a configured Authorization wins over api_key.
        """
        adapter = HTTPAdapter("p", 1, {"base_url": "http://h/v1/", "api_key": "k", "headers": {"X-A": "1"}}, None)
        self.assertEqual(adapter.default_headers(), [("X-A", "1"), ("Authorization", "Bearer k")])
        self.assertEqual(adapter.url("/chat/completions"), "http://h/v1/chat/completions")
        adapter = HTTPAdapter("p", 1, {"base_url": "http://h", "api_key": "k", "headers": {"authorization": "x"}}, None)
        self.assertEqual(adapter.default_headers(), [("authorization", "x")])


class _Response:
    """
    Just enough of an C{IResponse} for L{read_body}: the body's protocol is
    connected to a L{StringTransport} (the body's producer).
    """

    code = 200

    def __init__(self) -> None:
        self.headers = Headers()
        self.transport = StringTransport()
        self.body: Protocol | None = None

    def deliverBody(self, protocol: Protocol) -> None:
        self.body = protocol
        protocol.makeConnection(self.transport)


class ReadBodyTurnTests(SynchronousTestCase):
    """
    L{read_body} with C{turns}: what arrives in one reactor turn reaches
    the chunk callable as one piece.
    """

    def setUp(self) -> None:
        self.turns = Clock()
        self.response = _Response()
        self.pieces: list[bytes] = []
        self.result = read_body(
            defer.succeed(cast(IResponse, self.response)), lambda r: self.pieces.append, turns=EndOfTurn(self.turns)
        )
        assert self.response.body is not None
        self.body = self.response.body

    def test_one_piece_per_turn(self) -> None:
        self.body.dataReceived(b"data: 1\n\n")
        self.body.dataReceived(b"data: 2\n\n")
        self.assertEqual(self.pieces, [])
        self.turns.advance(0)
        self.assertEqual(self.pieces, [b"data: 1\n\ndata: 2\n\n"])
        self.body.dataReceived(b"data: 3\n\n")
        self.turns.advance(0)
        self.assertEqual(self.pieces[1:], [b"data: 3\n\n"])

    def test_end_hands_over_what_is_pending(self) -> None:
        self.body.dataReceived(b"last")
        self.body.connectionLost(Failure(ResponseDone()))
        self.assertEqual(self.pieces, [b"last"])
        self.assertIs(self.successResultOf(self.result), self.response)
        self.turns.advance(0)
        self.assertEqual(self.pieces, [b"last"])

    def test_cut_body_hands_over_what_came_first(self) -> None:
        self.body.dataReceived(b"partial")
        self.body.connectionLost(Failure(ResponseFailed([Failure(ConnectionLost())])))
        self.assertEqual(self.pieces, [b"partial"])
        self.failureResultOf(self.result, ResponseFailed)

    def test_aborted_body_drops_what_is_pending(self) -> None:
        self.body.dataReceived(b"first")
        self.result.cancel()
        self.assertEqual(self.response.transport.producerState, "stopped")
        self.body.dataReceived(b"late")
        self.body.connectionLost(Failure(ResponseFailed([Failure(ConnectionLost())])))
        self.turns.advance(0)
        self.assertEqual(self.pieces, [])
        self.failureResultOf(self.result, defer.CancelledError)

    def test_without_turns_each_piece_as_it_comes(self) -> None:
        response = _Response()
        pieces: list[bytes] = []
        read_body(defer.succeed(cast(IResponse, response)), lambda r: pieces.append)
        assert response.body is not None
        response.body.dataReceived(b"a")
        response.body.dataReceived(b"b")
        self.assertEqual(pieces, [b"a", b"b"])
