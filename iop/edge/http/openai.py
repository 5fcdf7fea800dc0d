"""
The OpenAI-compatible surface: C{POST /v1/chat/completions} and
C{GET /v1/models}.

C{model} names a model group (routed through its provider pool) or, when
no group has that name, an adapter (on the one ready node that has it). The
selected provider decides the wire: OpenAI-compatible providers get a raw
tunnel and the caller receives the provider's own bytes; every other
provider runs a normalized run rendered here as OpenAI chunks or one JSON
response.
"""

import json
import math
from dataclasses import dataclass
from typing import Any

from twisted.internet.interfaces import IReactorTime
from zope.interface import implementer

from iop.edge.dispatch import IRunListener, ITunnelListener
from iop.edge.errors import ServiceError
from iop.edge.flow import ReceiveWindow
from iop.edge.http.api import EdgeAPI
from iop.edge.http.common import (
    Call,
    EventStream,
    JSONResource,
    Keys,
    caller_headers,
    claim,
    cut_off,
    identify,
    relay_response_headers,
    set_status,
    write_error,
    write_json,
)
from iop.edge.http.notes import note_usage
from iop.edge.http.request import EdgeRequest
from iop.edge.http.validate import HTTPError, boolean, integer, invalid, mapping, number, string
from iop.edge.placement import adapter_types
from iop.edge.runs import TUNNEL
from iop.edge.spec import RunSpec, TunnelSpec, tokens_of
from iop.run import (
    CANCELLED,
    COMPLETE,
    DELTA,
    ERROR,
    PROVIDER_ERROR,
    REASONING_DELTA,
    START,
    TOOL_CALL,
    RunEventData,
    RunFailure,
    ToolCall,
    Usage,
)

#: Request keys that are not generation options for a normalized run.
_ENVELOPE_KEYS = {"model", "messages", "stream", "stream_options", "user", "n"}


def content_of(content: object, param: str = "content") -> tuple[str, list[str]]:
    """
    The text and images of a message's C{content}: a string, or a list of
    parts whose C{text} parts are joined and whose C{image_url} parts give
    image URLs (other part types are left to the provider of a tunnel).

    @return: C{(text, [image url])}.
    @raise HTTPError: for any other shape, naming C{param}.
    """
    if content is None:
        return "", []
    if isinstance(content, str):
        return content, []
    if not isinstance(content, list):
        raise invalid(param, "must be a string or a list of parts", "invalid_messages")
    texts: list[str] = []
    images: list[str] = []
    for i, part in enumerate(content):
        where = f"{param}[{i}]"
        if not isinstance(part, dict):
            raise invalid(where, "must be an object with a type", "invalid_messages")
        kind = string(part, "type", required=True, param=where + ".type")
        if kind == "text":
            texts.append(string(part, "text", param=where + ".text", max_chars=None))
        elif kind == "image_url":
            image = part.get("image_url")
            url = (
                image
                if isinstance(image, str)
                else string(
                    mapping(part, "image_url", where + ".image_url"),
                    "url",
                    required=True,
                    max_chars=None,
                    param=where + ".image_url.url",
                )
            )
            images.append(url)
    return "".join(texts), images


def text_of(content: object, param: str = "content") -> str:
    """
    The text of a message's C{content} (see L{content_of}).
    """
    return content_of(content, param)[0]


def _tool_calls(value: object, param: str) -> list[dict[str, Any]]:
    """
    An assistant message's C{tool_calls}, checked: each with an C{id} and,
    of C{type} C{function} (the default), a C{function} with a C{name} and
    C{arguments} (a JSON text); a call of another type (C{custom}: a
    C{custom} with C{name} and C{input}) is the provider's to read, and is
    kept as it is.
    """
    if not isinstance(value, list):
        raise invalid(param, "must be a list of tool calls", "invalid_messages")
    calls: list[dict[str, Any]] = []
    for i, call in enumerate(value):
        where = f"{param}[{i}]"
        if not isinstance(call, dict):
            raise invalid(where, "must be an object", "invalid_messages")
        kind = string(call, "type", "function", param=where + ".type")
        if kind != "function":
            calls.append(call)
            continue
        function = mapping(call, "function", where + ".function")
        calls.append(
            {
                "id": string(call, "id", param=where + ".id"),
                "type": "function",
                "function": {
                    "name": string(function, "name", required=True, param=where + ".function.name"),
                    "arguments": string(
                        function, "arguments", "{}", max_chars=None, param=where + ".function.arguments"
                    ),
                },
            }
        )
    return calls


#: The roles a chat message may have: OpenAI's (C{function} is its
#: deprecated one, which it still takes).
ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})


def parse_messages(value: object, param: str = "messages") -> list[dict[str, Any]]:
    """
    Chat messages as C{{"role", "content"}} with text content, plus the
    OpenAI extras a normalized run carries when present: C{name},
    C{tool_call_id} (a tool result), C{tool_calls} (an assistant's) and
    C{images} (the URLs of image parts).

    @raise HTTPError: unless C{value} is a non-empty list of objects with a
        C{role} of L{ROLES} and a C{content} L{content_of} accepts.
    """
    if not isinstance(value, list) or not value:
        raise invalid(param, "must be a non-empty list of messages", "invalid_messages")
    messages: list[dict[str, Any]] = []
    for i, m in enumerate(value):
        where = f"{param}[{i}]"
        if not isinstance(m, dict):
            raise invalid(where, "must be an object with a role", "invalid_messages")
        role = string(m, "role", required=True, param=where + ".role")
        if role not in ROLES:
            raise invalid(where + ".role", f"must be one of {', '.join(sorted(ROLES))}", "invalid_messages")
        text, images = content_of(m.get("content"), where + ".content")
        message: dict[str, Any] = {"role": role, "content": text}
        for key in ("name", "tool_call_id"):
            value_of = string(m, key, param=f"{where}.{key}")
            if value_of:
                message[key] = value_of
        if m.get("tool_calls") is not None:
            message["tool_calls"] = _tool_calls(m["tool_calls"], where + ".tool_calls")
        if images:
            message["images"] = images
        messages.append(message)
    return messages


#: C{tool_choice} as a word (else an object naming a tool).
_TOOL_CHOICES = frozenset({"none", "auto", "required"})


@dataclass(frozen=True)
class Chat:
    """
    What the Edge itself reads of a chat completion request.

    @ivar n: how many choices the caller asks for.
    """

    model: str
    messages: list[dict[str, Any]]
    stream: bool
    include_usage: bool
    n: int


def parse_chat(body: dict[str, Any]) -> Chat:
    """
    Every field of a chat completion request the Edge uses, checked; and
    the types of the generation options OpenAI documents, so that a
    normalized run (which hands them to a back end that may not check
    them) refuses a bad one as OpenAI would: a 400 naming it. Fields it
    does not know are left alone: callers send vendor extensions, which a
    tunnel carries to the provider.

    @raise HTTPError: naming the first bad field.
    """
    model = string(body, "model", required=True)
    messages = parse_messages(body.get("messages"))
    stream = boolean(body, "stream")
    stream_options = mapping(body, "stream_options")
    include_usage = boolean(stream_options, "include_usage", param="stream_options.include_usage")
    if body.get("stream_options") is not None and not stream:
        raise invalid("stream_options", "is only allowed when stream is true", "invalid_stream_options")
    for key in ("max_tokens", "max_completion_tokens"):
        integer(body, key, minimum=1)
    number(body, "temperature", 0, 2)
    number(body, "top_p", 0, 1)
    _check_tools(body)
    _check_stop(body.get("stop"))
    n = integer(body, "n", 1, minimum=1)
    assert n is not None  # (it has a default)
    return Chat(model, messages, stream, include_usage, n)


def _check_tools(body: dict[str, Any]) -> None:
    """
    C{tools} is a list of objects, C{tool_choice} a word or an object.
    """
    tools = body.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise invalid("tools", "must be a list of tool objects", "invalid_tools")
    choice = body.get("tool_choice")
    if choice is not None and not (isinstance(choice, dict) or isinstance(choice, str) and choice in _TOOL_CHOICES):
        raise invalid("tool_choice", "must be none, auto, required or an object naming a tool", "invalid_tool_choice")


def _check_stop(stop: object) -> None:
    """
    C{stop} is a string or a list of strings.
    """
    if stop is None or isinstance(stop, str):
        return
    if not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise invalid("stop", "must be a string or a list of strings", "invalid_stop")


def openai_usage(usage: Usage) -> dict[str, Any]:
    """
    OpenAI's usage object; the details appear only when reported.
    """
    result: dict[str, Any] = {
        "prompt_tokens": usage.input_tokens,
        "completion_tokens": usage.output_tokens,
        "total_tokens": usage.input_tokens + usage.output_tokens,
    }
    if usage.reasoning_tokens is not None:
        result["completion_tokens_details"] = {"reasoning_tokens": usage.reasoning_tokens}
    if usage.cached_input_tokens is not None:
        result["prompt_tokens_details"] = {"cached_tokens": usage.cached_input_tokens}
    return result


#: Run failure codes that mean something other than "the back end failed".
_KIND_BY_FAILURE = {
    "capacity_exceeded": "busy",
    "node_disconnected": "unavailable",
    "node_draining": "unavailable",
    "shutting_down": "unavailable",
    "cancelled": "unavailable",
    "unknown_adapter": "not_found",
    # A provider deadline passed before anything reached the caller.
    "provider_timeout": "timeout",
    # A second placement that failed (see EdgeService._place_again).
    "queue_timeout": "busy",
    "queue_full": "busy",
    "unavailable": "unavailable",
    "model_not_found": "not_found",
    # The caller's session: another run of it in progress, or another key's.
    "session_busy": "conflict",
    "session_owned": "conflict",
    # The Node could not take the request as it is (a bad options JSON, a
    # session id a tool would read as an option).
    "invalid_request": "invalid",
}


def run_failure_error(failure: RunFailure) -> ServiceError:
    """
    The HTTP error for a run that ended in C{error} before any output: the
    provider's own status when it reported one, else by failure code; with
    the C{Retry-After} the provider asked for (whole seconds, rounded up),
    which a tunnel would have relayed with the provider's headers.
    """
    status = failure.status if 400 <= failure.status < 600 else None
    delay = failure.retry_after_sec
    retry_after = math.ceil(delay) if 0 < delay < math.inf else None
    return ServiceError(
        _KIND_BY_FAILURE.get(failure.code, "failed"),
        failure.message,
        code=failure.code,
        status=status,
        retry_after=retry_after,
    )


#: The request header that asks for a background run (C{true}, C{1} or
#: C{yes}): the run goes on when the caller disconnects, and can be read
#: back with C{GET /v1/runs/{id}} (the id is in the C{x-iop-run-id}
#: response header of every normalized run; a tunnel answers with the
#: provider's headers only). A background run is always a normalized run.
BACKGROUND_HEADER = b"x-iop-background"
RUN_ID_HEADER = b"x-iop-run-id"


def background_requested(request: EdgeRequest) -> bool:
    value = (request.getHeader(BACKGROUND_HEADER) or b"").strip().lower()
    if value in (b"", b"0", b"false", b"no"):
        return False
    if value in (b"1", b"true", b"yes"):
        return True
    raise HTTPError("invalid", "x-iop-background must be true or false", code="invalid_background")


class ChatCompletions(JSONResource):
    runs_work = True

    def __init__(self, service: EdgeAPI, keys: Keys, clock: IReactorTime) -> None:
        super().__init__(service, keys)
        self.clock = clock

    def handle_POST(self, request: EdgeRequest) -> int:
        body = self.read_json(request)
        chat = parse_chat(body)
        headers = caller_headers(request, streamed=chat.stream)
        background = background_requested(request)
        spec = RunSpec(
            messages=chat.messages,
            model=chat.model,
            adapter=chat.model,
            options={k: v for k, v in body.items() if k not in _ENVELOPE_KEYS},
            tunnel=TunnelSpec("POST", "/chat/completions", headers, body, getattr(request, "raw_body", None)),
            background=background,
        )
        if chat.n != 1 and self.answers_one_choice(spec):
            # Said before the request waits for room: nothing it could be
            # placed on relays n.
            raise _one_choice()
        claim(spec, request)
        call = Call(self.service, request, background=background)
        on_queued = call.queued_stream(_tell_queued, _end_queued) if chat.stream else None
        created = int(self.clock.seconds())
        runs = self.service.runs
        prompt_tokens = tokens_of(spec.input_chars())

        # (The return type quoted: a union of interfaces is built at each def.)
        def listener_for(kind: str, work_id: str) -> "IRunListener | ITunnelListener":
            if kind == TUNNEL:
                # A tunnel answers with exactly the provider's headers.
                return TunnelPassthrough(call)
            if not call.gone:
                request.setHeader(RUN_ID_HEADER, work_id.encode("ascii"))
                identify(request, work_id)
            if chat.n != 1:
                # A group of both kinds of provider placed it on one that
                # runs it (the early check let it through for the other).
                raise _one_choice()
            # The model group that serves it (a fallback's, once one took it).
            record = runs.get(work_id)
            served = record.model if record is not None and record.model else chat.model
            renderer = ChunkRenderer if chat.stream else ResponseRenderer
            return renderer(call, work_id, served, created, chat.include_usage, prompt_tokens)

        return call.submit(spec, listener_for, on_queued)

    def answers_one_choice(self, spec: RunSpec) -> bool:
        """
        Whether C{spec} can only be answered with one choice: it is a
        background run, or no provider it may be placed on takes it as a
        tunnel (the service's own choice, L{RunSpec.tunnels_on}, asked of
        each). A model no provider serves is left to placement, which
        answers 404 C{model_not_found}.
        """
        types = adapter_types(self.service.config, spec.model or "")
        if not types:
            return False
        return spec.background or not any(spec.tunnels_on(t) for t in types)


def _one_choice() -> HTTPError:
    """
    A normalized run produces one answer: never silently one of n.
    """
    return invalid("n", "this model's provider answers one choice: n must be 1", "unsupported_n")


def _tell_queued(stream: EventStream, position: int, eta_ms: int) -> None:
    """
    A streamed completion that waits for room: an SSE comment per update,
    which OpenAI clients skip.
    """
    stream.comment(f"queued position={position} eta_ms={eta_ms}")


def _end_queued(stream: EventStream, error: ServiceError) -> None:
    stream.fail(error)


#: What follows a delta's text in its chunk (see L{ChunkRenderer}).
_DELTA_END = b'}, "finish_reason": null}]}\n\n'


class _Renderer:
    """
    @param prompt_tokens: the Edge's estimate of the request's input tokens
        (L{tokens_of}), its usage when the back end reports none.
    """

    def __init__(
        self, call: Call, work_id: str, model: str, created: int, include_usage: bool, prompt_tokens: int = 0
    ) -> None:
        self.call = call
        self.id = "chatcmpl-" + work_id.split("-", 1)[-1]
        self.model = model
        self.created = created
        self.include_usage = include_usage
        self.prompt_tokens = prompt_tokens
        self.tool_calls: list[ToolCall] = []
        #: How many characters of answer (text, reasoning, tool calls) the
        #: caller was given, for the estimate of its tokens.
        self.answer_chars = 0

    def heard(self, event: RunEventData) -> None:
        """
        Count the answer C{event} carries (see L{answer_chars}).
        """
        if event.type in (DELTA, REASONING_DELTA):
            self.answer_chars += len(event.text)
        elif event.type == TOOL_CALL and event.tool_call is not None:
            self.answer_chars += len(event.tool_call.name) + len(event.tool_call.arguments)

    def usage(self, event: RunEventData) -> dict[str, Any]:
        """
        The C{complete} terminal's usage as OpenAI's object: the reported
        one, else the Edge's estimate (marked C{estimated: true}), since
        OpenAI always gives one and callers read it.
        """
        if event.usage is not None:
            return openai_usage(event.usage)
        estimate = openai_usage(Usage(input_tokens=self.prompt_tokens, output_tokens=tokens_of(self.answer_chars)))
        estimate["estimated"] = True
        return estimate

    def finish_reason(self, event: RunEventData) -> str:
        """
        OpenAI's finish reason for the C{complete} terminal: the back end's
        when it said one, else C{tool_calls} after tool calls, else C{stop}.
        """
        return event.finish_reason or ("tool_calls" if self.tool_calls else "stop")


def _reason(event: RunEventData) -> RunFailure:
    """
    Why an C{error} or C{cancelled} terminal ended its run (the dispatch
    gives each one its reason: L{iop.edge.dispatch.RunDispatch.event}).
    """
    assert event.error is not None
    return event.error


def tool_call_json(call: ToolCall, index: int | None = None) -> dict[str, Any]:
    """
    A L{iop.run.ToolCall} as an OpenAI tool call (with its C{index} in a
    streamed delta).
    """
    result: dict[str, Any] = {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }
    if index is not None:
        result["index"] = index
    return result


@implementer(IRunListener)
class ChunkRenderer(_Renderer):
    """
    Normalized run events as OpenAI C{chat.completion.chunk} SSE events.
    """

    def __init__(
        self, call: Call, work_id: str, model: str, created: int, include_usage: bool, prompt_tokens: int = 0
    ) -> None:
        super().__init__(call, work_id, model, created, include_usage, prompt_tokens)
        self.stream = EventStream(self.call.request)
        # Text deltas are the bulk of a stream: their chunk is rendered
        # from a template, only the text encoded per event (the bytes are
        # those json.dumps would give for the whole chunk).
        head = json.dumps(
            {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model}
        )
        self.templates = {
            key: (f'data: {head[:-1]}, "choices": [{{"index": 0, "delta": {{"{key}": '.encode(), _DELTA_END)
            for key in ("content", "reasoning_content")
        }

    def _delta(self, key: str, text: str) -> None:
        prefix, suffix = self.templates[key]
        self.stream.send_bytes(prefix + json.dumps(text).encode() + suffix)

    def use_producer(self, producer: ReceiveWindow) -> None:
        self.call.use_producer(producer)

    def chunk(self, delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
        }

    def event(self, event: RunEventData) -> None:
        if self.call.gone:
            return
        if event.type in (ERROR, CANCELLED) and not self.stream.open:
            # Nothing sent yet: the caller gets a proper error status.
            write_error(self.call.request, run_failure_error(_reason(event)))
            return
        self.heard(event)
        if event.type == START:
            self.stream.send(self.chunk({"role": "assistant", "content": ""}))
        elif event.type == DELTA:
            self._delta("content", event.text)
        elif event.type == REASONING_DELTA:
            self._delta("reasoning_content", event.text)
        elif event.type == TOOL_CALL and event.tool_call is not None:
            self.stream.send(self.chunk({"tool_calls": [tool_call_json(event.tool_call, len(self.tool_calls))]}))
            self.tool_calls.append(event.tool_call)
        elif event.type == COMPLETE:
            note_usage(self.call.request, event.usage)
            self.stream.send(self.chunk({}, self.finish_reason(event)))
            if self.include_usage:
                final = self.chunk({})
                final["choices"] = []
                final["usage"] = self.usage(event)
                self.stream.send(final)
            self.stream.done()
            self.call.finish()
        elif event.type in (ERROR, CANCELLED):
            # The stream began: it ends with an error event (with the
            # usage so far of an answer cut mid-way).
            usage = openai_usage(event.usage) if event.usage is not None else None
            self.stream.fail(run_failure_error(_reason(event)), usage)
            self.call.finish()


@implementer(IRunListener)
class ResponseRenderer(_Renderer):
    """
    A normalized run collected into one C{chat.completion} response.
    """

    def __init__(
        self, call: Call, work_id: str, model: str, created: int, include_usage: bool, prompt_tokens: int = 0
    ) -> None:
        super().__init__(call, work_id, model, created, include_usage, prompt_tokens)
        self.text: list[str] = []
        self.reasoning: list[str] = []

    def event(self, event: RunEventData) -> None:
        if self.call.gone:
            return
        self.heard(event)
        if event.type == DELTA:
            self.text.append(event.text)
        elif event.type == REASONING_DELTA:
            self.reasoning.append(event.text)
        elif event.type == TOOL_CALL and event.tool_call is not None:
            self.tool_calls.append(event.tool_call)
        elif event.type == COMPLETE:
            note_usage(self.call.request, event.usage)
            text = "".join(self.text)
            message: dict[str, Any] = {"role": "assistant", "content": text if text or not self.tool_calls else None}
            if self.tool_calls:
                message["tool_calls"] = [tool_call_json(call) for call in self.tool_calls]
            if self.reasoning:
                message["reasoning_content"] = "".join(self.reasoning)
            response: dict[str, Any] = {
                "id": self.id,
                "object": "chat.completion",
                "created": self.created,
                "model": self.model,
                "choices": [{"index": 0, "message": message, "finish_reason": self.finish_reason(event)}],
            }
            response["usage"] = self.usage(event)
            write_json(self.call.request, 200, response)
        elif event.type in (ERROR, CANCELLED):
            write_error(self.call.request, run_failure_error(_reason(event)))


@implementer(ITunnelListener)
class TunnelPassthrough:
    """
    The provider's own response, relayed to the caller as it comes:
    status, headers (minus hop-by-hop) and raw body bytes.

    @param path: the endpoint relayed (C{/chat/completions}, ...): a
        stream cut mid-way ends with an error event in its dialect.
    """

    def __init__(self, call: Call, path: str = "/chat/completions") -> None:
        self.call = call
        self.path = path
        self.request = call.request
        self.event_stream = False
        #: Of an event stream: the part of an event not ended yet, held
        #: (as it came) until its blank line comes or the stream ends.
        self.held: list[bytes] = []
        self.held_bytes = 0
        #: The last few bytes held, where a blank line split between two
        #: body writes is looked for.
        self.seam = b""
        #: An event longer than L{MAX_HELD_EVENT} went out unended.
        self.unended = False
        #: The usage the relayed stream reported so far.
        self.usage_so_far: Usage | None = None
        #: A provider's error answer to a caller already told it was
        #: queued: C{(status, body parts)}, ended as an SSE error event.
        self.refused: tuple[int, list[bytes]] | None = None
        #: The names of the provider's headers set on the response: an
        #: error the Edge answers before any body byte goes without them.
        self.relayed_headers: list[str] = []

    def use_producer(self, producer: ReceiveWindow) -> None:
        self.call.use_producer(producer)

    def status(self, code: int) -> None:
        if self.call.gone:
            return
        if self.request.startedWriting:
            # The caller was told its place in the queue: the response is
            # an event stream already, which the answer continues.
            self.event_stream = True
            if code >= 400:
                self.refused = (code, [])
            return
        set_status(self.request, code)

    def headers(self, pairs: list[tuple[str, str]]) -> None:
        """
        Exactly the provider's headers, minus hop-by-hop ones: same-named
        ones the Edge's server set (Server, Date) are replaced, or removed
        when the provider sent none.
        """
        if self.call.gone or self.request.startedWriting:
            return
        relayed = relay_response_headers(self.request, pairs)
        self.relayed_headers = [name for name, _ in relayed]
        coded = any(
            name.lower() == "content-encoding" and value.strip().lower() != "identity" for name, value in relayed
        )
        for name, value in relayed:
            # A compressed event stream is relayed as any body: its events'
            # ends cannot be seen in it.
            if name.lower() == "content-type" and value.lower().startswith("text/event-stream") and not coded:
                self.event_stream = True

    def body(self, data: bytes) -> None:
        if self.refused is not None:
            self.refused[1].append(data)
        elif not self.call.gone and data:
            if self.event_stream:
                self._relay_events(data)
            else:
                self.request.write(data)

    def _relay_events(self, data: bytes) -> None:
        """
        Write the whole events of an event stream, holding the part of an
        event not ended yet: an error event the Edge may have to add must
        never be glued to half of one (an SDK would fail to read it). The
        common write ends on an event's end and goes out as it is; an event
        that grows past L{MAX_HELD_EVENT} goes out as it comes rather than
        be held without bound.
        """
        end = event_end(data, self.seam)
        if end == len(data) and not self.held:
            self.request.write(data)
            self.unended = False
            return
        if end:
            self.request.write(b"".join([*self.held, data[:end]]))
            self.unended = False
            self.held, self.held_bytes, self.seam = [], 0, b""
            data = data[end:]
            if not data:
                return
        self.held.append(data)
        self.held_bytes += len(data)
        self.seam = (self.seam + data[-3:])[-3:]
        if self.held_bytes > MAX_HELD_EVENT:
            self._write_held()
            self.unended = True

    def _write_held(self) -> None:
        """
        Write what is held of an event as it is.
        """
        if self.held:
            self.request.write(b"".join(self.held))
            self.held, self.held_bytes = [], 0

    def usage(self, usage: Usage) -> None:
        self.usage_so_far = usage
        note_usage(self.request, usage)

    def metadata(self, info: dict[str, Any]) -> None:
        pass

    def end(self) -> None:
        if self.refused is not None:
            status, parts = self.refused
            self.refused = None
            self.error(RunFailure(PROVIDER_ERROR, _error_message(b"".join(parts), status), status))
            return
        if not self.call.gone:
            # The provider ended its stream mid-event: the caller gets
            # what it sent.
            self._write_held()
        self.call.finish()

    def error(self, failure: RunFailure) -> None:
        if self.call.gone or self.request.finished:
            return
        if self.request.startedWriting:
            if self.event_stream:
                # Mid-stream SSE: end it the way the surface ends streams,
                # with an error event and the end-of-stream marker, after
                # the last whole event (half of one is dropped).
                self.held = []
                if self.unended:
                    self.request.write(b"\n\n")
                stream = EventStream(self.request)
                stream.open = True
                _end_stream(stream, self.path, failure, self.usage_so_far)
                self.call.finish()
            else:
                # Mid-body of one JSON document: the only honest signal
                # left is an aborted response.
                cut_off(self.request.channel.transport)
            return
        for name in self.relayed_headers:
            # (Its Content-Encoding or Content-Length would misdescribe the
            # Edge's own error.)
            self.request.responseHeaders.removeHeader(name)
        write_error(self.request, run_failure_error(failure))


#: The most of one event a relayed event stream holds while it waits for
#: the event's end (generous: an event is a chunk of an answer).
MAX_HELD_EVENT = 16 * 1024 * 1024

#: What ends an event of a server-sent event stream: a blank line (after
#: lines ended by LF, CRLF or CR).
_EVENT_ENDS = (b"\n\n", b"\r\n\r\n", b"\r\r")


def event_end(data: bytes, before: bytes = b"") -> int:
    """
    How much of C{data}, a piece of an event stream, is whole events: the
    index just after its last blank line, or 0. One look at its end in the
    common case, else a search back from the end (the CRLF and CR ones
    only over what the LF one passed, and only in a stream with a CR).

    @param before: the last bytes before C{data}, held: a blank line split
        between them and C{data} counts (only a few bytes are joined).
    """
    if data.endswith(_EVENT_ENDS):
        return len(data)
    lf = data.rfind(b"\n\n")
    end = lf + 2 if lf >= 0 else 0
    if data.find(b"\r", max(lf, 0)) >= 0:
        crlf = data.rfind(b"\r\n\r\n", max(lf, 0))
        cr = data.rfind(b"\r\r", max(lf, 0))
        end = max(end, crlf + 4 if crlf >= 0 else 0, cr + 2 if cr >= 0 else 0)
    if end or not before:
        return end
    seam = before[-3:] + data[:3]
    return max(event_end(seam) - len(before[-3:]), 0)


def _end_stream(stream: EventStream, path: str, failure: RunFailure, usage: Usage | None) -> None:
    """
    End a relayed event stream cut mid-way with an error event in the
    endpoint's dialect (with the usage so far, when known): the Responses
    API's C{error} event, else OpenAI's error chunk and C{[DONE]}.
    """
    if path == "/responses":
        event: dict[str, Any] = {"type": "error", "code": failure.code, "message": failure.message, "param": None}
        if usage is not None:
            event["usage"] = {
                "input_tokens": usage.input_tokens,
                "output_tokens": usage.output_tokens,
                "total_tokens": usage.input_tokens + usage.output_tokens,
            }
        stream.send_event(event, name="error")
        return
    stream.fail(run_failure_error(failure), openai_usage(usage) if usage is not None else None)


def _error_message(body: bytes, status: int) -> str:
    """
    The message of a provider's error body (OpenAI's C{error.message}, or
    the text), for an error event.
    """
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body.decode("utf-8", "replace")[:500]
    return str(message) or f"the provider answered HTTP {status}"


def model_object(name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "iop"}


class Models(JSONResource):
    def handle_GET(self, request: EdgeRequest) -> dict[str, Any]:
        return {"object": "list", "data": [model_object(name) for name in self.service.models()]}


class Model(JSONResource):
    def handle_GET(self, request: EdgeRequest) -> dict[str, Any]:
        name = request.path_params["model"]
        if name not in self.service.models():
            raise HTTPError("not_found", f"the model {name!r} does not exist", code="model_not_found")
        return model_object(name)
