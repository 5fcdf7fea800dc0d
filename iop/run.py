"""
The run vocabulary: what every layer of iop says about a piece of work.

This module is the ground floor. The wire (L{iop.protocols}), the Edge,
the Node and the adapters all import it, and it imports none of them, so
the Edge can speak of runs without importing a single back end.

It holds:

  - the event types of a normalized run and which of them are terminals;
  - L{Usage}, L{RunFailure} and L{RunEventData}, the plain data that
    adapters emit, the Node puts on the wire and the Edge renders;
  - L{ITunnelSink}, where a provider tunnel's raw response goes;
  - the adapter-type catalogue (L{ADAPTER_TYPES}, L{TUNNEL_TYPES}) and
    the node commands every Node answers (L{COMMON_COMMANDS});
  - every failure code a run or tunnel can end with (L{FAILURE_CODES}).
"""

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from zope.interface import Interface

# -- event types --------------------------------------------------------------

#: Event types a run may emit, in this order: C{start}, any number of
#: C{delta} / C{reasoning_delta} / C{tool_call}, then exactly one terminal.
START = "start"
DELTA = "delta"
REASONING_DELTA = "reasoning_delta"
TOOL_CALL = "tool_call"
COMPLETE = "complete"
ERROR = "error"
CANCELLED = "cancelled"
TERMINAL_TYPES = frozenset({COMPLETE, ERROR, CANCELLED})
EVENT_TYPES = frozenset({START, DELTA, REASONING_DELTA, TOOL_CALL}) | TERMINAL_TYPES

#: Why a run completed, as OpenAI says it (on the C{complete} terminal;
#: absent when the back end did not say). A cancelled run has no finish
#: reason: it ends C{cancelled}.
FINISH_REASONS = frozenset({"stop", "length", "tool_calls", "content_filter"})


# -- the data of a run ----------------------------------------------------------


@dataclass
class Usage:
    """
    Token counts exactly as the provider reported them.

    The breakdown fields are C{None} unless the provider reported them:
    absent is not zero, and nothing here is ever estimated.
    """

    input_tokens: int = 0
    output_tokens: int = 0
    reasoning_tokens: int | None = None
    cached_input_tokens: int | None = None


@dataclass
class RunFailure:
    """
    Why a run or tunnel ended in C{error} (or C{cancelled}).

    @ivar code: one of L{FAILURE_CODES}.
    @ivar status: the provider's HTTP status or the process exit code,
        when there is one; 0 otherwise.
    @ivar deadline: for C{provider_timeout}, which deadline passed
        (L{DEADLINES}); empty otherwise.
    @ivar retry_after_sec: the delay a provider asked for with
        C{Retry-After} on a 429 or 503; 0 when it asked for none.
    """

    code: str
    message: str
    status: int = 0
    deadline: str = ""
    retry_after_sec: float = 0.0


@dataclass
class ToolCall:
    """
    A function the model asks the caller to call (a C{tool_call} event).

    @ivar arguments: the arguments as a JSON text, as OpenAI carries them.
    """

    id: str
    name: str
    arguments: str = "{}"


@dataclass
class RunEventData:
    """
    One event of a normalized run, as an adapter emits it.

    @ivar finish_reason: on C{complete}: one of L{FINISH_REASONS}, or
        C{None} when the back end did not say.
    @ivar tool_call: on C{tool_call}: the L{ToolCall}.
    """

    type: str
    text: str = ""
    usage: Usage | None = None
    error: RunFailure | None = None
    finish_reason: str | None = None
    tool_call: ToolCall | None = None


def joinable(event: RunEventData) -> bool:
    """
    Whether C{event} is text alone (a C{delta} or C{reasoning_delta} with
    nothing else on it), which may be joined with its neighbours of the
    same type: the text, its order and everything else stay the same.
    """
    return (
        event.type in (DELTA, REASONING_DELTA)
        and isinstance(event.text, str)
        and bool(event.text)
        and event.usage is None
        and event.error is None
        and event.finish_reason is None
        and event.tool_call is None
    )


_SURROGATE = re.compile("[\ud800-\udfff]")


def clean_text(text: str) -> str:
    """
    C{text} made fit for UTF-8 (and so for the wire and the store): the two
    halves of a character written as a surrogate pair (as a JSON text may
    write it) become that character, and a lone surrogate (half of a
    character a server cut in two) becomes U+FFFD.
    """
    if text.isascii() or _SURROGATE.search(text) is None:
        return text
    return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")


class HeldDeltas:
    """
    Consecutive L{joinable} deltas of one type held for C{send}, to go out
    as one delta (their text joined) when the holder says (L{flush}) or
    before the next event that is not text of their type; anything else
    goes out at once, after what was held.

    @param send: sends one event on.
    """

    def __init__(self, send: Callable[[RunEventData], object]) -> None:
        self._send = send
        #: The type of the deltas held, C{None} while nothing is.
        self.held_type: str | None = None
        self._texts: list[str] = []
        self._chars = 0

    def __call__(self, event: RunEventData) -> None:
        if not joinable(event):
            self.flush()
            self._send(event)
            return
        if self.held_type != event.type:
            self.flush()
            self.held_type = event.type
        self._texts.append(event.text)
        self._chars += len(event.text)
        if self._chars >= HELD_MAX_CHARS:
            self.flush()

    def flush(self) -> None:
        """
        Send what is held now, as one delta (as several of at most
        L{HELD_MAX_CHARS} characters when it is longer: one event must
        fit in a frame).
        """
        if self.held_type is None:
            return
        kind, texts = self.held_type, self._texts
        self.held_type, self._texts, self._chars = None, [], 0
        text = texts[0] if len(texts) == 1 else "".join(texts)
        if len(text) <= HELD_MAX_CHARS:
            self._send(RunEventData(kind, text=text))
            return
        for start in range(0, len(text), HELD_MAX_CHARS):
            self._send(RunEventData(kind, text=text[start : start + HELD_MAX_CHARS]))


#: The most characters one joined delta holds (at most 4 MiB as UTF-8, well
#: inside the wire's 16 MiB frames).
HELD_MAX_CHARS = 1 << 20


class ITunnelSink(Interface):
    """
    Where a tunnel's provider response goes, in order: C{status}, then
    C{headers}, then any number of C{body} calls. C{usage} and C{metadata}
    are side observations and may come at any point after C{headers}.
    """

    def status(code: int) -> None:
        """The provider's HTTP status code."""

    def headers(pairs: list[tuple[str, str]]) -> None:
        """The provider's response headers as C{[(name, value)]}."""

    def body(data: bytes) -> None:
        """Raw response bytes, exactly as they arrived."""

    def usage(usage: Usage) -> None:
        """A L{Usage} parsed from the relayed stream."""

    def metadata(info: dict[str, Any]) -> None:
        """Other observations (model name, finish reason) as a dict."""


# -- adapter types ----------------------------------------------------------------

#: Adapter types by name, each the dotted path of its class: naming a type
#: (in config validation, on the Edge) never imports a back end.
ADAPTER_TYPES = {
    "echo": "iop.adapters.echo.EchoAdapter",
    "openai_compat": "iop.adapters.openai_compat.OpenAICompatAdapter",
    "vllm": "iop.adapters.vllm.VLLMAdapter",
    "ollama": "iop.adapters.ollama.OllamaAdapter",
    "cli": "iop.adapters.cli.CLIAdapter",
}

#: Types whose back end speaks OpenAI-compatible HTTP: the Edge sends their
#: OpenAI-surface requests as raw provider tunnels.
TUNNEL_TYPES = frozenset({"openai_compat", "vllm"})

#: Adapter types whose back end is an HTTP server at their C{base_url}.
HTTP_TYPES = frozenset({"openai_compat", "vllm", "ollama"})

#: OpenAI endpoints (paths under the provider's base URL) and the adapter
#: types that carry each as a tunnel. Chat completions can also run on any
#: other type as a normalized run; the others cannot. An C{ollama}
#: adapter's tunnel serves embeddings by translating them to its native
#: /api/embed.
ENDPOINT_TYPES = {
    "/chat/completions": TUNNEL_TYPES,
    "/completions": TUNNEL_TYPES,
    "/responses": TUNNEL_TYPES,
    "/embeddings": TUNNEL_TYPES | {"ollama"},
}


#: The run option (in C{RunRequest.options_json}) carrying a partial answer
#: to continue: an adapter whose back end supports it (C{continuation: true})
#: sends it as a final assistant message, and the model goes on from there.
ASSISTANT_PREFIX_OPTION = "assistant_prefix"

#: The node command an HTTP adapter answers to say whether its provider is
#: up (a cheap request): C{{"ok": true}}, or C{{"ok": false, "reason": ...}}.
PROBE_COMMAND = "probe"

#: Node commands every Node answers from its own state.
COMMON_COMMANDS = ("capabilities", "transport_status", "usage_status", "session_list", "run_get", "run_list")

#: Why a node command or a session termination was not done, on the wire
#: (C{NodeCommandResponse.code}, C{CancelResponse.code}).
UNKNOWN_COMMAND = "unknown_command"
NOT_SUPPORTED = "not_supported"
INVALID_ARGS = "invalid_args"
UNKNOWN_SESSION = "unknown_session"
UNKNOWN_RUN = "unknown_run"
REFRESH_REFUSED = "refused"
FAILED = "failed"


# -- failure codes ------------------------------------------------------------------

#: Where the work was refused or lost (Node and Edge).
UNKNOWN_ADAPTER = "unknown_adapter"
CAPACITY_EXCEEDED = "capacity_exceeded"
NODE_DRAINING = "node_draining"
NODE_DISCONNECTED = "node_disconnected"
SEND_FAILED = "send_failed"
SHUTTING_DOWN = "shutting_down"
PROTOCOL_ERROR = "protocol_error"
INVALID_REQUEST = "invalid_request"
TUNNEL_NOT_SUPPORTED = "tunnel_not_supported"
ADAPTER_ERROR = "adapter_error"
#: A run the Node's store found C{running} from a previous process.
NODE_RESTARTED = "node_restarted"
#: The back end's own failures (HTTP adapters).
PROVIDER_ERROR = "provider_error"
PROVIDER_TIMEOUT = "provider_timeout"
PROVIDER_UNREACHABLE = "provider_unreachable"
#: The provider refused the prompt as longer than its context (an HTTP 400
#: saying so): a model group's C{context_fallbacks} may take it.
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
#: The answer was cut, stalled or malformed after its first byte reached
#: the caller: it ends with an explicit error, never like a success.
INCOMPLETE = "incomplete"
#: Which deadline a C{provider_timeout} missed (C{RunFailure.deadline}):
#: no first body byte in C{first_byte_timeout_sec}, silence between events
#: past C{stall_timeout_sec} once streaming, or nothing at all for
#: C{idle_timeout_sec}.
FIRST_BYTE = "first_byte"
STALL = "stall"
IDLE = "idle"
DEADLINES = (FIRST_BYTE, STALL, IDLE)
#: A command-line back end's failures.
SPAWN_FAILED = "spawn_failed"
EXIT_STATUS = "exit_status"
TIMEOUT = "timeout"
SESSION_BUSY = "session_busy"
SESSION_TERMINATED = "session_terminated"
#: The run's session belongs to another caller key (docs/edge.md,
#: "Isolation"): the Node refuses it before its adapter sees it.
SESSION_OWNED = "session_owned"
ADAPTER_STOPPED = "adapter_stopped"

#: Every failure code a run or tunnel may end with: code -> (who says it,
#: what it means). C{cancelled} is the code of every C{cancelled} terminal.
FAILURE_CODES = {
    CANCELLED: ("Node, Edge", "the caller, the Edge or a drain cancelled the work"),
    UNKNOWN_ADAPTER: ("Node", "no adapter of that name on the node"),
    CAPACITY_EXCEEDED: ("Node", "the adapter's gate is at max_concurrency"),
    NODE_DRAINING: ("Node", "the node is shutting down and takes no new work"),
    INVALID_REQUEST: ("Node", "the run request could not be read (bad options JSON, ...)"),
    TUNNEL_NOT_SUPPORTED: ("Node", "the adapter has no raw HTTP back end"),
    ADAPTER_ERROR: ("Node", "the adapter failed in an unexpected way"),
    NODE_RESTARTED: ("Node", "the node process ended while the run was in progress (found at its next start)"),
    NODE_DISCONNECTED: ("Edge", "the node's connection was lost mid-work"),
    SEND_FAILED: ("Edge", "the request could not be sent to the node"),
    SHUTTING_DOWN: ("Edge", "the Edge is draining: queued work refused, in-flight work past the grace cancelled"),
    PROTOCOL_ERROR: ("Edge", "the node sent a malformed message for this work (the work ends, the connection stays)"),
    PROVIDER_ERROR: ("adapter", "the provider answered an error status or broke the stream"),
    PROVIDER_TIMEOUT: (
        "adapter",
        "the provider missed a deadline (deadline: first_byte_timeout_sec, stall_timeout_sec or idle_timeout_sec)",
    ),
    CONTEXT_LENGTH_EXCEEDED: ("adapter", "the provider refused the prompt as longer than the model's context"),
    INCOMPLETE: ("adapter, Edge", "the answer was cut, stalled or malformed after its first byte reached the caller"),
    PROVIDER_UNREACHABLE: ("adapter", "the provider could not be connected to"),
    SPAWN_FAILED: ("cli adapter", "the command could not be started"),
    EXIT_STATUS: ("cli adapter", "the command exited non-zero (status = exit code)"),
    TIMEOUT: ("cli adapter", "the command ran past timeout_sec and was killed"),
    SESSION_BUSY: ("cli adapter", "the session already has a run in progress"),
    SESSION_TERMINATED: ("cli adapter", "the run's session was terminated"),
    SESSION_OWNED: ("Node", "the run's session belongs to another caller key (the key whose run first used it)"),
    ADAPTER_STOPPED: ("cli adapter", "the adapter was stopped under the run"),
}
