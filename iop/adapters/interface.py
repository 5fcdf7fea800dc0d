"""
What a back end looks like to a Node.

Adapters know nothing of the wire or the Edge: they turn a L{RunInput} into
a sequence of L{iop.run.RunEventData} (normalized runs) or relay a provider's raw
HTTP response into an L{iop.run.ITunnelSink} (tunnels). The Node session puts both
on the wire.

Cancellation is Twisted's: the Deferred returned by C{execute} or C{tunnel}
is cancellable, and its canceller must abort the back-end request or kill
the process. The Node, not the adapter, synthesizes a missing terminal and
enforces the capacity gate.
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from twisted.internet.defer import Deferred
from zope.interface import Attribute, Interface

from iop.run import ITunnelSink, RunEventData

#: Where a run's events go: called once per event, in order.
Emit = Callable[[RunEventData], None]
#: Where a command's progress updates go (a JSON object each).
Progress = Callable[[dict[str, Any]], None]


@dataclass
class RunInput:
    """
    What a normalized run asks of an adapter.

    @ivar messages: chat messages as C{{"role": ..., "content": ...}} dicts;
        a plain text input arrives as one user message.
    @ivar options: extra generation parameters (temperature, max_tokens...).
    @ivar traceparent: the W3C trace context of the Edge's span for the
        request (empty: none); an HTTP adapter sends it to the provider as
        its C{traceparent} header.
    """

    run_id: str
    target: str = ""
    messages: list[dict[str, Any]] = field(default_factory=list)
    session_id: str = ""
    background: bool = False
    options: dict[str, Any] = field(default_factory=dict)
    traceparent: str = ""

    def last_user_text(self) -> object:
        """
        The content of the last user message, or C{""}: as the message
        carries it, so usually a string but possibly OpenAI-style content
        (a list of parts) or any other JSON value; callers that need text
        check or convert it.
        """
        for message in reversed(self.messages):
            if message.get("role") == "user":
                content: object = message.get("content") or ""
                return content
        return ""


@dataclass
class TunnelInput:
    """
    A raw provider HTTP request to relay. C{path} is relative to the
    adapter's base URL (for example C{/chat/completions}).
    """

    tunnel_id: str
    method: str
    path: str
    headers: list[tuple[str, str]] = field(default_factory=list)
    body: bytes = b""


@dataclass(frozen=True)
class Capabilities:
    """
    What an adapter instance can do.

    @ivar max_concurrency: how many runs and tunnels together the back end
        takes at once; the Node's capacity gate enforces it.
    @ivar sessions: whether it keeps logical sessions and can terminate one.
    @ivar tunnel: whether it can relay raw provider HTTP (OpenAI-compatible).
    @ivar commands: the node commands it answers besides the common ones.
    @ivar continuation: whether its back end continues a partial answer
        given as a final assistant message (the C{continuation} option).
    """

    max_concurrency: int
    sessions: bool = False
    tunnel: bool = False
    commands: tuple[str, ...] = ()
    continuation: bool = False


class NotSupported(Exception):
    """
    The adapter does not offer this operation (sessions, tunnels, a command).
    """


class AdapterConfigError(ValueError):
    """
    An adapter's configuration is invalid. The message names the adapter
    and the key (C{adapters[gpu].base_url is required for type vllm});
    C{key} and C{problem} are kept apart so that the Edge, checking
    C{edge.yaml} at load, can name the key where the file has it
    (C{nodes[0].adapters[1].base_url}).
    """

    def __init__(self, adapter: str, key: str, problem: str) -> None:
        super().__init__(f"adapters[{adapter}].{key} {problem}")
        self.key = key
        self.problem = problem


class IAdapter(Interface):
    """
    One configured back end on a Node.
    """

    name = Attribute("The adapter instance's configured name.")
    type = Attribute("The adapter type (echo, openai_compat, vllm, ollama, cli).")

    def capabilities() -> Capabilities:
        """
        @rtype: L{Capabilities}
        """

    def start() -> "Deferred[None]":
        """
        Prepare the back end. @return: a Deferred firing when ready.
        """

    def stop() -> "Deferred[None]":
        """
        Release everything; in-flight work is cancelled by the Node first.
        @return: a Deferred firing when done.
        """

    def execute(run: RunInput, emit: Emit) -> "Deferred[Any]":
        """
        Run C{run} (a L{RunInput}), calling C{emit(RunEventData)} for every
        event in order. It may emit a terminal event itself; if it does
        not, the Node synthesizes one from how the Deferred ends.

        @return: a cancellable Deferred that fires when the run is over.
            Cancelling it aborts the back-end request or process.
        """

    def tunnel(request: TunnelInput, sink: ITunnelSink) -> "Deferred[Any]":
        """
        Relay the raw provider response to C{request} (a L{TunnelInput})
        into C{sink} (an L{iop.run.ITunnelSink}).

        @return: a cancellable Deferred firing when the body is complete;
            cancelling it closes the provider connection.
        @raise NotSupported: if the adapter has no raw HTTP back end.
        """

    def terminate_session(target: str, session_id: str) -> "Deferred[dict[str, bool]]":
        """
        End a logical session.

        @return: a Deferred firing with C{{"terminated": bool}}: whether
            the adapter knew the session.
        @raise NotSupported: if the adapter keeps no sessions.
        """

    def command(name: str, args: dict[str, Any], progress: Progress | None = None) -> "Deferred[Any]":
        """
        Answer an adapter-specific node command (for example the Ollama
        model API), one of those its C{capabilities().commands} declares.

        @param progress: when not C{None}, C{progress(dict)} may be called
            with updates while the command runs (a model pull's status).
        @return: a Deferred firing with a JSON-able result; cancelling it
            aborts the command.
        @raise NotSupported: for a command it does not know.
        @raise ValueError: for bad C{args}.
        """
