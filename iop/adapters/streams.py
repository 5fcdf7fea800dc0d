"""
HTTP plumbing shared by the HTTP back ends (C{openai_compat}, C{vllm},
C{ollama}): incremental SSE and NDJSON parsers, a body reader that can close
the provider connection at any moment, and L{HTTPAdapter}, the base class
that turns one streaming provider request into run events.

Why this is its own module: reading a provider's body incrementally while
staying able to abort it is the delicate part of every HTTP adapter, and
treq does not do it for us. Cancelling treq's request Deferred closes the
connection only until the response headers arrive; after that only the
protocol given to C{response.deliverBody} holds the transport. L{read_body}
covers both phases behind one C{Deferred(canceller)}.
"""

import json
import re
from collections.abc import Callable, Iterable
from enum import Enum
from http.cookiejar import DefaultCookiePolicy
from typing import Any, TypeVar, cast
from typing import Protocol as Shape

from treq.client import HTTPClient
from treq.cookies import IndexableCookieJar
from twisted.internet import defer
from twisted.internet.error import ConnectError, DNSLookupError
from twisted.internet.interfaces import IDelayedCall, IPushProducer, IReactorTime
from twisted.internet.protocol import Protocol, connectionDone
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.client import (
    PotentialDataLoss,
    RequestTransmissionFailed,
    ResponseDone,
    ResponseFailed,
    ResponseNeverReceived,
)
from twisted.web.http_headers import Headers
from twisted.web.iweb import UNKNOWN_LENGTH, IResponse
from zope.interface import implementer

from iop import jsontext
from iop.adapters.base import AdapterBase
from iop.adapters.deadlines import FINISH_GRACE_SEC, OPTION_NAMES, Deadlines, Watch, deadline_options
from iop.adapters.interface import AdapterConfigError, Capabilities, Emit, RunInput
from iop.adapters.verdicts import retry_after, says_context_length
from iop.config import http_url_problem
from iop.httpclient import BytesBody, LeanConnectionPool, body_producer, lean_agent
from iop.httpheaders import HeaderPairs, header_pairs, relay_headers
from iop.run import (
    ASSISTANT_PREFIX_OPTION,
    COMPLETE,
    CONTEXT_LENGTH_EXCEEDED,
    ERROR,
    INCOMPLETE,
    PROBE_COMMAND,
    PROVIDER_ERROR,
    PROVIDER_TIMEOUT,
    PROVIDER_UNREACHABLE,
    START,
    HeldDeltas,
    RunEventData,
    RunFailure,
    Usage,
    clean_text,
)
from iop.turns import EndOfTurn

#: How much of an error response body is kept for the error message.
ERROR_BODY_LIMIT = 64 * 1024
#: How much of a non-streamed JSON body is buffered for parsing (and the
#: most one streamed event or line may hold).
JSON_BODY_LIMIT = 16 * 1024 * 1024
#: The largest count a provider's answer is believed for (tokens): what a
#: signed 64-bit integer holds, so that it can be sent and stored.
MAX_COUNT = 2**63 - 1


def reported_count(value: object) -> int | None:
    """
    A count a provider reported (tokens), or C{None} when it reported none
    that can be one: an integer from 0 to L{MAX_COUNT}, not a boolean.
    """
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_COUNT:
        return value
    return None


class ProviderError(Exception):
    """
    The provider answered with an error (an HTTP status or an error object
    inside the stream). C{code} becomes L{RunFailure.code}.

    @ivar deadline: for a missed deadline, its kind (L{iop.run.DEADLINES}).
    @ivar retry_after_sec: the delay the provider asked for (Retry-After).
    """

    code: str = PROVIDER_ERROR

    def __init__(
        self,
        message: str,
        status: int = 0,
        code: str | None = None,
        deadline: str = "",
        retry_after_sec: float = 0.0,
    ) -> None:
        message = clean_text(message)
        super().__init__(message)
        self.message = message
        self.status = status
        self.deadline = deadline
        self.retry_after_sec = retry_after_sec
        if code is not None:
            self.code = code

    def failure(self) -> RunFailure:
        return RunFailure(
            code=self.code,
            message=self.message,
            status=self.status,
            deadline=self.deadline,
            retry_after_sec=self.retry_after_sec,
        )

    def incomplete(self) -> "ProviderError":
        """
        This failure once part of the answer reached the caller: the answer
        is C{incomplete} (a missed deadline keeps its kind).
        """
        return ProviderError(
            f"the answer is incomplete: {self.message}", self.status, INCOMPLETE, self.deadline, self.retry_after_sec
        )


class ProviderStalled(ProviderError):
    """
    The provider missed one of the adapter's deadlines (L{iop.adapters.deadlines});
    its connection was closed so that a hung back end cannot hold capacity
    forever.
    """

    code = PROVIDER_TIMEOUT


class ProviderUnreachable(ProviderError):
    """
    No response at all: the connection was refused, timed out, or closed
    before a response arrived.
    """

    code = PROVIDER_UNREACHABLE


#: The status of an answer that broke (cut, malformed) before any of it
#: reached the caller: what a gateway says of such an upstream.
BROKEN_ANSWER_STATUS = 502


def broken_answer(message: str) -> ProviderError:
    """
    A L{ProviderError} for an answer that broke before its end: cut short,
    malformed, or ended without saying it was finished.
    """
    return ProviderError(message, BROKEN_ANSWER_STATUS)


def stream_error(error: object) -> ProviderError:
    """
    The L{ProviderError} of an error object sent inside a 2xx answer
    (C{{"error": ...}}): its message, and its C{code} as the status when
    that is an HTTP status.
    """
    if isinstance(error, dict):
        code = error.get("code")
        status = code if isinstance(code, int) and not isinstance(code, bool) and 100 <= code <= 599 else 0
        return ProviderError(str(error.get("message") or error), status)
    return ProviderError(str(error))


def status_error(response: IResponse, body: bytes, clock: IReactorTime) -> ProviderError:
    """
    The L{ProviderError} of a non-2xx answer: the provider's message and
    status, the delay its C{Retry-After} asks for, and
    C{context_length_exceeded} for a 400 that says the prompt is too long.
    """
    message = error_message(body) or f"HTTP {response.code}"
    code = CONTEXT_LENGTH_EXCEEDED if response.code == 400 and says_context_length(body) else None
    return ProviderError(message, response.code, code, retry_after_sec=retry_after(response.headers, clock.seconds()))


# -- incremental parsers ------------------------------------------------------

_EOL = re.compile(rb"\r\n|\r|\n")


class SSEParser:
    """
    Server-sent events, fed in arbitrary pieces; yields each event's
    C{data} (its C{data:} lines joined by newlines). Only C{data} matters
    to OpenAI-style streams, so other fields are ignored.

    @raise ProviderError: for a line, or the data of one event, longer
        than C{JSON_BODY_LIMIT}, so a broken stream cannot grow the buffer
        without bound.
    """

    def __init__(self) -> None:
        self._buffer = _Partial()
        self._data: list[str] = []
        #: The bytes of the data lines in C{_data}.
        self._size = 0

    def feed(self, data: bytes) -> list[str]:
        """
        @return: the data strings of the events completed by C{data}.
        """
        if self._buffer.extend(data, b"\n" in data or b"\r" in data or self._buffer.ends_with_cr()):
            return []
        buf = self._buffer.take(data)
        events: list[str] = []
        pos = 0
        while True:
            match = _EOL.search(buf, pos)
            # A lone CR at the very end may be the first half of CRLF.
            if match is None or (match.group() == b"\r" and match.end() == len(buf)):
                break
            self._line(buf[pos : match.start()], events)
            pos = match.end()
        self._buffer.keep(buf[pos:])
        return events

    def finish(self) -> list[str]:
        """
        The body ended: be lenient and dispatch an unterminated last event
        (some servers omit the final blank line).
        """
        events: list[str] = []
        rest = self._buffer.take(b"")
        if rest:
            self._line(rest.rstrip(b"\r"), events)
        self._line(b"", events)
        return events

    def _line(self, raw: bytes, events: list[str]) -> None:
        if not raw:
            if self._data:
                events.append("\n".join(self._data))
                self._data = []
                self._size = 0
            return
        line = raw.decode("utf-8", "replace")
        if line.startswith(":"):
            return
        name, _, value = line.partition(":")
        if name == "data":
            self._size += len(raw) + 1
            if self._size > JSON_BODY_LIMIT:
                raise broken_answer(f"stream event larger than {JSON_BODY_LIMIT} bytes")
            self._data.append(value[1:] if value.startswith(" ") else value)


class NDJSONParser:
    """
    Newline-delimited JSON, fed in arbitrary pieces; yields parsed values.

    @raise ValueError: for a line that is not JSON.
    @raise ProviderError: for a line longer than C{JSON_BODY_LIMIT} (as
        L{SSEParser} does), so a broken stream cannot grow the buffer
        without bound.
    """

    def __init__(self) -> None:
        self._buffer = _Partial()

    def feed(self, data: bytes) -> list[Any]:
        if self._buffer.extend(data, b"\n" in data):
            return []
        lines = self._buffer.take(data).split(b"\n")
        self._buffer.keep(lines.pop())
        lines = [line for line in lines if line.strip()]
        if len(lines) > 1 and (values := jsontext.loads_each(lines)) is not None:
            return values
        # One line, or one that is not JSON (this raises for it).
        return [jsontext.loads(line) for line in lines]

    def finish(self) -> list[Any]:
        rest = self._buffer.take(b"")
        return [jsontext.loads(rest)] if rest.strip() else []


class _Partial:
    """
    The unterminated end of a stream's lines, at most C{JSON_BODY_LIMIT}
    bytes. Pieces that end no line are kept as they come and joined once
    one does, so a long line read piece by piece costs its bytes once, not
    once per piece.
    """

    def __init__(self) -> None:
        self._pieces: list[bytes] = []
        self._size = 0

    def extend(self, data: bytes, ends_a_line: bool) -> bool:
        """
        Keep C{data} if it ends no line (C{ends_a_line} false) and there is
        a line to go on: C{True}. Else C{False}: L{take} it.

        @raise ProviderError: the line is longer than C{JSON_BODY_LIMIT}.
        """
        if ends_a_line or not self._pieces:
            return False
        self._pieces.append(data)
        self._size += len(data)
        self._check()
        return True

    def ends_with_cr(self) -> bool:
        return bool(self._pieces) and self._pieces[-1].endswith(b"\r")

    def take(self, data: bytes) -> bytes:
        """
        What is kept, then C{data}, as one piece; nothing is kept after.
        """
        pieces, self._pieces, self._size = self._pieces, [], 0
        return b"".join([*pieces, data]) if pieces else data

    def keep(self, rest: bytes) -> None:
        """
        The unterminated end after the lines of a piece.

        @raise ProviderError: it is longer than C{JSON_BODY_LIMIT}.
        """
        if rest:
            self._pieces, self._size = [rest], len(rest)
            self._check()

    def _check(self) -> None:
        if self._size > JSON_BODY_LIMIT:
            self._pieces, self._size = [], 0
            raise broken_answer(f"stream line longer than {JSON_BODY_LIMIT} bytes")


def error_message(body: bytes) -> str:
    """
    The human-readable message in a provider's error body: OpenAI's
    C{{"error": {"message"}}}, vLLM's C{{"message"}}, Ollama's
    C{{"error": "..."}}, FastAPI's C{{"detail"}}; else the body text.
    """
    text = body.decode("utf-8", "replace").strip()
    try:
        data = jsontext.loads(text)
    except ValueError:
        return text
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        for value in (error, data.get("message"), data.get("detail")):
            if value:
                return value if isinstance(value, str) else json.dumps(value)
    return text


# -- a cancellable body reader -------------------------------------------------


class Reading(Enum):
    """
    What a body's chunk receiver may say of the answer after a chunk (a
    receiver that says nothing, C{None}, takes any body byte as the answer).
    """

    #: Body bytes, but not the answer yet (keep-alive comments, a role chunk).
    WAITING = "waiting"
    #: The answer began: the first-byte deadline is met.
    ANSWERING = "answering"
    #: The answer said it is finished (its end marker or finish reason).
    FINISHED = "finished"


#: What receives a response body's chunks, and may say how far the answer is.
ChunkReceiver = Callable[[bytes], Reading | None]

_T = TypeVar("_T")


class _BodyReader(Protocol):
    """
    Hands the body to C{on_chunk}; fires C{result} with the response when
    the body ends. An exception from C{on_chunk} closes the connection and
    fails C{result} once the connection is really done with, so that
    whoever waits on C{result} and then closes the pool finds it settled.

    With C{turns} (of the reactor the connection is read on), what arrives
    in one reactor turn is handed over at once, early in the next: a
    provider that writes a burst of events as many pieces is read as one
    piece, so the adapter parses, checks and relays it in one go instead
    of once per event. (The pool's L{iop.httpclient.ChunkedDecoder}
    already hands over a read's chunks together; over TLS a read still
    arrives one record, often one event, at a time.) The end of the body
    (whole or cut) hands over what is pending first; an aborted one drops
    it.
    """

    def __init__(
        self,
        on_chunk: ChunkReceiver,
        result: "defer.Deferred[IResponse]",
        response: IResponse,
        failure: Failure | None = None,
        turns: EndOfTurn | None = None,
    ) -> None:
        self.on_chunk = on_chunk
        self.result = result
        self.response = response
        self.failure = failure
        self.turns = turns
        #: What arrived in this reactor turn, not yet handed over.
        self.pending = bytearray()

    @property
    def body_transport(self) -> IPushProducer | None:
        """
        The body's transport, C{None} until C{deliverBody} connects this
        reader: the HTTP client's C{TransportProxyProducer}, a push
        producer (which the C{ITransport} that L{Protocol} declares does
        not say).
        """
        return cast("IPushProducer | None", self.transport)

    def dataReceived(self, data: bytes) -> None:
        if self.failure is not None or self.result.called:
            return
        if self.turns is None:
            self._hand_over(data)
            return
        if not self.pending:
            self.turns.at_end(self._deliver)
        self.pending += data

    def _deliver(self) -> None:
        # (Once at the end of the turn, and at the end of the body: the
        # second finds nothing pending.)
        data = bytes(self.pending)
        self.pending.clear()
        if data and self.failure is None and not self.result.called:
            self._hand_over(data)

    def _hand_over(self, data: bytes) -> None:
        try:
            self.on_chunk(data)
        except Exception:
            self.abort(Failure())

    def abort(self, failure: Failure | None = None) -> None:
        """
        Close the provider connection; C{result} will fail with C{failure}.
        """
        if failure is not None and self.failure is None:
            self.failure = failure
        if self.body_transport is not None:
            self.body_transport.stopProducing()

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self._deliver()
        if self.result.called:
            return
        if self.failure is not None:
            self.result.errback(self.failure)
        # PotentialDataLoss: a body delimited by the connection closing.
        elif reason.check(ResponseDone, PotentialDataLoss):
            self.result.callback(self.response)
        else:
            self.result.errback(reason)


@implementer(IPushProducer)
class _BodyProducer:
    """
    The C{IPushProducer} of one response body, for flow control: pausing
    stops reading the provider's connection (and the idle timeout with
    it, since silence is then ours); resuming reads on.
    """

    def __init__(self, pause: Callable[[], None], resume: Callable[[], None], stop: Callable[[], None]) -> None:
        self._pause = pause
        self._resume = resume
        self._stop = stop

    def pauseProducing(self) -> None:
        self._pause()

    def resumeProducing(self) -> None:
        self._resume()

    def stopProducing(self) -> None:
        self._stop()


class _Finished(Exception):
    """
    The answer said it was finished and its body did not end within
    L{FINISH_GRACE_SEC}: it is ended here, as complete.
    """


def read_body(
    request: "defer.Deferred[IResponse]",
    on_response: Callable[[IResponse], ChunkReceiver],
    deadlines: Deadlines | None = None,
    clock: IReactorTime | None = None,
    on_producer: Callable[[IPushProducer], object] | None = None,
    turns: EndOfTurn | None = None,
) -> "defer.Deferred[IResponse]":
    """
    Drive one unbuffered treq request to the end of its body.

    @param request: the Deferred from a treq request made with
        C{unbuffered=True}.
    @param on_response: called once with the response; returns the callable
        that receives each body chunk. It or that callable may raise to
        close the connection and fail the result. The chunk callable may
        say how far the answer is (L{Reading}): until it began, only the
        first-byte and idle deadlines run; once it said it is finished, if
        the body does not end within L{FINISH_GRACE_SEC} of its last byte,
        the connection is closed and the result fires as if it had ended,
        as it does when the connection is lost after that.
    @param deadlines: the L{Deadlines} of the request: when one passes the
        connection is closed and the result fails with L{ProviderStalled}
        (its C{deadline} saying which); C{None} waits forever.
    @param clock: the C{IReactorTime} for the deadlines.
    @param on_producer: called with an C{IPushProducer} of the body once
        it starts: pausing it stops reading the provider (flow control).
    @param turns: the L{EndOfTurn} of the reactor the provider connection
        is read on: body bytes that arrive in one of its turns reach
        C{on_response}'s callable as one piece, in the next (C{None}: each
        as it comes).
    @return: a Deferred firing with the response once the body ended.
        Cancelling it at any point closes the provider connection: before
        the headers by cancelling C{request}, after them by stopping the
        body's transport.
    """
    reader: _BodyReader | None = None
    cancelled = False
    stalled: Failure | None = None
    paused = False
    grace: IDelayedCall | None = None
    #: The answer is whole but the read is paused: the grace starts when
    #: reading resumes (what follows waits unread meanwhile).
    grace_due = False
    #: The chunk callable said the answer is finished.
    said_finished = False

    def cancel(result: "defer.Deferred[IResponse]") -> None:
        nonlocal cancelled
        cancelled = True
        if reader is None:
            request.cancel()
        else:
            reader.abort()

    result: defer.Deferred[IResponse] = defer.Deferred(cancel)

    def expired(kind: str, seconds: float) -> None:
        nonlocal stalled
        option = OPTION_NAMES[kind]
        stalled = Failure(ProviderStalled(f"provider missed {option} ({seconds:g}s); connection closed", deadline=kind))
        if reader is None:
            request.cancel()
        else:
            reader.abort(stalled)

    if deadlines is not None:
        assert clock is not None, "deadlines need a clock"
    watch = Watch(deadlines, clock, expired) if deadlines is not None and clock is not None else None

    def finished() -> None:
        nonlocal grace
        grace = None
        if reader is not None and not result.called:
            reader.abort(Failure(_Finished()))

    def settled(outcome: object) -> object:
        if watch is not None:
            watch.stop()
        if grace is not None and grace.active():
            grace.cancel()
        if isinstance(outcome, Failure) and reader is not None:
            # A connection lost once the answer said it is finished (the
            # end of its body, after [DONE], never came) lost nothing of
            # it: it ends as one that went silent then does.
            if outcome.check(_Finished) or (said_finished and outcome.check(ResponseFailed)):
                return reader.response
        return outcome

    def got_response(response: IResponse) -> None:
        nonlocal reader
        if watch is not None:
            watch.touch()
        failure = None
        on_chunk: ChunkReceiver | None
        try:
            on_chunk = on_response(response)
        except Exception:
            on_chunk, failure = None, Failure()

        def on_data(data: bytes) -> None:
            nonlocal grace, said_finished
            # Without a chunk callable the reader fails and reads nothing.
            assert on_chunk is not None
            if watch is not None and data:
                watch.touch()
            said = on_chunk(data)
            if watch is not None and data and said is not Reading.WAITING:
                watch.began()
            if said is Reading.FINISHED:
                said_finished = True
            if said is Reading.FINISHED and clock is not None:
                # The answer is whole: only the grace bounds what follows.
                if watch is not None:
                    watch.stop()
                start_grace()

        # deliverBody may hand over buffered data at once, so the chunk
        # callable must exist before it is called.
        reader = _BodyReader(on_data, result, response, failure, turns)
        response.deliverBody(reader)
        if failure is not None:
            reader.abort()
        elif on_producer is not None:
            on_producer(_BodyProducer(pause, resume, reader.abort))

    def start_grace() -> None:
        """
        Give what follows a whole answer (its usage, C{[DONE]})
        L{FINISH_GRACE_SEC} of reading: from now, or from when a paused
        read resumes (a slow caller is no silent provider).
        """
        nonlocal grace, grace_due
        assert clock is not None
        if grace is not None and grace.active():
            grace.cancel()
        grace = None
        grace_due = paused
        if not paused:
            grace = clock.callLater(FINISH_GRACE_SEC, finished)

    # pause and resume are only handed out (as a _BodyProducer) once the
    # reader exists.
    def pause() -> None:
        nonlocal paused, grace, grace_due
        assert reader is not None
        if paused or result.called:
            return
        paused = True
        if watch is not None:
            watch.pause()
        if grace is not None and grace.active():
            grace.cancel()
            grace, grace_due = None, True
        if reader.body_transport is not None:
            reader.body_transport.pauseProducing()

    def resume() -> None:
        nonlocal paused
        assert reader is not None
        if not paused or result.called:
            return
        paused = False
        if watch is not None:
            watch.resume()
        if grace_due:
            start_grace()
        if reader.body_transport is not None:
            reader.body_transport.resumeProducing()

    def request_failed(failure: Failure) -> None:
        # A cancelled request fails with whatever the Agent says; the
        # caller sees CancelledError from Deferred.cancel, or the stall.
        if result.called:
            return
        if stalled is not None:
            result.errback(stalled)
        elif not cancelled:
            result.errback(failure)

    result.addBoth(settled)
    request.addCallbacks(got_response, request_failed)
    return result


def as_provider_error(failure: Failure) -> Failure:
    """
    Errback: name connection failures as L{ProviderUnreachable} and a body
    cut short as L{ProviderError}; let everything else (notably
    C{CancelledError}) through unchanged.
    """
    if failure.check(ConnectError, DNSLookupError, ResponseNeverReceived, RequestTransmissionFailed):
        raise ProviderUnreachable(f"provider unreachable: {_reason(failure)}")
    if failure.check(ResponseFailed):
        raise broken_answer(f"provider connection lost mid-response: {_reason(failure)}")
    return failure


def _reason(failure: Failure) -> str:
    reasons = getattr(failure.value, "reasons", None)
    if reasons:
        return "; ".join(r.getErrorMessage() for r in reasons)
    return failure.getErrorMessage()


def capped_appender(buffer: bytearray, limit: int) -> Callable[[bytes], None]:
    """
    A chunk callable that keeps at most C{limit} bytes in C{buffer}.
    """

    def append(data: bytes) -> None:
        room = limit - len(buffer)
        if room > 0:
            buffer.extend(data[:room])

    return append


def response_headers(response: IResponse) -> HeaderPairs:
    """
    A response's headers as C{[(name, value)]} strings, minus hop-by-hop
    headers. Twisted's client keeps C{Content-Length} apart from the other
    headers (as C{response.length}); it is put back, last, when known.
    """
    pairs = header_pairs(response.headers)
    if response.length is not UNKNOWN_LENGTH:
        pairs.append(("Content-Length", str(response.length)))
    return relay_headers(pairs)


# -- the HTTP adapter base -----------------------------------------------------


class StreamDecoder(Shape):
    """
    What L{HTTPAdapter.stream_run} asks of a decoder (it may also have a
    C{finish_reason} and a C{began}, read when present).

    @ivar usage: the last usage the stream reported so far, or C{None}.
    @ivar finished: whether the answer said it is finished (its end
        marker, a finish reason, a whole JSON answer).
    """

    usage: Usage | None

    @property
    def finished(self) -> bool: ...

    def feed(self, data: bytes) -> None:
        """
        Emit the events that C{data} completes. @raise ProviderError: for
        a stream that cannot be read.
        """

    def finish(self) -> Usage | None:
        """
        The body ended: emit what is left. @return: the usage reported.
        """


class HTTPAdapter(AdapterBase):
    """
    An adapter whose back end is an HTTP server at C{base_url}.

    Options: C{base_url} (required), C{api_key} (sent as a bearer token),
    C{headers} (a mapping sent with every request), C{drop_headers} (a
    list of caller header names a tunnel does not forward), C{connect_timeout_sec}
    (default 10), the deadlines C{first_byte_timeout_sec} (default 120),
    C{stall_timeout_sec} (default 60) and C{idle_timeout_sec} (default 300;
    0 disables each: see L{iop.adapters.deadlines}), and C{continuation}
    (default false: whether the back end takes a partial answer as a final
    assistant message and continues it, which the Edge reads to continue a
    cut run on another provider).

    Connections are kept alive for a short while (2 s, below the 5 s idle
    timeout of uvicorn-based servers such as vLLM, so that we never send a
    request on a connection the server is closing); L{stop} closes them.
    """

    log = Logger()
    OPTIONS = AdapterBase.OPTIONS | {
        "base_url",
        "api_key",
        "headers",
        "drop_headers",
        "connect_timeout_sec",
        "continuation",
        *OPTION_NAMES.values(),
    }

    def __init__(self, name: str, max_concurrency: int, options: dict[str, Any] | None, reactor: Any) -> None:
        super().__init__(name, max_concurrency, options, reactor)
        base_url = self.option("base_url", kind=str, required=True)
        problem = http_url_problem(base_url)
        if problem is not None:
            raise AdapterConfigError(name, "base_url", problem)
        self.base_url: str = base_url.rstrip("/")
        self.api_key: str | None = self.option("api_key", None, str)
        self.extra_headers: dict[str, str] = self.option("headers", {}, dict)
        for key, value in self.extra_headers.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise AdapterConfigError(name, "headers", "must map strings to strings")
        self.drop_headers: list[str] = self.option("drop_headers", [], list)
        if not all(isinstance(h, str) for h in self.drop_headers):
            raise AdapterConfigError(name, "drop_headers", "must be a list of header names")
        timeout = self.option("connect_timeout_sec", 10, (int, float))
        if isinstance(timeout, bool) or timeout <= 0:
            raise AdapterConfigError(name, "connect_timeout_sec", "must be a positive number")
        self.deadlines = deadline_options(self.option, name)
        self.continuation: bool = self.option("continuation", False, bool)
        self.clock: IReactorTime = reactor
        #: The end of the turns of the reactor this adapter reads on (a
        #: body's bytes of one turn are read as one piece).
        self.turns = EndOfTurn(reactor)
        self.pool = LeanConnectionPool(reactor, persistent=True)
        self.pool.cachedConnectionTimeout = 2
        self.pool.maxPersistentPerHost = max_concurrency
        # A relay must never carry one caller's cookies into another's
        # request: a jar that accepts no cookie at all.
        jar = IndexableCookieJar(policy=DefaultCookiePolicy(allowed_domains=[]))
        self.agent = lean_agent(reactor, self.pool, timeout)
        self.http = HTTPClient(self.agent, cookiejar=jar, data_to_body_producer=body_producer)

    #: What the C{probe} command GETs (under C{base_url}).
    probe_path = "/models"

    def stop(self) -> "defer.Deferred[None]":
        closed: defer.Deferred[None] = self.pool.closeCachedConnections()
        return closed

    def capabilities(self) -> Capabilities:
        return Capabilities(
            max_concurrency=self.max_concurrency, commands=(PROBE_COMMAND,), continuation=self.continuation
        )

    def command(
        self, name: str, args: dict[str, Any], progress: Callable[[dict[str, Any]], None] | None = None
    ) -> "defer.Deferred[Any]":
        if name == PROBE_COMMAND:
            return self.probe()
        return super().command(name, args, progress)

    def assistant_prefix(self, run: RunInput) -> tuple[str | None, dict[str, Any]]:
        """
        The partial answer a run asks to continue (L{ASSISTANT_PREFIX_OPTION}),
        or C{None}, and the run's other options (the prefix is never sent
        as a provider parameter).
        """
        options = dict(run.options)
        prefix = options.pop(ASSISTANT_PREFIX_OPTION, None)
        return (prefix if isinstance(prefix, str) and prefix else None), options

    def url(self, path: str) -> str:
        """
        C{path} appended to C{base_url}.
        """
        return self.base_url + (path if path.startswith("/") else "/" + path)

    def default_headers(self) -> HeaderPairs:
        """
        The configured headers plus the bearer token, as C{[(name, value)]}.
        """
        pairs: HeaderPairs = list(self.extra_headers.items())
        if self.api_key and not any(name.lower() == "authorization" for name, _ in pairs):
            pairs.append(("Authorization", f"Bearer {self.api_key}"))
        return pairs

    def request(
        self, method: str, path: str, headers: Iterable[tuple[str, str]] | None = None, **kwargs: Any
    ) -> "defer.Deferred[IResponse]":
        """
        An unbuffered treq request to C{path}; C{headers} as pairs.
        """
        raw = _raw_headers(self.default_headers() if headers is None else headers)
        response = self.http.request(
            method, self.url(path), headers=raw, unbuffered=True, reactor=self.reactor, **kwargs
        )
        # (treq's response proxies IResponse; its Deferred is typed by the proxy.)
        return cast("defer.Deferred[IResponse]", response)

    def raw_request(
        self, method: str, path: str, headers: Iterable[tuple[str, str]], body: bytes = b""
    ) -> "defer.Deferred[IResponse]":
        """
        A request straight on the connection pool's C{Agent}, for a byte
        relay: no cookie handling and no content decoding (which would
        change the headers and body the provider sent), headers as given.
        """
        producer = BytesBody(body) if body else None
        return self.agent.request(
            method.encode("ascii"), self.url(path).encode("utf-8"), _raw_headers(headers), producer
        )

    def read(
        self,
        request: "defer.Deferred[IResponse]",
        on_response: Callable[[IResponse], ChunkReceiver],
        on_producer: Callable[[IPushProducer], object] | None = None,
        deadlines: Deadlines | None = None,
    ) -> "defer.Deferred[IResponse]":
        """
        L{read_body} with this adapter's deadlines, or C{deadlines}.
        """
        deadlines = self.deadlines if deadlines is None else deadlines
        return read_body(request, on_response, deadlines, self.clock, on_producer, self.turns)

    def fetch_json(self, method: str, path: str, payload: Any = None) -> "defer.Deferred[Any]":
        """
        A whole JSON response (C{None} for an empty body).

        @return: a cancellable Deferred; it fails with L{ProviderError} for
            a non-2xx status and L{ProviderUnreachable} when there was no
            response.
        """
        body = bytearray()
        kwargs: dict[str, Any] = {} if payload is None else {"json": payload}
        d = self.read(
            self.request(method, path, **kwargs),
            lambda response: capped_appender(body, JSON_BODY_LIMIT),
            deadlines=self.deadlines.not_streamed(),
        )

        def parse(response: IResponse) -> Any:
            if not 200 <= response.code < 300:
                raise status_error(response, bytes(body), self.clock)
            try:
                return jsontext.loads(bytes(body)) if body.strip() else None
            except ValueError:
                # The provider's answer, not ours to fail on: a broken one.
                raise broken_answer(f"provider answered with a body that is not JSON ({len(body)} bytes)") from None

        return d.addCallback(parse).addErrback(as_provider_error)

    def stream_run(
        self,
        path: str,
        payload: dict[str, Any],
        make_decoder: Callable[[IResponse, Emit], StreamDecoder],
        emit: Emit,
        run: RunInput | None = None,
    ) -> "defer.Deferred[None]":
        """
        POST C{payload} and turn the streamed answer into run events:
        C{start} with the first event of the answer (so that nothing
        reaches the caller before the answer does), whatever the decoder
        emits, then exactly one terminal: C{complete} with the decoder's
        usage, or C{error}. A failure before C{start} keeps its own code
        (the Edge may place the run again); after it, the run ends
        C{incomplete} with the usage so far, never like a success.

        @param make_decoder: called with the 2xx response and the C{emit}
            to use; returns an object with C{feed(bytes)} and C{finish()
            -> Usage | None}, both of which may raise L{ProviderError},
            C{usage} (the last usage reported, or C{None}), C{finished}
            (whether the answer said it is finished: its end marker or
            finish reason), optionally a C{finish_reason} for the
            C{complete} terminal, and optionally C{began}: whether the
            answer began though nothing of it was emitted yet (a tool call
            gathered in pieces), for the deadlines.
        @param run: the run, whose trace context (if any) goes to the
            provider as its C{traceparent} header.
        @return: a Deferred that fires when the run is over; cancelling it
            closes the provider connection and emits nothing more.
        """
        decoder: StreamDecoder | None = None
        error_body = bytearray()
        output = RunOutput(emit)

        def on_response(response: IResponse) -> ChunkReceiver:
            nonlocal decoder
            if not 200 <= response.code < 300:
                return capped_appender(error_body, ERROR_BODY_LIMIT)
            decoder = make_decoder(response, output)
            reading = decoder

            def feed(data: bytes) -> Reading:
                try:
                    reading.feed(data)
                finally:
                    output.flush()
                if reading.finished:
                    return Reading.FINISHED
                # (A tool call gathered in pieces is the answer before
                # anything of it is emitted.)
                began = output.started or getattr(reading, "began", False)
                return Reading.ANSWERING if began else Reading.WAITING

            return feed

        def ended(response: IResponse) -> None:
            if decoder is None:
                raise status_error(response, bytes(error_body), self.clock)
            usage = decoder.finish()
            if not decoder.finished:
                raise broken_answer("the stream ended before the answer said it was finished")
            output(RunEventData(COMPLETE, usage=usage, finish_reason=getattr(decoder, "finish_reason", None)))

        def failed(failure: Failure) -> None:
            failure.trap(ProviderError)
            assert isinstance(failure.value, ProviderError)
            output.flush()  # (the text a failing finish() decoded comes first)
            error = failure.value.incomplete() if output.started else failure.value
            self.log.info(
                "adapter {adapter} run failed: {code} {message}",
                adapter=self.name,
                code=error.code,
                message=error.message,
            )
            usage = decoder.usage if output.started and decoder is not None else None
            emit(RunEventData(ERROR, usage=usage, error=error.failure()))

        # An emit that does flow control pauses the provider read with it.
        headers = None
        if run is not None and run.traceparent:
            headers = [*self.default_headers(), ("traceparent", run.traceparent)]
        d = self.read(
            self.request("POST", path, headers=headers, json=payload),
            on_response,
            getattr(emit, "register_producer", None),
        )
        return d.addCallback(ended).addErrback(as_provider_error).addErrback(failed)

    def probe(self) -> "defer.Deferred[dict[str, Any]]":
        """
        The C{probe} node command: a cheap GET of L{probe_path} within
        L{PROBE_TIMEOUT_SEC}, answering C{{"ok": true}} when the provider
        answers 2xx, else C{{"ok": false, "reason": ...}}. The Edge sends
        it to learn whether an ejected provider is back.
        """
        d = self.fetch_json("GET", self.probe_path)
        timer = self.clock.callLater(PROBE_TIMEOUT_SEC, d.cancel)

        def answered(result: object) -> dict[str, Any]:
            return {"ok": True}

        def failed(failure: Failure) -> dict[str, Any] | Failure:
            error = failure.value
            if failure.check(defer.CancelledError):
                return {"ok": False, "reason": f"no answer within {PROBE_TIMEOUT_SEC:g}s"}
            if isinstance(error, ProviderError):
                return {"ok": False, "reason": f"{error.code}: {error.message}", "status": error.status}
            if failure.check(ValueError):
                return {"ok": False, "reason": "the answer is not JSON"}
            return failure

        def settled(result: _T) -> _T:
            if timer.active():
                timer.cancel()
            return result

        return d.addCallbacks(answered, failed).addBoth(settled)


#: How long a C{probe} waits for its answer.
PROBE_TIMEOUT_SEC = 5.0


class RunOutput:
    """
    The C{emit} a run's decoder is given: it sends C{start} just before the
    first event of the answer (the first byte the caller gets), and says
    whether it did.

    The text deltas a decoder emits while decoding one read are held and
    sent as one delta when the read is done (L{flush}), or before the
    next event that is not text of their kind: a burst of 64 events read
    in one piece makes one trip to the wire instead of 64 (the Node joins
    the deltas of a turn anyway, L{iop.node.joined}).
    """

    def __init__(self, emit: Emit) -> None:
        self.emit = emit
        self.started = False
        self._held = HeldDeltas(emit)

    def __call__(self, event: RunEventData) -> None:
        if not self.started and event.type != ERROR:
            self.started = True
            self.emit(RunEventData(START))
        self._held(event)

    def flush(self) -> None:
        """
        Send the text held, as one delta (the read is done).
        """
        self._held.flush()


def _raw_headers(pairs: Iterable[tuple[str | bytes, str | bytes]]) -> Headers:
    """
    C{[(name, value)]} (text or bytes) as Twisted C{Headers}, repeats kept.
    """
    raw = Headers()
    for name, value in pairs:
        raw.addRawHeader(_header_bytes(name), _header_bytes(value))
    return raw


def _header_bytes(value: str | bytes) -> bytes:
    if isinstance(value, bytes):
        return value
    try:
        return value.encode("latin-1")
    except UnicodeEncodeError:
        return value.encode("utf-8")
