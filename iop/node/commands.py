"""
Node commands: questions the Edge asks a Node outside of any run.

The common commands (L{iop.run.COMMON_COMMANDS}) are answered here from
the Node's own state; anything else is an adapter's own command (the
Ollama model API) and is passed to the named adapter's C{command}. A
command no adapter of this node declares (C{capabilities().commands}) is
unknown; one that another adapter declares is not supported by the named
one.

Every request gets exactly one final C{NodeCommandResponse}; a failed one
carries a code saying whose mistake it was (C{unknown_command},
C{not_supported}, C{unknown_adapter}, C{invalid_args}, C{unknown_run}:
the caller's; C{cancelled}; C{failed}: the back end's). A request with C{stream} set may
first get progress responses (C{progress=true}). The Edge can abort a
command it gave up on (C{CancelRequest(CANCEL_COMMAND)}). An answer too
large for one frame (L{ANSWER_MAX}) could not be sent: the request is
answered C{failed} instead (C{run_get} cuts its answer to fit first,
L{fitted}).
"""

import json
from collections.abc import Callable, Generator
from typing import Any

from twisted.internet import defer
from twisted.internet.defer import Deferred
from twisted.logger import Logger
from twisted.python.failure import Failure

from iop import jsontext
from iop.adapters.interface import NotSupported
from iop.node.context import NodeContext
from iop.node.flow import Message
from iop.node.host import Hosted
from iop.protocols import messages
from iop.protocols.wire import MAX_FRAME_BYTES
from iop.run import (
    CANCELLED,
    COMMON_COMMANDS,
    FAILED,
    INVALID_ARGS,
    NOT_SUPPORTED,
    UNKNOWN_ADAPTER,
    UNKNOWN_COMMAND,
    UNKNOWN_RUN,
)

#: The most runs C{run_list} answers with.
RUN_LIST_MAX = 1000
#: The largest C{result_json} a command answers with: what fits in one
#: frame, with room to spare for the rest of the response.
ANSWER_MAX = MAX_FRAME_BYTES - 64 * 1024


class CommandError(Exception):
    """
    A command that cannot be answered; C{code} and the message go to the
    Edge.
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class CommandHandler:
    """
    Answers the C{NodeCommandRequest}s of one connection.

    @param context: the L{iop.node.context.NodeContext}.
    @param send: sends one wire message (a no-op once the connection is gone).

    @ivar answer_max: the largest C{result_json} sent (L{ANSWER_MAX}).
    """

    log = Logger()
    answer_max = ANSWER_MAX

    def __init__(self, context: NodeContext, send: Callable[[Message], object]) -> None:
        self.context = context
        self.send = send
        self._pending: dict[str, Deferred[Any]] = {}

    def handle(self, request: Message) -> Deferred[None]:
        """
        Answer one request with exactly one final C{NodeCommandResponse}
        (progress responses first, when asked for and available).
        """
        progress = self._progress_sender(request) if request.stream else None
        d = defer.maybeDeferred(self._run, request, progress)
        self._pending[request.request_id] = d
        d.addBoth(self._forget, request.request_id)
        d.addCallback(json.dumps)
        d.addCallbacks(lambda result: self._result(request, result), lambda failure: self._error(request, failure))
        d.addCallback(self.send)
        d.addErrback(lambda f: self.log.failure("answering command {command} failed", f, command=request.command))
        return d

    def cancel(self, request_id: str) -> None:
        """
        The Edge gave up on C{request_id}: abort it (it answers
        C{cancelled}, which the Edge ignores).
        """
        d = self._pending.get(request_id)
        if d is not None:
            self.log.info("command {id} cancelled by the Edge", id=request_id)
            d.cancel()

    def cancel_all(self) -> None:
        """
        The connection is gone: stop waiting for adapter commands.
        """
        for d in list(self._pending.values()):
            d.cancel()

    def _progress_sender(self, request: Message) -> Callable[[object], None]:
        def progress(update: object) -> None:
            if request.request_id in self._pending:
                self.send(messages.command_result(request.request_id, json.dumps(update), progress=True))

        return progress

    def _forget(self, result: object, request_id: str) -> object:
        self._pending.pop(request_id, None)
        return result

    def _result(self, request: Message, result: str) -> Message:
        """
        The answer with C{result} (JSON text, all ASCII), or a C{failed}
        one when it would not fit in a frame (so the request still gets
        its one final answer).
        """
        if len(result) <= self.answer_max:
            return messages.command_result(request.request_id, result)
        self.log.error(
            "command {command}: its answer of {size} bytes is too large to send; answering failed",
            command=request.command,
            size=len(result),
        )
        return messages.command_error(
            request.request_id,
            FAILED,
            f"{request.command}: answer too large ({len(result)} bytes; at most {self.answer_max} fit in a frame)",
        )

    def _error(self, request: Message, failure: Failure) -> Message:
        if failure.check(defer.CancelledError):
            code, message = CANCELLED, "command cancelled"
        elif isinstance(failure.value, CommandError):
            code, message = failure.value.code, str(failure.value)
        elif failure.check(NotSupported):
            code, message = NOT_SUPPORTED, str(failure.value)
        elif failure.check(ValueError):
            code, message = INVALID_ARGS, f"{request.command}: {failure.value}"
        else:
            self.log.failure("command {command} failed", failure, command=request.command)
            code, message = FAILED, f"{request.command} failed: {failure.value}"
        return messages.command_error(request.request_id, code, message)

    def _run(self, request: Message, progress: Callable[[object], None] | None) -> Any:
        try:
            args = jsontext.loads(request.args_json) if request.args_json else {}
        except ValueError as e:
            raise CommandError(INVALID_ARGS, f"args_json is not valid JSON: {e}") from None
        if not isinstance(args, dict):
            raise CommandError(INVALID_ARGS, "args must be a JSON object")
        if request.command in COMMON_COMMANDS:
            return getattr(self, request.command)(request.adapter, args)
        declared = {c for hosted in self.context.host.all() for c in hosted.adapter.capabilities().commands}
        if request.command not in declared:
            raise CommandError(UNKNOWN_COMMAND, f"no command {request.command!r} on this node")
        if not request.adapter:
            raise CommandError(INVALID_ARGS, f"command {request.command!r} is an adapter's: name the adapter")
        hosted = self._hosted(request.adapter)
        if request.command not in hosted.adapter.capabilities().commands:
            raise CommandError(
                NOT_SUPPORTED, f"adapter {hosted.name} ({hosted.adapter.type}) has no command {request.command!r}"
            )
        return hosted.adapter.command(request.command, args, progress)

    def _hosted(self, name: str) -> Hosted:
        hosted = self.context.host.get(name)
        if hosted is None:
            raise CommandError(UNKNOWN_ADAPTER, f"no adapter named {name!r} on this node")
        return hosted

    def _selected(self, adapter: str) -> list[Hosted]:
        if adapter:
            return [self._hosted(adapter)]
        return self.context.host.all()

    # The common commands: each takes the adapter named in the request
    # ("" for all) and the request's arguments, and answers a JSON-able
    # value (or a Deferred of one).

    def capabilities(self, adapter: str, args: dict[str, Any]) -> dict[str, Any]:
        result = []
        for hosted in self._selected(adapter):
            caps = hosted.adapter.capabilities()
            result.append(
                {
                    "name": hosted.name,
                    "type": hosted.adapter.type,
                    "max_concurrency": caps.max_concurrency,
                    "sessions": caps.sessions,
                    "tunnel": caps.tunnel,
                    "commands": list(caps.commands),
                    "continuation": caps.continuation,
                    "in_use": hosted.gate.in_use,
                }
            )
        return {"adapters": result}

    def transport_status(self, adapter: str, args: dict[str, Any]) -> dict[str, Any]:
        return self.context.transport.snapshot()

    def usage_status(self, adapter: str, args: dict[str, Any]) -> dict[str, Any]:
        usage = self.context.usage.snapshot()
        if adapter:
            self._hosted(adapter)
            usage = {adapter: usage.get(adapter, {})}
        return {"adapters": usage}

    @defer.inlineCallbacks
    def session_list(self, adapter: str, args: dict[str, Any]) -> Generator[Deferred[Any], Any, dict[str, Any]]:
        selected = [h for h in self._selected(adapter) if h.adapter.capabilities().sessions]
        if adapter and not selected:
            raise CommandError(NOT_SUPPORTED, f"adapter {adapter} does not support sessions")
        result: dict[str, Any] = {}
        for hosted in selected:
            result[hosted.name] = yield defer.maybeDeferred(hosted.adapter.command, "session_list", args)
        return {"adapters": result}

    def run_get(self, adapter: str, args: dict[str, Any]) -> Deferred[dict[str, Any]]:
        """
        One run or tunnel from the store: C{{"run": row with output,
        "events": [events after args["after"]]}} (without C{output} when
        C{args["output"]} is false), cut to fit in a frame (L{fitted}).
        """
        run_id = args.get("run_id")
        after = args.get("after", 0)
        output = args.get("output", True)
        if not isinstance(run_id, str) or not run_id:
            raise CommandError(INVALID_ARGS, "run_get needs run_id (a string)")
        if not isinstance(after, int) or isinstance(after, bool) or after < 0:
            raise CommandError(INVALID_ARGS, "after must be a non-negative integer")
        if not isinstance(output, bool):
            raise CommandError(INVALID_ARGS, "output must be true or false")
        d = self.context.store.get(run_id, after)

        def found(result: dict[str, Any] | None) -> dict[str, Any]:
            if result is None:
                raise CommandError(UNKNOWN_RUN, f"this node has no record of {run_id}")
            if not output:
                result = dict(result, run={k: v for k, v in result["run"].items() if k != "output"})
            return fitted(result, self.answer_max)

        return d.addCallback(found)

    def run_list(self, adapter: str, args: dict[str, Any]) -> Deferred[dict[str, Any]]:
        """
        The latest runs and tunnels from the store, newest first:
        C{{"runs": [rows]}}, filtered by C{status}, C{kind} and C{caller}
        (the name of the caller key they belong to), at most C{limit} (50;
        up to L{RUN_LIST_MAX}).
        """
        status, kind, limit = args.get("status"), args.get("kind"), args.get("limit", 50)
        caller = args.get("caller")
        for name, value in (("status", status), ("kind", kind), ("caller", caller)):
            if value is not None and not isinstance(value, str):
                raise CommandError(INVALID_ARGS, f"{name} must be a string")
        if not isinstance(limit, int) or isinstance(limit, bool) or not 1 <= limit <= RUN_LIST_MAX:
            raise CommandError(INVALID_ARGS, f"limit must be an integer from 1 to {RUN_LIST_MAX}")
        d = self.context.store.list_runs(status or None, kind or None, limit, caller or None)
        return d.addCallback(lambda rows: {"runs": rows})


def _json_size(value: object) -> int:
    """
    The size in bytes of C{value} as a command's JSON (all ASCII).
    """
    return len(json.dumps(value))


def _prefix(text: str, room: int) -> str:
    """
    The longest start of C{text} whose JSON string (quotes left out) takes
    at most C{room} bytes.
    """
    n = min(len(text), max(room, 0))
    while n > 0:
        size = _json_size(text[:n]) - 2
        if size <= room:
            return text[:n]
        n = min(n - 1, n * room // size)
    return ""


def fitted(answer: dict[str, Any], limit: int) -> dict[str, Any]:
    """
    A C{run_get} answer whose JSON takes at most C{limit} bytes: C{answer}
    itself when it does. Else the run's C{output} comes first — cut to what
    fits when it must, the row then saying C{"output_truncated": true} —
    and the events after it, in order, as many as fit in what is left: when
    some are left out, C{"more_events": true} says so, and the rest are
    those after the last one given (the Edge asks again with C{after} its
    C{seq}).
    """
    if _json_size(answer) <= limit:
        return answer
    run = {k: v for k, v in answer["run"].items() if k != "output"}
    events: list[dict[str, Any]] = answer.get("events", [])
    # Everything but the output's text and the events, keys that may be
    # added included.
    shell: dict[str, Any] = {"run": dict(run, output="", output_truncated=True), "events": [], "more_events": True}
    room = limit - _json_size(shell)
    if "output" in answer["run"]:
        output = answer["run"]["output"]
        if _json_size(output) - 2 > room:
            output = _prefix(output, room)
            run["output_truncated"] = True
        run["output"] = output
        room -= _json_size(output) - 2
    kept: list[dict[str, Any]] = []
    for event in events:
        # (With the separator before it.)
        size = _json_size(event) + 2
        if size > room:
            break
        kept.append(event)
        room -= size
    result: dict[str, Any] = {"run": run, "events": kept}
    if len(kept) < len(events):
        result["more_events"] = True
    return result
