"""
The C{ollama} back end, through Ollama's native API rather than its /v1
compatibility layer: the native stream carries C{message.thinking}
separately and reports token counts on its final line, and the model
management API (list, show, pull, delete, running) exists only there.

Ollama is not an OpenAI tunnel target: its runs are always normalized.
"""

from twisted.internet import defer
from zope.interface import implementer

from iop.adapters.interface import Capabilities, IAdapter
from iop.adapters.streams import HTTPAdapter, NDJSONParser, ProviderError
from iop.run import DELTA, REASONING_DELTA, RunEventData, Usage

#: Run options Ollama takes at the top level of /api/chat; all others are
#: model options and go under C{options}.
_TOP_LEVEL = frozenset({"format", "keep_alive", "think", "tools"})
#: OpenAI option names callers commonly send, in Ollama's spelling.
_RENAMED = {"max_tokens": "num_predict", "max_completion_tokens": "num_predict"}


def _count(value):
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


class ChatLines:
    """
    Decoder for L{HTTPAdapter.stream_run}: NDJSON lines of /api/chat to
    C{reasoning_delta} (C{message.thinking}) and C{delta}
    (C{message.content}); the C{done} line gives the usage.
    """

    def __init__(self, emit):
        self.emit = emit
        self.parser = NDJSONParser()
        self.usage = None

    def feed(self, data):
        self._lines(self.parser.feed, data)

    def finish(self):
        self._lines(self.parser.finish)
        return self.usage

    def _lines(self, parse, *args):
        try:
            lines = parse(*args)
        except ValueError as e:
            raise ProviderError(f"provider sent a line that is not JSON: {e}") from None
        for line in lines:
            if isinstance(line, dict):
                self._line(line)

    def _line(self, line):
        if line.get("error"):
            raise ProviderError(str(line["error"]))
        message = line.get("message") or {}
        for key, kind in (("thinking", REASONING_DELTA), ("content", DELTA)):
            text = message.get(key)
            if isinstance(text, str) and text:
                self.emit(RunEventData(kind, text=text))
        if line.get("done"):
            # Ollama reports no breakdown: reasoning and cached stay None.
            self.usage = Usage(
                input_tokens=_count(line.get("prompt_eval_count")),
                output_tokens=_count(line.get("eval_count")),
            )


@implementer(IAdapter)
class OllamaAdapter(HTTPAdapter):
    """
    Options: C{base_url} (for example C{http://127.0.0.1:11434}, no
    C{/api}), C{api_key} and C{headers} (for an authenticating proxy in
    front), C{connect_timeout_sec}.
    """

    type = "ollama"

    #: command name -> (HTTP method, path, whether it takes a model)
    COMMANDS = {
        "ollama_list": ("GET", "/api/tags", False),
        "ollama_running": ("GET", "/api/ps", False),
        "ollama_show": ("POST", "/api/show", True),
        "ollama_pull": ("POST", "/api/pull", True),
        "ollama_delete": ("DELETE", "/api/delete", True),
    }

    def capabilities(self):
        return Capabilities(max_concurrency=self.max_concurrency, commands=tuple(self.COMMANDS))

    def chat_payload(self, run):
        payload = {"model": run.target, "messages": run.messages, "stream": True}
        options = {}
        for key, value in run.options.items():
            if key in _TOP_LEVEL:
                payload[key] = value
            elif key != "stream":
                options[_RENAMED.get(key, key)] = value
        if options:
            payload["options"] = options
        return payload

    def execute(self, run, emit):
        return self.stream_run("/api/chat", self.chat_payload(run), lambda response: ChatLines(emit), emit)

    def command(self, name, args):
        """
        The Ollama model API. C{args} carries C{model} for show, pull and
        delete. @return: a Deferred firing with Ollama's parsed JSON
        (C{None} for an empty body, as delete answers).
        """
        if name not in self.COMMANDS:
            return super().command(name, args)
        method, path, needs_model = self.COMMANDS[name]
        if not needs_model:
            return self.fetch_json(method, path)
        model = (args or {}).get("model")
        if not isinstance(model, str) or not model:
            return defer.fail(ValueError(f"{name} needs args.model"))
        payload = {"model": model}
        if name == "ollama_pull":
            payload["stream"] = False
        return self.fetch_json(method, path, payload)
