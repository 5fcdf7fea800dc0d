"""
The OpenAI-compatible surface: C{POST /v1/chat/completions} and
C{GET /v1/models}.

C{model} names a model group (routed through its provider pool) or, when
no group has that name, an adapter (on the single ready node). The
selected provider decides the wire: OpenAI-compatible providers get a raw
tunnel and the caller receives the provider's own bytes; every other
provider runs a normalized run rendered here as OpenAI chunks or one JSON
response.
"""

import json
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
    relay_response_headers,
    write_error,
    write_json,
)
from iop.edge.http.notes import note_usage
from iop.edge.http.request import EdgeRequest
from iop.edge.http.validate import HTTPError, boolean, invalid, mapping, string
from iop.edge.runs import TUNNEL
from iop.edge.spec import RunSpec, TunnelSpec
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
    An assistant message's C{tool_calls}, checked: each with an C{id} and a
    C{function} with a C{name} and C{arguments} (a JSON text).
    """
    if not isinstance(value, list):
        raise invalid(param, "must be a list of tool calls", "invalid_messages")
    calls: list[dict[str, Any]] = []
    for i, call in enumerate(value):
        where = f"{param}[{i}]"
        if not isinstance(call, dict):
            raise invalid(where, "must be an object", "invalid_messages")
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


def parse_messages(value: object, param: str = "messages") -> list[dict[str, Any]]:
    """
    Chat messages as C{{"role", "content"}} with text content, plus the
    OpenAI extras a normalized run carries when present: C{name},
    C{tool_call_id} (a tool result), C{tool_calls} (an assistant's) and
    C{images} (the URLs of image parts).

    @raise HTTPError: unless C{value} is a non-empty list of objects with a
        string C{role} and a C{content} L{content_of} accepts.
    """
    if not isinstance(value, list) or not value:
        raise invalid(param, "must be a non-empty list of messages", "invalid_messages")
    messages: list[dict[str, Any]] = []
    for i, m in enumerate(value):
        where = f"{param}[{i}]"
        if not isinstance(m, dict):
            raise invalid(where, "must be an object with a role", "invalid_messages")
        role = string(m, "role", required=True, param=where + ".role")
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


def parse_chat(body: dict[str, Any]) -> tuple[str, list[dict[str, Any]], bool, bool]:
    """
    Every field of a chat completion request the Edge uses, checked.

    @return: C{(model, messages, stream, include_usage)}.
    @raise HTTPError: naming the first bad field.
    """
    model = string(body, "model", required=True)
    messages = parse_messages(body.get("messages"))
    stream = boolean(body, "stream")
    stream_options = mapping(body, "stream_options")
    include_usage = boolean(stream_options, "include_usage", param="stream_options.include_usage")
    return model, messages, stream, include_usage


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
    provider's own status when it reported one, else by failure code.
    """
    status = failure.status if 400 <= failure.status < 600 else None
    return ServiceError(_KIND_BY_FAILURE.get(failure.code, "failed"), failure.message, code=failure.code, status=status)


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
        model, messages, stream, include_usage = parse_chat(body)
        headers = caller_headers(request)
        background = background_requested(request)
        spec = RunSpec(
            messages=messages,
            model=model,
            adapter=model,
            options={k: v for k, v in body.items() if k not in _ENVELOPE_KEYS},
            tunnel=TunnelSpec("POST", "/chat/completions", headers, body, getattr(request, "raw_body", None)),
            background=background,
        )
        claim(spec, request)
        choices = body.get("n", 1)
        call = Call(self.service, request, background=background)
        on_queued = call.queued_stream(_tell_queued, _end_queued) if stream else None
        created = int(self.clock.seconds())
        runs = self.service.runs

        # (The return type quoted: a union of interfaces is built at each def.)
        def listener_for(kind: str, work_id: str) -> "IRunListener | ITunnelListener":
            if kind == TUNNEL:
                # A tunnel answers with exactly the provider's headers.
                return TunnelPassthrough(call)
            if not call.gone:
                request.setHeader(RUN_ID_HEADER, work_id.encode("ascii"))
            if choices not in (None, 1):
                # A normalized run produces one answer: never silently one of n.
                raise invalid("n", "this model's provider answers one choice: n must be 1", "unsupported_n")
            # The model group that serves it (a fallback's, once one took it).
            record = runs.get(work_id)
            served = record.model if record is not None and record.model else model
            return (ChunkRenderer if stream else ResponseRenderer)(call, work_id, served, created, include_usage)

        return call.submit(spec, listener_for, on_queued)


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
    def __init__(self, call: Call, work_id: str, model: str, created: int, include_usage: bool) -> None:
        self.call = call
        self.id = "chatcmpl-" + work_id.split("-", 1)[-1]
        self.model = model
        self.created = created
        self.include_usage = include_usage
        self.tool_calls: list[ToolCall] = []

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

    def __init__(self, call: Call, work_id: str, model: str, created: int, include_usage: bool) -> None:
        super().__init__(call, work_id, model, created, include_usage)
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
            if self.include_usage and event.usage is not None:
                final = self.chunk({})
                final["choices"] = []
                final["usage"] = openai_usage(event.usage)
                self.stream.send(final)
            self.stream.done()
            self.call.finish()
        elif event.type in (ERROR, CANCELLED):
            # The stream began: it ends with an error event (with the
            # usage so far of an answer cut mid-way).
            self.stream.fail(_reason(event), openai_usage(event.usage) if event.usage is not None else None)
            self.call.finish()


@implementer(IRunListener)
class ResponseRenderer(_Renderer):
    """
    A normalized run collected into one C{chat.completion} response.
    """

    def __init__(self, call: Call, work_id: str, model: str, created: int, include_usage: bool) -> None:
        super().__init__(call, work_id, model, created, include_usage)
        self.text: list[str] = []
        self.reasoning: list[str] = []

    def event(self, event: RunEventData) -> None:
        if self.call.gone:
            return
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
            if event.usage is not None:
                response["usage"] = openai_usage(event.usage)
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
        self.tail = b""
        #: The usage the relayed stream reported so far.
        self.usage_so_far: Usage | None = None
        #: A provider's error answer to a caller already told it was
        #: queued: C{(status, body parts)}, ended as an SSE error event.
        self.refused: tuple[int, list[bytes]] | None = None

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
        self.request.setResponseCode(code)

    def headers(self, pairs: list[tuple[str, str]]) -> None:
        """
        Exactly the provider's headers, minus hop-by-hop ones: same-named
        ones the Edge's server set (Server, Date) are replaced, or removed
        when the provider sent none.
        """
        if self.call.gone or self.request.startedWriting:
            return
        for name, value in relay_response_headers(self.request, pairs):
            if name.lower() == "content-type" and value.lower().startswith("text/event-stream"):
                self.event_stream = True

    def body(self, data: bytes) -> None:
        if self.refused is not None:
            self.refused[1].append(data)
        elif not self.call.gone and data:
            self.request.write(data)
            self.tail = (self.tail + data)[-2:]

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
        self.call.finish()

    def error(self, failure: RunFailure) -> None:
        if self.call.gone or self.request.finished:
            return
        if self.request.startedWriting:
            if self.event_stream:
                # Mid-stream SSE: end it the way the surface ends streams,
                # with an error event and the end-of-stream marker.
                if self.tail != b"\n\n":
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
        write_error(self.request, run_failure_error(failure))


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
    stream.fail(failure, openai_usage(usage) if usage is not None else None)


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
