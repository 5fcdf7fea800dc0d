"""
The body of a provider tunnel, between the provider's response and the
tunnel's sink: what is held, what is relayed when, and how a broken answer
ends.

The provider's bytes are relayed as they are, with three rules that make
an answer either whole or an explicit error:

  - an event stream (a 2xx C{text/event-stream}, not content-encoded) is
    relayed event by event, each checked: an event whose data is not JSON
    (nor C{[DONE]}) is never passed on, and ends the tunnel. Status and
    headers wait for the first event, so that a provider that fails before
    it (silence, a cut, a malformed first event) fails the tunnel before
    anything reached the caller, and the Edge may place it elsewhere.
    Comment-only events (keep-alives) before the first event with data are
    held with them: they are not the answer; but at most
    L{EARLY_COMMENTS_LIMIT} of them: beyond that the head and the comments
    go out (the tunnel can no longer fail over), so that a provider that
    sends only keep-alives cannot make the Node hold them all, and flow
    control pauses it like any other body;
  - any other body (a JSON answer, an error answer) is held whole, up to
    L{HOLD_LIMIT}, with its status and headers: it reaches the caller
    complete or not at all (a 2xx JSON answer that does not parse was cut,
    even if its connection seemed to end cleanly). A body larger than that
    is relayed as it comes once the limit is passed;
  - a failure once part of the body was relayed is C{incomplete} (the
    usage seen so far goes to the sink first); the Node ends the tunnel
    with an error frame after the body, and the Edge ends the caller's
    answer explicitly.

A stream is finished when it says so: C{[DONE]}, a finish reason, or a
Responses API end event. One that ends without saying so was cut. One
that sent an error object (C{{"error": ...}}) is relayed to its end too,
but ends the tunnel failed (C{incomplete}, with the error's message and
status), as the run of the same stream does.
"""

import re
from typing import Any, Protocol

from twisted.internet.interfaces import IReactorTime
from twisted.web.iweb import IResponse

from iop import jsontext
from iop.adapters.streams import (
    JSON_BODY_LIMIT,
    ProviderError,
    Reading,
    broken_answer,
    response_headers,
    status_error,
    stream_error,
)
from iop.run import CONTEXT_LENGTH_EXCEEDED, ITunnelSink, Usage

#: How much of a body that is not an event stream is held before it is
#: relayed (its status and headers with it): beyond this, it is relayed as
#: it comes and a cut can no longer be hidden from the caller.
HOLD_LIMIT = JSON_BODY_LIMIT

#: How many bytes of comment-only events an event stream may send before
#: its first event with data, held with its status and headers.
EARLY_COMMENTS_LIMIT = 64 * 1024

#: The Responses API events that end a stream.
RESPONSE_END_TYPES = frozenset({"response.completed", "response.incomplete", "response.failed", "error"})

_SEPARATORS = (b"\n\n", b"\r\n\r\n", b"\r\r")
#: An event's data line, and an event with more than one (LF line ends).
_DATA_LINE = re.compile(rb"^data: ?([^\n]*)", re.MULTILINE)
#: (Two patterns rather than one with C{^} and MULTILINE, which tries
#: every line start and costs about 2 us per event.)
_MULTI_DATA = re.compile(rb"\ndata:[^\n]*\ndata:")
_FIRST_MULTI_DATA = re.compile(rb"data:[^\n]*\ndata:")
_FINISH_SET = re.compile(rb'"finish_reason"\s*:\s*"')


def _tells(data: bytes) -> bool:
    """
    Whether an event can tell more than text (see L{_telling_offsets}).
    """
    return b'"usage"' in data or b'"type"' in data or b'"error"' in data or _FINISH_SET.search(data) is not None


def _telling_offsets(block: bytes) -> list[int]:
    """
    Where in a run of events there is what can tell more than text: usage,
    a type (Responses API), an error, a finish reason that is set. (Byte
    searches: one regular expression with alternatives is many times
    slower.)
    """
    offsets = [match.start() for match in _FINISH_SET.finditer(block)]
    for word in (b'"usage"', b'"type"', b'"error"'):
        at = block.find(word)
        while at >= 0:
            offsets.append(at)
            at = block.find(word, at + 1)
    return offsets


def _last_end(data: bytes | bytearray, start: int) -> int:
    """
    Where the last whole event in C{data} (from C{start}) ends, just after
    its blank line; -1 for none. CR line ends are looked for only when
    there is a CR.
    """
    end = data.rfind(b"\n\n", start)
    cut = end + 2 if end >= 0 else -1
    if data.find(b"\r", start) >= 0:
        for separator in (b"\r\n\r\n", b"\r\r"):
            end = data.rfind(separator, start)
            if end >= 0:
                cut = max(cut, end + len(separator))
    return cut


def _split(block: bytes) -> list[bytes]:
    """
    A run of whole events, one by one (each with its blank line).
    """
    events = []
    start = 0
    while start < len(block):
        ends = [(i, len(sep)) for sep in _SEPARATORS if (i := block.find(sep, start)) >= 0]
        if not ends:
            events.append(block[start:])
            break
        index, size = min(ends)
        events.append(block[start : index + size])
        start = index + size
    return events


#: The modes of a body (see the module docstring).
EVENTS = "events"
HOLD = "hold"
PASS = "pass"


class Observer(Protocol):
    """
    What watches a 2xx body for usage and metadata (the OpenAI adapter's
    C{TunnelObserver}): fed raw bytes, or the parsed chunks of an event
    stream, and told when the body ended.
    """

    usage: Usage | None
    parsed_any: bool

    def feed(self, data: bytes) -> None: ...

    def chunk(self, chunk: dict[str, Any]) -> None: ...

    def finish(self) -> None: ...


def asks_stream(body: bytes) -> bool:
    """
    Whether a tunnelled request body asks for a streamed answer (its
    C{stream} is true): only such an answer has a first-byte deadline.
    """
    if b'"stream"' not in body or len(body) > JSON_BODY_LIMIT:
        return False
    try:
        payload = jsontext.loads(body)
    except ValueError:
        return False
    return isinstance(payload, dict) and payload.get("stream") is True


def failure_statuses(status: int) -> bool:
    """
    Whether an answer's status is the provider's failure to serve (5xx, 429).
    """
    return status >= 500 or status == 429


class TunnelBody:
    """
    One tunnel's body on its way to C{sink}; see the module docstring.

    @param observer: the L{iop.adapters.openai_compat.TunnelObserver} of a
        2xx answer (usage and metadata), or C{None}.
    @param strip_usage: leave out the usage-only event the caller did not
        ask for (the C{usage: always} option).
    @param clock: the C{IReactorTime} for an HTTP date in Retry-After.
    @ivar relayed: whether any body byte reached the sink.
    @ivar finished: whether the stream said it is finished.
    @ivar error: the L{ProviderError} of the first error object the stream
        sent, or C{None}: the tunnel ends failed with it.
    """

    def __init__(
        self,
        sink: ITunnelSink,
        response: IResponse,
        observer: Observer | None,
        strip_usage: bool,
        clock: IReactorTime,
    ) -> None:
        self.sink = sink
        self.response = response
        self.observer = observer
        self.strip_usage = strip_usage
        self.clock = clock
        self.relayed = False
        self.finished = False
        self.error: ProviderError | None = None
        #: An event with data came (comments alone are not the answer).
        self.answered = False
        #: Comment-only events before the answer, held with the status.
        self.early = bytearray()
        self.head_sent = False
        self.buffer = bytearray()
        #: How much of the buffer is known to hold no event's end (less
        #: the length of a separator, which may be split).
        self.searched = 0
        if 200 <= response.code < 300 and _event_stream(response):
            self.mode = EVENTS if _plain(response) else PASS
        else:
            self.mode = HOLD

    def feed(self, data: bytes) -> Reading | None:
        """
        Body bytes from the provider. @return: for an event stream, how
        far the answer is (L{Reading}); else C{None} (any byte is the
        answer). @raise ProviderError: for a malformed event.
        """
        if self.mode == EVENTS:
            self._events(self._whole_events(data))
            if len(self.buffer) > JSON_BODY_LIMIT:
                raise broken_answer(f"the provider sent an event larger than {JSON_BODY_LIMIT} bytes")
            if self.finished:
                return Reading.FINISHED
            return Reading.ANSWERING if self.answered else Reading.WAITING
        if self.observer is not None:
            self.observer.feed(data)
        if self.mode == HOLD:
            self.buffer.extend(data)
            if len(self.buffer) > HOLD_LIMIT:
                self.mode = PASS
                held, self.buffer = bytes(self.buffer), bytearray()
                self._relay(held)
            return None
        self._relay(data)
        return None

    def _events(self, events: bytes) -> None:
        """
        Relay whole, checked events: once the answer began, with the
        comments held before it.
        """
        if not self.answered and not self.head_sent:
            self.early.extend(events)
            if len(self.early) <= EARLY_COMMENTS_LIMIT:
                return
            events = b""
        early, self.early = bytes(self.early), bytearray()
        self._relay(early + events)

    def finish(self) -> None:
        """
        The body ended: relay what was held; report usage and metadata.

        @raise ProviderError: for an event stream that ended without
            saying it was finished (cut), or a malformed last event.
        """
        if self.mode == EVENTS:
            rest, self.buffer = bytes(self.buffer), bytearray()
            # Some servers omit the blank line after the last event.
            self._events(self._checked(rest) if rest.strip() else b"")
            if self.error is not None:
                raise self.error
            if not self.finished:
                raise broken_answer("the stream ended before the answer said it was finished")
        elif self.mode == HOLD:
            held, self.buffer = bytes(self.buffer), bytearray()
            if self._json_cut(held):
                raise broken_answer("the answer is not whole JSON (its end was lost)")
            self._release_head(held)
            self._relay(held)
        self._release_head(b"")
        if self.observer is not None:
            self.observer.finish()

    def _json_cut(self, held: bytes) -> bool:
        """
        Whether a held 2xx JSON answer is not whole: a body delimited by
        the connection's end (no length, not chunked) cut short looks like
        one that ended.
        """
        if not 200 <= self.response.code < 300 or not held.strip() or not _plain(self.response):
            return False
        content_type = b",".join(self.response.headers.getRawHeaders(b"content-type", [])).lower()
        if b"json" not in content_type:
            return False
        try:
            jsontext.loads(held)
        except ValueError:
            return True
        return False

    def failed(self, error: ProviderError) -> ProviderError:
        """
        The answer broke (cut, stalled, malformed) with C{error}.

        @return: the failure to end the tunnel with: C{error} itself when
            nothing was relayed yet (nothing reached the caller, and the
            status and headers were never sent), else C{incomplete}, after
            the usage seen so far went to the sink.
        """
        if self.error is not None:
            error = self.error  # (what the provider said of it tells more)
        if not self.relayed:
            return error
        if self.observer is not None and self.observer.usage is not None:
            self.sink.usage(self.observer.usage)
        return error.incomplete()

    def _whole_events(self, data: bytes) -> bytes:
        """
        The whole events at the head of what was held and C{data},
        checked; the rest is held. The common case (nothing held, C{data}
        ends with an event) takes no copy; the part of the buffer already
        searched is not searched again (an event may come in many pieces).
        """
        if not self.buffer:
            cut = _last_end(data, 0)
            if cut == len(data):
                return self._block(data)
            self.buffer.extend(data)
        else:
            self.buffer.extend(data)
            cut = _last_end(self.buffer, self.searched)
        if cut < 0:
            self.searched = max(0, len(self.buffer) - 3)
            return b""
        block = bytes(self.buffer[:cut])
        del self.buffer[:cut]
        self.searched = max(0, len(self.buffer) - 3)
        return self._block(block)

    def _block(self, block: bytes) -> bytes:
        """
        A run of whole events, checked, as it is relayed. The common case
        (LF line ends, one data line per event, nothing to take out) is
        checked in one JSON parse of all its events, without splitting it;
        any other goes event by event.
        """
        if not self.strip_usage and block.startswith(b"data:") and block.find(b"\n") == len(block) - 2:
            return self._one(block)
        if self.strip_usage or b"\r" in block or _MULTI_DATA.search(block) or _FIRST_MULTI_DATA.match(block):
            return self._each(block)
        payloads = _DATA_LINE.findall(block)
        if not payloads:
            return block
        self.answered = True
        if b"[DONE]" in block:
            # (null in its place keeps the parsed events in line with them.)
            done = [p.strip() == b"[DONE]" for p in payloads]
            payloads = [b"null" if end else p for p, end in zip(payloads, done, strict=True)]
            if any(done):
                self.finished = True
        chunks = jsontext.loads_each(payloads)
        if chunks is None:
            # One of them is malformed: find which (it raises).
            return self._each(block)
        # Only the first event (the model) and those that can tell
        # anything are looked at: text deltas, the bulk of a stream, say
        # none of it.
        telling = _telling_offsets(block)
        first = self.observer is not None and not self.observer.parsed_any
        if telling or first:
            # The event an offset is in: the data lines that begin before it.
            lead = 1 if block.startswith(b"data:") else 0
            wanted = {lead + block.count(b"\ndata:", 0, offset) - 1 for offset in telling}
            if first:
                wanted.add(0)
            for index in sorted(wanted):
                chunk = chunks[index] if index >= 0 else None
                if isinstance(chunk, dict):
                    self._chunk(chunk)
        return block

    def _one(self, event: bytes) -> bytes:
        """
        One event of one data line (LF line ends): what a paced provider
        sends in each read, checked without the patterns a run needs.
        """
        payload = event[5:-2].removeprefix(b" ")
        self.answered = True
        if payload.strip() == b"[DONE]":
            self.finished = True
            return event
        chunks = jsontext.loads_each([payload])
        if chunks is None:
            return self._each(event)  # (it raises, as the slow path says)
        chunk = chunks[0]
        if isinstance(chunk, dict) and (
            (self.observer is not None and not self.observer.parsed_any) or _tells(payload)
        ):
            self._chunk(chunk)
        return event

    def _each(self, block: bytes) -> bytes:
        """
        A run of whole events checked one by one. The events before a
        malformed one are relayed before it raises: what reaches the caller
        does not depend on how the provider's bytes were split into reads.
        """
        relayed = []
        for event in _split(block):
            try:
                relayed.append(self._checked(event))
            except ProviderError:
                self._events(b"".join(relayed))
                raise
        return b"".join(relayed)

    def _checked(self, event: bytes) -> bytes:
        """
        One whole event as it is relayed (C{b""} for a usage-only event the
        caller did not ask for). @raise ProviderError: if malformed.
        """
        data = [line[5:].removeprefix(b" ") for line in event.splitlines() if line.startswith(b"data:")]
        if not data:
            return event
        self.answered = True
        text = b"\n".join(data)
        if text.strip() == b"[DONE]":
            self.finished = True
            return event
        try:
            chunk = jsontext.loads(text)
        except ValueError:
            raise broken_answer(f"the provider sent an event that is not JSON ({len(text)} bytes)") from None
        if not isinstance(chunk, dict):
            return event
        self._chunk(chunk)
        if self.strip_usage and chunk.get("choices") == [] and chunk.get("usage"):
            return b""
        return event

    def _chunk(self, chunk: dict[str, Any]) -> None:
        """
        One parsed event: to the observer, and whether it says finished.
        """
        if self.observer is not None:
            self.observer.chunk(chunk)
        error = _in_band_error(chunk)
        if error is not None and self.error is None:
            self.error = stream_error(error)
        if _says_finished(chunk):
            self.finished = True

    def _relay(self, data: bytes) -> None:
        if not data:
            return
        self._release_head(data)
        self.relayed = True
        self.sink.body(data)

    def _release_head(self, body: bytes) -> None:
        """
        Status and headers, once: with the first body bytes, or at the end.
        A held failure answer (5xx, 429, a context-length 400) also says
        what failure it is, as a C{failure} metadata observation.
        """
        if self.head_sent:
            return
        self.head_sent = True
        self.sink.status(self.response.code)
        self.sink.headers(response_headers(self.response))
        if self.mode == HOLD and not 200 <= self.response.code < 300:
            error = status_error(self.response, body, self.clock)
            if failure_statuses(error.status) or error.code == CONTEXT_LENGTH_EXCEEDED:
                self.sink.metadata({"failure": _failure_json(error)})


def _failure_json(error: ProviderError) -> dict[str, Any]:
    failure: dict[str, Any] = {"code": error.code, "status": error.status, "message": error.message[:500]}
    if error.retry_after_sec:
        failure["retry_after_sec"] = error.retry_after_sec
    return failure


def _in_band_error(chunk: dict[str, Any]) -> object | None:
    """
    The error a parsed event says the answer ended with, or C{None}: an
    C{error} object (chat completions, vLLM), the Responses API's C{error}
    event (its message and code at the top) or its C{response.failed}
    (the error under C{response}).
    """
    error = chunk.get("error")
    if error:
        return error
    kind = chunk.get("type")
    if kind == "error":
        return {"message": chunk.get("message") or "the provider sent an error event", "code": chunk.get("code")}
    if kind == "response.failed":
        response = chunk.get("response")
        failed = response.get("error") if isinstance(response, dict) else None
        return failed or {"message": "the provider's response failed"}
    return None


def _says_finished(chunk: dict[str, Any]) -> bool:
    """
    Whether a parsed event says the answer is finished (an error object
    does: nothing follows it); values of the wrong type say nothing.
    """
    kind = chunk.get("type")
    if chunk.get("error") or (isinstance(kind, str) and kind in RESPONSE_END_TYPES):
        return True
    choices = chunk.get("choices")
    if not isinstance(choices, list):
        return False
    return any(isinstance(c, dict) and isinstance(c.get("finish_reason"), str) for c in choices)


def _event_stream(response: IResponse) -> bool:
    content_type = b",".join(response.headers.getRawHeaders(b"content-type", [])).lower()
    return b"event-stream" in content_type


def _plain(response: IResponse) -> bool:
    coding = b",".join(response.headers.getRawHeaders(b"content-encoding", [])).strip().lower()
    return coding in (b"", b"identity")
