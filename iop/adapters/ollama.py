"""
The C{ollama} back end, through Ollama's native API rather than its /v1
compatibility layer: the native stream carries C{message.thinking}
separately and reports token counts on its final line, and the model
management API (list, show, pull, delete, running) exists only there.

Ollama is not an OpenAI tunnel target: its runs are always normalized.
"""

import json
import secrets
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from twisted.internet import defer
from twisted.python.failure import Failure
from twisted.web.iweb import IResponse
from zope.interface import implementer

from iop import jsontext
from iop.adapters.interface import Capabilities, Emit, IAdapter, NotSupported, Progress, RunInput, TunnelInput
from iop.adapters.streams import (
    ERROR_BODY_LIMIT,
    ChunkReceiver,
    HTTPAdapter,
    NDJSONParser,
    ProviderError,
    as_provider_error,
    broken_answer,
    capped_appender,
    error_message,
    reported_count,
)
from iop.run import DELTA, REASONING_DELTA, TOOL_CALL, ITunnelSink, RunEventData, ToolCall, Usage, clean_text

#: Run options Ollama takes at the top level of /api/chat; all others are
#: model options and go under C{options} (but C{response_format}:
#: L{_format}).
_TOP_LEVEL = frozenset({"format", "keep_alive", "think", "tools"})
#: OpenAI option names callers commonly send, in Ollama's spelling.
_RENAMED = {"max_tokens": "num_predict", "max_completion_tokens": "num_predict"}


def _format(response_format: object) -> object:
    """
    Ollama's C{format} (top level: in C{options} Ollama ignores it) for
    OpenAI's C{response_format}: C{"json"} for C{{"type": "json_object"}},
    the schema of C{{"type": "json_schema", "json_schema": {"schema": ...}}}
    itself; C{None} (no constraint) for C{text} or anything else.
    """
    if not isinstance(response_format, dict):
        return None
    if response_format.get("type") == "json_object":
        return "json"
    spec = response_format.get("json_schema")
    if response_format.get("type") == "json_schema" and isinstance(spec, dict):
        return spec.get("schema")
    return None


#: Ollama's done_reason, as OpenAI's finish_reason.
_FINISH = {"stop": "stop", "length": "length", "load": "stop", "unload": "stop"}


def _ollama_message(message: dict[str, Any]) -> dict[str, Any]:
    """
    An OpenAI-style chat message in Ollama's /api/chat form: images as
    base64 (data: URLs stripped; other URLs are not fetched and dropped),
    tool calls with their arguments as objects, a tool result as role
    C{tool}.
    """
    result: dict[str, Any] = {"role": message["role"], "content": message.get("content") or ""}
    images = [url.split(",", 1)[1] for url in message.get("images", ()) if url.startswith("data:") and "," in url]
    if images:
        result["images"] = images
    calls: list[dict[str, Any]] = []
    for call in message.get("tool_calls") or ():
        if (call or {}).get("type", "function") != "function":
            continue  # (a custom tool call: Ollama has none)
        function = (call or {}).get("function") or {}
        arguments = function.get("arguments")
        try:
            arguments = jsontext.loads(arguments) if isinstance(arguments, str) else arguments
        except ValueError:
            pass
        calls.append({"function": {"name": function.get("name", ""), "arguments": arguments or {}}})
    if calls:
        result["tool_calls"] = calls
    if message.get("name") and message["role"] == "tool":
        result["tool_name"] = message["name"]
    return result


def _count(value: object) -> int:
    """
    A reported token count; 0 when none was (or not as a count: see
    L{reported_count}).
    """
    return reported_count(value) or 0


class Lines:
    """
    The NDJSON lines of an Ollama stream, each object handed to C{line};
    a line that is not JSON fails the stream as the provider's error.
    """

    def __init__(self) -> None:
        self.parser = NDJSONParser()

    def feed(self, data: bytes) -> None:
        self._lines(self.parser.feed, data)

    def flush(self) -> None:
        self._lines(self.parser.finish)

    def _lines(self, parse: Callable[..., list[Any]], *args: bytes) -> None:
        try:
            lines = parse(*args)
        except ValueError as e:
            raise broken_answer(f"provider sent a line that is not JSON: {e}") from None
        for line in lines:
            if isinstance(line, dict):
                self.line(line)

    def line(self, line: dict[str, Any]) -> None:
        raise NotImplementedError


class ChatLines(Lines):
    """
    Decoder for L{HTTPAdapter.stream_run}: NDJSON lines of /api/chat to
    C{reasoning_delta} (C{message.thinking}), C{delta}
    (C{message.content}) and C{tool_call} (C{message.tool_calls}); the
    C{done} line gives the usage and, from C{done_reason}, OpenAI's
    finish reason (C{tool_calls} when the model called tools). Tool
    calls are cleaned of lone surrogates (L{clean_text}; the Node cleans
    text deltas once joined); a line of the wrong shape
    (a C{message} that is not an object) is a broken answer.
    """

    def __init__(self, emit: Emit) -> None:
        super().__init__()
        self.emit = emit
        self.usage: Usage | None = None
        self.finish_reason: str | None = None
        self.tool_calls = 0
        #: The C{done} line came.
        self.finished = False

    def finish(self) -> Usage | None:
        self.flush()
        return self.usage

    def line(self, line: dict[str, Any]) -> None:
        if line.get("error"):
            raise ProviderError(str(line["error"]))
        message = line.get("message") or {}
        if not isinstance(message, dict):
            raise broken_answer("provider sent a line whose message is not an object")
        for key, kind in (("thinking", REASONING_DELTA), ("content", DELTA)):
            text = message.get(key)
            if isinstance(text, str) and text:
                # (Cleaned by the Node once a turn's text is joined.)
                self.emit(RunEventData(kind, text=text))
        calls = message.get("tool_calls") or []
        if not isinstance(calls, list):
            raise broken_answer("provider sent a line whose tool_calls is not a list")
        for call in calls:
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict) and isinstance(function.get("name"), str):
                self.tool_calls += 1
                arguments = function.get("arguments")
                # (json.dumps writes ASCII: a lone surrogate as its escape.)
                text = clean_text(arguments) if isinstance(arguments, str) else json.dumps(arguments or {})
                call_id = f"call_{secrets.token_hex(8)}"
                self.emit(RunEventData(TOOL_CALL, tool_call=ToolCall(call_id, clean_text(function["name"]), text)))
        if line.get("done"):
            self.finished = True
            reason = line.get("done_reason")  # any JSON value
            known = _FINISH.get(reason) if isinstance(reason, str) else None
            self.finish_reason = "tool_calls" if self.tool_calls else known or ("stop" if reason else None)
            # Ollama reports no breakdown: reasoning and cached stay None.
            self.usage = Usage(
                input_tokens=_count(line.get("prompt_eval_count")),
                output_tokens=_count(line.get("eval_count")),
            )


#: The fields of an Ollama pull status line relayed as progress.
_PROGRESS_FIELDS = ("status", "digest", "total", "completed")


class PullLines(Lines):
    """
    Decoder for a streamed /api/pull: NDJSON status lines, each handed to
    C{progress} (when given); an C{error} line fails the pull.
    """

    def __init__(self, progress: Progress | None) -> None:
        super().__init__()
        self.progress = progress
        self.last: dict[str, Any] = {}

    def finish(self) -> dict[str, Any]:
        self.flush()
        return self.last

    def line(self, line: dict[str, Any]) -> None:
        if line.get("error"):
            raise ProviderError(str(line["error"]))
        self.last = line
        if self.progress is not None:
            self.progress({k: line[k] for k in _PROGRESS_FIELDS if k in line})


def _openai_error(message: str, kind: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "code": None, "param": None}}


def _answer(sink: ITunnelSink, status: int, document: dict[str, Any]) -> None:
    sink.status(status)
    sink.headers([("content-type", "application/json")])
    sink.body(json.dumps(document).encode("utf-8"))


@implementer(IAdapter)
class OllamaAdapter(HTTPAdapter):
    """
    Options: C{base_url} (for example C{http://127.0.0.1:11434}, no
    C{/api}), C{api_key} and C{headers} (for an authenticating proxy in
    front), C{connect_timeout_sec}.
    """

    type = "ollama"

    #: command name -> (HTTP method, path, whether it takes a model)
    COMMANDS: dict[str, tuple[str, str, bool]] = {
        "ollama_list": ("GET", "/api/tags", False),
        "ollama_running": ("GET", "/api/ps", False),
        "ollama_show": ("POST", "/api/show", True),
        "ollama_pull": ("POST", "/api/pull", True),
        "ollama_delete": ("DELETE", "/api/delete", True),
    }

    #: What the C{probe} command GETs: Ollama's model list.
    probe_path = "/api/tags"

    def capabilities(self) -> Capabilities:
        caps = super().capabilities()
        return replace(caps, commands=(*self.COMMANDS, *caps.commands))

    def chat_payload(self, run: RunInput) -> dict[str, Any]:
        prefix, run_options = self.assistant_prefix(run)
        messages = [_ollama_message(m) for m in run.messages]
        if prefix is not None:
            # Ollama continues a final assistant message.
            messages.append({"role": "assistant", "content": prefix})
        payload: dict[str, Any] = {"model": run.target, "messages": messages, "stream": True}
        options: dict[str, Any] = {}
        for key, value in run_options.items():
            if key in _TOP_LEVEL:
                payload[key] = value
            elif key == "response_format":
                wanted = _format(value)
                if wanted is not None:
                    # (An explicit format, Ollama's own spelling, wins.)
                    payload.setdefault("format", wanted)
            elif key != "stream":
                options[_RENAMED.get(key, key)] = value
        if options:
            payload["options"] = options
        return payload

    def execute(self, run: RunInput, emit: Emit) -> "defer.Deferred[None]":
        return self.stream_run(
            "/api/chat", self.chat_payload(run), lambda response, output: ChatLines(output), emit, run
        )

    def tunnel(self, request: TunnelInput, sink: ITunnelSink) -> "defer.Deferred[None]":
        """
        Serve an OpenAI C{POST /embeddings} through Ollama's native
        C{/api/embed}, answered in OpenAI's shape (the one tunnel an Ollama
        provider carries: its /v1 layer is not used). A provider error
        keeps its status; no answer at all fails the tunnel, so the Edge
        may place it elsewhere.
        """
        if request.method != "POST" or request.path.rstrip("/") != "/embeddings":
            raise NotSupported(f"adapter {self.name} (ollama) tunnels only POST /embeddings")
        try:
            body = jsontext.loads(request.body or b"{}")
            model, inputs = body["model"], body["input"]
        except (ValueError, KeyError, TypeError):
            _answer(sink, 400, _openai_error("the body needs model and input", "invalid_request_error"))
            return defer.succeed(None)
        d = self.fetch_json("POST", "/api/embed", {"model": model, "input": inputs})

        def embedded(result: Any) -> None:
            result = result or {}
            vectors = (result.get("embeddings") or []) if isinstance(result, dict) else None
            if not isinstance(vectors, list):
                raise broken_answer("Ollama's embed answer has no list of embeddings")
            prompt_tokens = _count(result.get("prompt_eval_count"))
            _answer(
                sink,
                200,
                {
                    "object": "list",
                    "data": [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(vectors)],
                    "model": model,
                    "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
                },
            )
            sink.usage(Usage(input_tokens=prompt_tokens))

        def failed(failure: Failure) -> Failure | None:
            failure.trap(ProviderError)
            assert isinstance(failure.value, ProviderError)
            if not failure.value.status:
                return failure
            _answer(sink, failure.value.status, _openai_error(failure.value.message, "api_error"))
            return None

        return d.addCallbacks(embedded, failed)

    def command(self, name: str, args: dict[str, Any], progress: Progress | None = None) -> "defer.Deferred[Any]":
        """
        The Ollama model API. C{args} carries C{model} for show, pull and
        delete. @return: a Deferred firing with Ollama's parsed JSON
        (C{None} for an empty body, as delete answers); a pull answers its
        last status line.
        """
        if name not in self.COMMANDS:
            return super().command(name, args, progress)
        method, path, needs_model = self.COMMANDS[name]
        if not needs_model:
            return self.fetch_json(method, path)
        model = (args or {}).get("model")
        if not isinstance(model, str) or not model:
            return defer.fail(ValueError(f"{name} needs args.model"))
        if name == "ollama_pull":
            return self.pull(model, progress)
        return self.fetch_json(method, path, {"model": model})

    def pull(self, model: str, progress: Progress | None = None) -> "defer.Deferred[dict[str, Any]]":
        """
        Pull a model with Ollama's streamed progress: each status line goes
        to C{progress} as it arrives (its C{status}, C{completed}, C{total}
        and C{digest}), so a long pull is visible, stays within the idle
        timeout, and can be cancelled at any point (the connection closes,
        and Ollama stops the pull).

        @return: a cancellable Deferred firing with the last status line.
        """
        lines = PullLines(progress)
        error_body = bytearray()

        def on_response(response: IResponse) -> ChunkReceiver:
            if not 200 <= response.code < 300:
                return capped_appender(error_body, ERROR_BODY_LIMIT)
            return lines.feed

        def ended(response: IResponse) -> dict[str, Any]:
            if not 200 <= response.code < 300:
                raise ProviderError(error_message(bytes(error_body)) or f"HTTP {response.code}", response.code)
            return lines.finish()

        # A pull is no answer: only the idle deadline bounds it (a big
        # layer may be verified for minutes without a word).
        request = self.request("POST", "/api/pull", json={"model": model, "stream": True})
        d = self.read(request, on_response, deadlines=self.deadlines.idle_only())
        return d.addCallback(ended).addErrback(as_provider_error)
