"""
Tests for L{iop.adapters.relay.TunnelBody}'s checks of an event stream,
fed directly: the bulk path and the event-by-event one agree.
"""

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.http_headers import Headers
from twisted.web.iweb import UNKNOWN_LENGTH

from iop.adapters.relay import EARLY_COMMENTS_LIMIT, TunnelBody
from iop.adapters.streams import ProviderError, Reading
from iop.run import INCOMPLETE, RunFailure
from iop.testing.tunnels import TunnelRecorder


class Response:
    code = 200
    length = UNKNOWN_LENGTH

    def __init__(self) -> None:
        self.headers = Headers({b"content-type": [b"text/event-stream"]})


def body() -> tuple[TunnelBody, TunnelRecorder]:
    sink = TunnelRecorder()
    return TunnelBody(sink, Response(), None, False, Clock()), sink  # type: ignore[arg-type]


class EventCheckTests(SynchronousTestCase):
    def test_not_one_json_value(self) -> None:
        """
        Data that parses only as part of a list (two values, a bracket) is
        malformed, in bulk as one by one.
        """
        for data in (b"1, 2", b"]", b"{}, {}", b""):
            relay, sink = body()
            self.assertRaises(ProviderError, relay.feed, b"data: " + data + b"\n\n")
            self.assertEqual(sink.calls, [], data)

    def test_multi_line_data_and_crlf(self) -> None:
        """
        An event whose data spans lines, and CRLF line ends, are checked
        event by event and relayed unchanged.
        """
        for stream in (
            b'data: {"choices":\ndata: []}\n\ndata: [DONE]\n\n',
            b'data: {"choices": []}\r\n\r\ndata: [DONE]\r\n\r\n',
        ):
            relay, sink = body()
            self.assertEqual(relay.feed(stream), Reading.FINISHED)
            relay.finish()
            self.assertEqual(b"".join(sink.bodies), stream)

    def test_error_event_ends_failed(self) -> None:
        """
        An error object is relayed, and what follows it, but the end fails
        with its message and status (incomplete: it reached the caller),
        whether the events come in one piece or one by one.
        """
        stream = b'data: {"choices": []}\n\ndata: {"error": {"message": "oom", "code": 503}}\n\ndata: [DONE]\n\n'
        for pieces in ([stream], [event + b"\n\n" for event in stream.split(b"\n\n")[:-1]]):
            relay, sink = body()
            for piece in pieces:
                relay.feed(piece)
            error = self.assertRaises(ProviderError, relay.finish)
            self.assertEqual((error.message, error.status), ("oom", 503))
            self.assertEqual(
                relay.failed(error).failure(), RunFailure(INCOMPLETE, "the answer is incomplete: oom", 503)
            )
            self.assertEqual(b"".join(sink.bodies), stream)

    def test_responses_api_failures_end_failed(self) -> None:
        """
        The Responses API says it failed without an C{error} object at the
        top: its C{error} event (message and code at the top) and its
        C{response.failed} (the error under C{response}) end the tunnel
        failed too, their bytes relayed; C{response.completed} does not.
        """
        for event, message in (
            (b'{"type": "error", "code": "server_error", "message": "overloaded"}', "overloaded"),
            (b'{"type": "response.failed", "response": {"error": {"message": "oom"}}}', "oom"),
            (b'{"type": "response.failed", "response": {}}', "the provider's response failed"),
        ):
            stream = b'data: {"type": "response.created"}\n\ndata: ' + event + b"\n\n"
            relay, sink = body()
            relay.feed(stream)
            error = self.assertRaises(ProviderError, relay.finish)
            self.assertEqual(error.message, message)
            self.assertEqual(relay.failed(error).failure().code, INCOMPLETE)
            self.assertEqual(b"".join(sink.bodies), stream)
        relay, sink = body()
        relay.feed(b'data: {"type": "response.completed", "response": {"error": null}}\n\n')
        relay.finish()

    def test_values_of_the_wrong_type_say_nothing(self) -> None:
        """
        Events that are JSON of a shape the relay does not expect (a type
        that is not a string, choices that are not a list, a finish reason
        that is not a string) are relayed and do not say the stream is
        finished.
        """
        for data in (b'{"type": ["x"]}', b'{"choices": 5}', b'{"choices": [{"finish_reason": 1}]}', b'{"type": {}}'):
            relay, sink = body()
            self.assertEqual(relay.feed(b"data: " + data + b"\n\n"), Reading.ANSWERING, data)
            self.assertRaises(ProviderError, relay.finish)  # (it never said it finished)
            self.assertEqual(b"".join(sink.bodies), b"data: " + data + b"\n\n")

    def test_comments_wait_for_the_answer(self) -> None:
        """
        Comments alone are held (not the answer); they go out, in order,
        with the first event with data.
        """
        relay, sink = body()
        self.assertEqual(relay.feed(b": ping\n\n: ping\n\n"), Reading.WAITING)
        self.assertEqual(sink.calls, [])
        self.assertEqual(relay.feed(b'data: {"choices": []}\n\n'), Reading.ANSWERING)
        self.assertEqual(b"".join(sink.bodies), b': ping\n\n: ping\n\ndata: {"choices": []}\n\n')

    def test_comments_held_up_to_a_bound(self) -> None:
        """
        A provider that sends only comments makes the Node hold at most
        C{EARLY_COMMENTS_LIMIT} of them: beyond it the head and the
        comments go out (and flow control then paces the provider), still
        waiting for the answer; bytes and their order are kept.
        """
        relay, sink = body()
        keepalive = b": " + b"x" * 1020 + b"\n\n"
        fed = b""
        while len(fed) <= EARLY_COMMENTS_LIMIT:
            self.assertEqual(sink.bodies, [])
            self.assertEqual(relay.feed(keepalive), Reading.WAITING)
            fed += keepalive
        self.assertEqual(b"".join(sink.bodies), fed)
        self.assertEqual(relay.feed(keepalive), Reading.WAITING)
        self.assertEqual(b"".join(sink.bodies), fed + keepalive)


class ObserverRecorder:
    """
    An L{iop.adapters.relay.Observer} that notes the parsed events it is
    shown.
    """

    usage = None

    def __init__(self) -> None:
        self.parsed_any = False
        self.chunks: list[dict[str, object]] = []

    def feed(self, data: bytes) -> None:
        pass

    def chunk(self, chunk: dict[str, object]) -> None:
        self.parsed_any = True
        self.chunks.append(chunk)

    def finish(self) -> None:
        pass


class TellingEventsTests(SynchronousTestCase):
    """
    A run of events read in one piece: the observer is shown the first
    event (the model) and those that can tell more than text, wherever
    they are in the run, and nothing else.
    """

    def feed(self, *pieces: bytes, error: str | None = None) -> ObserverRecorder:
        """
        Relay C{pieces}; the end fails with C{error} (an error event's
        message) when given.
        """
        observer = ObserverRecorder()
        sink = TunnelRecorder()
        relay = TunnelBody(sink, Response(), observer, False, Clock())  # type: ignore[arg-type]
        for piece in pieces:
            relay.feed(piece)
        if error is None:
            relay.finish()
        else:
            self.assertEqual(self.assertRaises(ProviderError, relay.finish).message, error)
        self.assertEqual(b"".join(sink.bodies), b"".join(pieces))
        return observer

    def test_telling_events_anywhere_in_the_run(self) -> None:
        def delta(n: int, finish: str = "null") -> bytes:
            return b'data: {"n": %d, "choices": [{"delta": {"content": "w"}, "finish_reason": %s}]}\n\n' % (
                n,
                finish.encode(),
            )

        run = (
            delta(0)
            + delta(1)
            + b'data: {"n": 2, "usage": {"prompt_tokens": 1}, "choices": [{"delta": {}}]}\n\n'
            + delta(3)
            + delta(4, '"stop"')
            + b"data: [DONE]\n\n"
        )
        observer = self.feed(run)
        self.assertEqual([c["n"] for c in observer.chunks], [0, 2, 4])
        one_by_one = self.feed(*(event + b"\n\n" for event in run.split(b"\n\n")[:-1]))
        self.assertEqual(one_by_one.chunks, observer.chunks)
        later = self.feed(delta(0), delta(1) + b'data: {"n": 2, "error": {"message": "x"}}\n\n', error="x")
        self.assertEqual([c["n"] for c in later.chunks], [0, 2])

    def test_comment_before_the_first_event(self) -> None:
        observer = self.feed(b': hello "type"\n\ndata: {"n": 0, "choices": [{"finish_reason": "stop"}]}\n\n')
        self.assertEqual([c["n"] for c in observer.chunks], [0])
