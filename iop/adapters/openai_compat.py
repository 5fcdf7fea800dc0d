"""
The C{openai_compat} back end: any server speaking OpenAI's chat
completions API (vLLM, llama.cpp, LM Studio, Ollama's /v1, hosted APIs).

Two paths, on purpose:

  - C{execute} normalizes a streamed chat completion into run events, for
    callers of the native surface and for non-OpenAI callers.
  - C{tunnel} relays the provider's own bytes untouched, so that an OpenAI
    caller gets exactly what the provider said; usage and metadata are
    only observed on the side, never re-encoded into the body.
"""

import json
import re
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Self

from twisted.internet.defer import Deferred
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.iweb import IResponse
from zope.interface import implementer

from iop import jsontext
from iop.adapters.interface import AdapterConfigError, Capabilities, Emit, IAdapter, RunInput, TunnelInput
from iop.adapters.relay import TunnelBody, asks_stream
from iop.adapters.streams import (
    JSON_BODY_LIMIT,
    ChunkReceiver,
    HTTPAdapter,
    ProviderError,
    SSEParser,
    as_provider_error,
    broken_answer,
    reported_count,
    stream_error,
)
from iop.httpheaders import provider_request_headers
from iop.run import DELTA, REASONING_DELTA, TOOL_CALL, ITunnelSink, RunEventData, ToolCall, Usage, clean_text

#: Where a parsed chat completion chunk (a JSON object) goes.
ChunkHandler = Callable[[dict[str, Any]], None]
#: Whether a streamed event's text is worth parsing.
Wanted = Callable[[str], bool]


def _count(value: object) -> int | None:
    """
    A reported token count, or C{None} when it was not reported (or not
    as a count: see L{reported_count}).
    """
    return reported_count(value)


def openai_message(message: dict[str, Any]) -> dict[str, Any]:
    """
    A run's chat message back in OpenAI's form: images as C{image_url}
    parts beside the text, and C{name}, C{tool_call_id}, C{tool_calls} as
    they came.
    """
    result: dict[str, Any] = {"role": message["role"], "content": message.get("content") or ""}
    if message.get("images"):
        parts = [{"type": "text", "text": result["content"]}] if result["content"] else []
        parts += [{"type": "image_url", "image_url": {"url": url}} for url in message["images"]]
        result["content"] = parts
    for key in ("name", "tool_call_id", "tool_calls"):
        if message.get(key):
            result[key] = message[key]
    return result


#: A streamed chunk that says "not finished yet".
_NULL_FINISH = re.compile(r'"finish_reason"\s*:\s*null')
#: Streamed chunks, one of which says "finished" (a finish reason that is
#: a string, not null).
_FINISH_SET = re.compile(rb'"finish_reason"\s*:\s*"')


def usage_from(data: object) -> Usage | None:
    """
    An OpenAI C{usage} object as a L{Usage}, or C{None}.

    The breakdown (C{completion_tokens_details.reasoning_tokens},
    C{prompt_tokens_details.cached_tokens}) is kept only when reported:
    absent stays C{None}, never 0.
    """
    if not isinstance(data, dict):
        return None
    completion = data.get("completion_tokens_details")
    prompt = data.get("prompt_tokens_details")
    return Usage(
        input_tokens=_count(data.get("prompt_tokens")) or 0,
        output_tokens=_count(data.get("completion_tokens")) or 0,
        reasoning_tokens=_count(completion.get("reasoning_tokens")) if isinstance(completion, dict) else None,
        cached_input_tokens=_count(prompt.get("cached_tokens")) if isinstance(prompt, dict) else None,
    )


def _wrong_shape(name: str, kind: str) -> ProviderError:
    """
    The failure of a chunk that is JSON, but whose C{name} is not a C{kind}.
    """
    return broken_answer(f"provider sent a chunk whose {name} is not {kind}")


class ChatResponse:
    """
    The framing of a chat completion response: SSE chunks when streamed,
    one JSON document otherwise. Calls C{on_chunk(dict)} for each chunk
    (a streamed C{chat.completion.chunk} or the whole C{chat.completion}).

    @raise ProviderError: for data that is not JSON.
    """

    def __init__(self, on_chunk: ChunkHandler, content_type: str, wanted: Wanted | None = None) -> None:
        self.on_chunk = on_chunk
        self.wanted = wanted
        self.sse: SSEParser | None = SSEParser() if "event-stream" in content_type else None
        self.body = bytearray()
        #: C{[DONE]} came, or the one JSON document was read whole.
        self.done = False

    @classmethod
    def for_response(cls, on_chunk: ChunkHandler, response: IResponse, wanted: Wanted | None = None) -> Self:
        """
        @param wanted: when given, C{wanted(payload)} says whether a
            streamed event's text needs parsing at all (a cheap check that
            spares a JSON parse of every event).
        """
        content_type = b",".join(response.headers.getRawHeaders(b"content-type", [])).decode("latin-1")
        return cls(on_chunk, content_type.lower(), wanted)

    def feed(self, data: bytes) -> None:
        if self.sse is None:
            if len(self.body) + len(data) > JSON_BODY_LIMIT:
                raise broken_answer(f"response body larger than {JSON_BODY_LIMIT} bytes")
            self.body.extend(data)
            return
        wanted = self.wanted
        for payload in self.sse.feed(data):
            if wanted is None or wanted(payload):
                self._payload(payload)

    def finish(self) -> None:
        if self.sse is None:
            if self.body.strip():
                self._payload(bytes(self.body).decode("utf-8", "replace"))
                self.done = True
            return
        for payload in self.sse.finish():
            self._payload(payload)

    def _payload(self, payload: str) -> None:
        if self.done:
            return
        if payload.strip() == "[DONE]":
            self.done = True
            return
        try:
            chunk = jsontext.loads(payload)
        except ValueError:
            # Its text is not repeated: what is malformed never reaches the caller.
            raise broken_answer(f"provider sent data that is not JSON ({len(payload)} characters)") from None
        if isinstance(chunk, dict):
            self.on_chunk(chunk)


class ChatEvents:
    """
    Decoder for L{HTTPAdapter.stream_run}: chunks to C{delta} and
    C{reasoning_delta} events; remembers the last usage reported. Tool calls
    and finish reasons are cleaned of lone surrogates (L{clean_text}; the
    Node cleans text deltas once joined); a chunk of the wrong shape
    (C{choices} not a list, a C{delta} not an object) is a broken answer.

    @ivar began: whether a piece of a tool call came: the answer began,
        though the call is emitted only at the end.
    """

    def __init__(self, emit: Emit, response: IResponse) -> None:
        self.emit = emit
        self.usage: Usage | None = None
        self.finish_reason: str | None = None
        self.began = False
        self.calls: dict[int, _PendingCall] = {}  # by index, as they stream in
        self._call_chars = 0
        self.framing = ChatResponse.for_response(self.chunk, response)
        #: Whether a chunk with C{choices} came (a whole answer must have them).
        self._choices = False

    @property
    def finished(self) -> bool:
        """
        Whether the answer said it is finished: C{[DONE]}, a finish
        reason, or a whole JSON answer.
        """
        return self.framing.done or self.finish_reason is not None

    @classmethod
    def for_run(cls, response: IResponse, emit: Emit) -> Self:
        """
        The decoder of L{HTTPAdapter.stream_run}.
        """
        return cls(emit, response)

    def feed(self, data: bytes) -> None:
        self.framing.feed(data)

    def finish(self) -> Usage | None:
        """
        The stream ended: the tool calls streamed in pieces are emitted
        whole, in index order, when the answer said it is finished; one
        that ended without saying so was cut, and a call cut short is never
        passed on (L{HTTPAdapter.stream_run} fails the run).
        @return: the usage reported, if any.
        """
        self.framing.finish()
        if self.framing.sse is None and not self._choices:
            # A 200 whose JSON is no chat completion ({}, null, a
            # framework's {"detail": ...}) is the provider's failure, not
            # an empty answer.
            raise broken_answer("provider answered with JSON that is not a chat completion (no choices)")
        if not self.finished:
            return self.usage
        for index in sorted(self.calls):
            call = self.calls[index]
            # (Cleaned once joined: a character may be split between pieces.)
            tool_call = ToolCall(
                clean_text(call.id) or f"call_{index}",
                clean_text("".join(call.name)),
                clean_text("".join(call.arguments)) or "{}",
            )
            self.emit(RunEventData(TOOL_CALL, tool_call=tool_call))
        return self.usage

    def chunk(self, chunk: dict[str, Any]) -> None:
        if "error" in chunk and chunk["error"]:
            raise stream_error(chunk["error"])
        usage = usage_from(chunk.get("usage"))
        if usage is not None:
            self.usage = usage
        choices = chunk.get("choices") or []
        if not isinstance(choices, list):
            raise _wrong_shape("choices", "a list")
        self._choices = self._choices or "choices" in chunk
        for choice in choices:
            # A run is one stream of text: other choices (n > 1) are dropped.
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            part = choice.get("delta") or choice.get("message") or {}
            if not isinstance(part, dict):
                raise _wrong_shape("delta", "an object")
            # vLLM and DeepSeek say reasoning_content; newer servers say reasoning.
            reasoning = part.get("reasoning_content") or part.get("reasoning")
            if isinstance(reasoning, str) and reasoning:
                # (Text is cleaned by the Node once a turn's is joined, so
                # that a character cut between two chunks comes out whole.)
                self.emit(RunEventData(REASONING_DELTA, text=reasoning))
            content = part.get("content")
            if isinstance(content, str) and content:
                self.emit(RunEventData(DELTA, text=content))
            # A model's refusal (OpenAI's structured outputs) is its answer's
            # text: a run has no other place for it.
            refusal = part.get("refusal")
            if isinstance(refusal, str) and refusal:
                self.emit(RunEventData(DELTA, text=refusal))
            calls = part.get("tool_calls") or []
            if not isinstance(calls, list):
                raise _wrong_shape("tool_calls", "a list")
            for position, call in enumerate(calls):
                self._tool_call_piece(call, position)
            # Only a string is a finish reason (anything else is not sent on).
            reason = choice.get("finish_reason")
            if isinstance(reason, str) and reason:
                self.finish_reason = clean_text(reason)

    def _tool_call_piece(self, call: object, position: int) -> None:
        """
        One tool call, or a piece of one (a streamed delta carries its id
        and name first, then its arguments in pieces, keyed by index).
        """
        if not isinstance(call, dict):
            return
        self.began = True
        index = call.get("index")
        if not isinstance(index, int) or isinstance(index, bool):
            index = position
        entry = self.calls.get(index)
        if entry is None:
            if len(self.calls) >= MAX_TOOL_CALLS:
                raise broken_answer(f"provider streamed more than {MAX_TOOL_CALLS} tool calls")
            entry = self.calls[index] = _PendingCall()
        function = call.get("function")
        if not isinstance(function, dict):
            function = {}
        call_id = call.get("id")
        if isinstance(call_id, str):
            # (An id is held until the end as names and arguments are; one
            # sent again with every piece replaces itself: only what it
            # grows by counts.)
            self._count_call_chars(call_id[len(entry.id) :])
            entry.id = call_id
        for pieces, piece in ((entry.name, function.get("name")), (entry.arguments, function.get("arguments"))):
            if isinstance(piece, str) and piece:
                self._count_call_chars(piece)
                pieces.append(piece)

    def _count_call_chars(self, text: str) -> None:
        """
        Count C{text}, kept for a tool call until the answer ends, toward
        L{MAX_TOOL_CALL_CHARS}, so that what a stream makes us hold is
        bounded whichever part of the calls it comes in.

        @raise ProviderError: the calls exceed it (a broken answer).
        """
        self._call_chars += len(text)
        if self._call_chars > MAX_TOOL_CALL_CHARS:
            raise broken_answer(f"provider's tool calls exceed {MAX_TOOL_CALL_CHARS} characters")


#: The most characters of tool calls (ids, names and arguments) one answer
#: may stream: what a wire frame carries whatever their UTF-8 (16 MiB / 4).
MAX_TOOL_CALL_CHARS = 4 * 1024 * 1024
#: The most tool calls one streamed answer may make: each is held until
#: the answer ends, even one that brings no character (a bare index).
MAX_TOOL_CALLS = 4096


@dataclass
class _PendingCall:
    """
    A streamed tool call being put together: its pieces, joined once at
    the end (joining as they come is quadratic in a long call).
    """

    id: str = ""
    name: list[str] = field(default_factory=list)
    arguments: list[str] = field(default_factory=list)


class TunnelObserver:
    """
    Watches a relayed 2xx body for usage and metadata without touching it.
    Parse trouble is logged and observation stops: the relay never fails
    because of what we could not read. A gzip body (the caller asked for
    it) is inflated for reading only; another content coding is not read.
    """

    log = Logger()

    def __init__(self, sink: ITunnelSink, response: IResponse) -> None:
        self.sink = sink
        self.usage: Usage | None = None
        self.metadata: dict[str, Any] = {}
        self.broken = False
        self.parsed_any = False
        self.tail = b""  # a streamed event not complete yet
        self.framing = ChatResponse.for_response(self.chunk, response, self.wanted)
        self.inflate: zlib._Decompress | None = None
        coding = b",".join(response.headers.getRawHeaders(b"content-encoding", [])).strip().lower()
        if coding == b"gzip":
            self.inflate = zlib.decompressobj(16 + zlib.MAX_WBITS)
        elif coding not in (b"", b"identity"):
            self.broken = True
            self.log.info("tunnel body encoded as {coding}: usage not observed", coding=coding.decode("latin-1"))

    def wanted(self, payload: str) -> bool:
        """
        Whether a streamed event can tell anything not yet known: the model
        (the first event says it), usage, or a finish reason that is not
        null. Text deltas, the bulk of a stream, are passed over unparsed.
        """
        if "usage" in payload or not self.parsed_any:
            return True
        return '"finish_reason"' in payload and _NULL_FINISH.search(payload) is None

    def feed(self, data: bytes) -> None:
        if self.broken:
            return  # (nothing more is read, nor held)
        if self.inflate is not None:
            try:
                data = self.inflate.decompress(data)
            except zlib.error as e:
                self._stop(f"gzip: {e}")
                return
        if self.framing.sse is None:
            self._guard(self.framing.feed, data)
            return
        # A stream: only whole events are looked at, and a run of them that
        # has neither usage nor a finish reason (nor the first event) is
        # passed over by a byte search, never split into events.
        data = self.tail + data
        lf, crlf = data.rfind(b"\n\n"), data.rfind(b"\r\n\r\n")
        cut = max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)
        if not cut:
            if len(data) > JSON_BODY_LIMIT:
                self._stop(f"an event longer than {JSON_BODY_LIMIT} bytes")
                return
            self.tail = data
            return
        events, self.tail = data[:cut], data[cut:]
        if not self.parsed_any or b'"usage"' in events or _FINISH_SET.search(events):
            self._guard(self.framing.feed, events)

    def finish(self) -> None:
        """
        Report what was seen: the last usage, then model and finish reason.
        """
        if self.tail:
            self._guard(self.framing.feed, self.tail)
            self.tail = b""
        self._guard(self.framing.finish)
        if self.usage is not None:
            self.sink.usage(self.usage)
        if self.metadata:
            self.sink.metadata(dict(self.metadata))

    def _guard(self, method: Callable[..., None], *args: bytes) -> None:
        if self.broken:
            return
        try:
            method(*args)
        except ProviderError as e:
            self._stop(e.message)

    def _stop(self, why: str) -> None:
        """
        Observation stops (what was seen so far is still reported).
        """
        self.broken = True
        self.tail = b""
        self.log.info("tunnel body not observable, usage not reported: {why}", why=why)

    def chunk(self, chunk: dict[str, Any]) -> None:
        """
        One parsed chunk: what it says of usage, model and finish reason.
        Values of the wrong type are passed over, never a failure.
        """
        self.parsed_any = True
        usage = usage_from(chunk.get("usage"))
        if usage is not None:
            self.usage = usage
        model = chunk.get("model")
        if isinstance(model, str):
            self.metadata["model"] = clean_text(model)
        choices = chunk.get("choices")
        if not isinstance(choices, list):
            return
        for choice in choices:
            reason = choice.get("finish_reason") if isinstance(choice, dict) else None
            if isinstance(reason, str) and reason:
                self.metadata["finish_reason"] = clean_text(reason)


#: The values of the C{usage} option.
USAGE_ALWAYS = "always"
USAGE_AS_ASKED = "as_asked"


def with_usage(body: bytes) -> bytes | None:
    """
    The body of a streamed chat completion asking for usage
    (C{stream_options.include_usage}) when the caller did not ask for it
    itself, or C{None} when there is nothing to add (not streamed, already
    asked for, not a JSON object).
    """
    try:
        payload = jsontext.loads(body)
    except ValueError:
        return None
    if not isinstance(payload, dict) or payload.get("stream") is not True:
        return None
    options = payload.get("stream_options")
    if options is not None and not isinstance(options, dict):
        return None
    if options and options.get("include_usage"):
        return None
    payload["stream_options"] = dict(options or {}, include_usage=True)
    return json.dumps(payload).encode("utf-8")


@implementer(IAdapter)
class OpenAICompatAdapter(HTTPAdapter):
    """
    Options: C{base_url} (for example C{http://127.0.0.1:8000/v1}),
    C{api_key}, C{headers}, C{connect_timeout_sec}, and C{usage}:
    C{as_asked} (default: a tunnel carries the caller's request as it is)
    or C{always} (a streamed chat completion tunnelled for a caller who
    did not ask for usage asks the provider for it, so that its tokens are
    counted, and the usage chunk is taken out of what the caller gets).
    """

    type = "openai_compat"
    OPTIONS = HTTPAdapter.OPTIONS | {"usage"}

    def __init__(self, name: str, max_concurrency: int, options: dict[str, Any] | None, reactor: Any) -> None:
        super().__init__(name, max_concurrency, options, reactor)
        self.usage_mode: str = self.option("usage", USAGE_AS_ASKED, str)
        if self.usage_mode not in (USAGE_AS_ASKED, USAGE_ALWAYS):
            raise AdapterConfigError(
                name, "usage", f"must be {USAGE_AS_ASKED} or {USAGE_ALWAYS}, got {self.usage_mode!r}"
            )

    def capabilities(self) -> Capabilities:
        return replace(super().capabilities(), tunnel=True)

    def chat_payload(self, run: RunInput) -> dict[str, Any]:
        """
        The streamed chat completion request for C{run}. Generation options
        pass through, but never replace the model, the messages or
        streaming; usage reporting is always asked for.
        """
        prefix, payload = self.assistant_prefix(run)
        messages = [openai_message(m) for m in run.messages]
        if prefix is not None:
            messages.append({"role": "assistant", "content": prefix})
            payload.update(self.continue_options())
        stream_options = payload.get("stream_options")
        stream_options = dict(stream_options) if isinstance(stream_options, dict) else {}
        stream_options["include_usage"] = True
        payload.update(model=run.target, messages=messages, stream=True, stream_options=stream_options)
        return payload

    def continue_options(self) -> dict[str, Any]:
        """
        Request keys that make the server continue a final assistant
        message rather than answer after it: none for a generic server.
        """
        return {}

    def execute(self, run: RunInput, emit: Emit) -> "Deferred[None]":
        return self.stream_run("/chat/completions", self.chat_payload(run), ChatEvents.for_run, emit, run)

    def tunnel(self, request: TunnelInput, sink: ITunnelSink) -> "Deferred[None]":
        """
        Relay C{request} to the provider and its response into C{sink}:
        C{status}, C{headers}, then the body chunks exactly as received,
        held and checked as L{iop.adapters.relay} says. Usage and metadata
        are reported when the body ends.

        @return: a Deferred firing when the body ended; it fails with
            L{ProviderUnreachable} when there was no response, with a
            L{ProviderError} when the answer broke (C{incomplete} once part
            of it was relayed), and cancelling it closes the provider
            connection.
        """
        headers = provider_request_headers(request.headers, self.default_headers(), self.drop_headers)
        body = request.body
        added: bytes | None = None
        if self.usage_mode == USAGE_ALWAYS and request.path.rstrip("/").endswith("/chat/completions"):
            added = with_usage(body)
            body = added or body
        relay: TunnelBody | None = None

        def on_response(response: IResponse) -> ChunkReceiver:
            nonlocal relay
            observer = TunnelObserver(sink, response) if 200 <= response.code < 300 else None
            # A usage chunk is taken out only where the length is not fixed.
            strip = added is not None and not response.headers.hasHeader(b"content-length")
            relay = TunnelBody(sink, response, observer, strip, self.clock)
            return relay.feed

        def ended(response: IResponse) -> None:
            if relay is not None:
                relay.finish()

        def failed(failure: Failure) -> Failure:
            failure.trap(ProviderError)
            if relay is None or not isinstance(failure.value, ProviderError):
                return failure
            raise relay.failed(failure.value)

        # A sink that does flow control pauses the provider read with it.
        raw = self.raw_request(request.method, request.path, headers, body)
        deadlines = self.deadlines if asks_stream(body) else self.deadlines.not_streamed()
        d = self.read(raw, on_response, getattr(sink, "register_producer", None), deadlines)
        return d.addCallback(ended).addErrback(as_provider_error).addErrback(failed)
