"""
Node commands: questions the Edge asks a Node outside of any run (its
models, a model pull, its run history), and the end of a logical session.

Each question goes to one ready Node with a request id the in-flight
table waits on (L{iop.edge.inflight.Inflight.expect}); it waits at most
its timeout (C{commands} in edge.yaml), and when the Edge gives up, or the
caller leaves, the Node is told to abort it. A failed answer's code says
whose mistake it was (L{iop.node.commands} answers them).
"""

import json
from collections.abc import Callable
from typing import Any

from google.protobuf.message import Message
from twisted.internet import defer
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime

from iop import jsontext
from iop.edge.config import EdgeConfig
from iop.edge.drain import Drain, shutting_down
from iop.edge.errors import ServiceError
from iop.edge.inflight import Inflight
from iop.edge.placement import Placer
from iop.edge.registry import NodeRegistry
from iop.edge.spec import new_id
from iop.protocols import messages
from iop.run import (
    CANCELLED,
    FAILED,
    INVALID_ARGS,
    NOT_SUPPORTED,
    UNKNOWN_ADAPTER,
    UNKNOWN_COMMAND,
    UNKNOWN_RUN,
)

#: What a failed node command's code says about whose mistake it was.
_COMMAND_FAILURE_KINDS = {
    UNKNOWN_COMMAND: "invalid",
    NOT_SUPPORTED: "invalid",
    INVALID_ARGS: "invalid",
    UNKNOWN_ADAPTER: "not_found",
    UNKNOWN_RUN: "not_found",
    CANCELLED: "unavailable",
}


class NodeCommands:
    """
    @param config: returns the running L{EdgeConfig} (nodes, command
        timeouts).
    @param clock: for the timeouts.
    @param drain: a draining Edge asks nothing.
    """

    def __init__(
        self,
        config: Callable[[], EdgeConfig],
        clock: IReactorTime,
        registry: NodeRegistry,
        placer: Placer,
        inflight: Inflight,
        drain: Drain,
    ) -> None:
        self._config = config
        self.clock = clock
        self.registry = registry
        self.placer = placer
        self.inflight = inflight
        self.drain = drain

    def command(
        self,
        node_id: str,
        command: str,
        adapter: str = "",
        args: dict[str, Any] | None = None,
        progress: Callable[[dict[str, Any]], object] | None = None,
    ) -> "Deferred[Any]":
        """
        Run a node command, waiting at most its timeout (C{commands} in
        edge.yaml); when the Edge gives up, or the Deferred is cancelled
        (the caller left), the Node is told to abort it.

        @param progress: when given, the Node is asked for progress and
            C{progress(dict)} is called with each update (a model pull's
            status, completed, total).
        @return: a Deferred firing with the command's JSON result.
        """
        request_id = new_id("cmd")
        message = messages.command_request(
            request_id, command, adapter, json.dumps(args or {}), stream=progress is not None
        )

        def on_progress(update: messages.NodeCommandResponse) -> None:
            assert progress is not None
            try:
                parsed = jsontext.loads(update.result_json)
            except ValueError:
                raise ServiceError(
                    "failed", f"node {node_id} sent {command} progress that is not JSON", code="protocol_error"
                ) from None
            progress(parsed)

        abort = messages.cancel_command(request_id)

        def answered(response: messages.NodeCommandResponse) -> Any:
            if not response.ok:
                kind = _COMMAND_FAILURE_KINDS.get(response.code, "failed")
                raise ServiceError(
                    kind, response.error or f"command {command} failed", code=response.code or "command_failed"
                )
            try:
                return jsontext.loads(response.result_json) if response.result_json else None
            except ValueError:
                raise ServiceError(
                    "failed", f"node {node_id} answered {command} with a result that is not JSON", code="protocol_error"
                ) from None

        d = self._ask(
            node_id,
            message,
            request_id,
            self._config().command_timeout(command),
            None if progress is None else on_progress,
            abort,
        )
        return d.addCallback(answered)

    def terminate_session(
        self, node_id: str | None, adapter: str, target: str, session_id: str, caller: str
    ) -> "Deferred[tuple[bool, str, str]]":
        """
        End a logical session (on the only node running C{adapter} when
        C{node_id} is not given).

        @param caller: the name of the caller key asking (the owner name
            its runs carry in C{RunRequest.caller}): the Node ends only that
            key's sessions, another key's being C{unknown_session}; empty
            for an admin key, which may end any (docs/edge.md, "Isolation").
        @return: a Deferred firing with C{(ok, reason, code)}; C{code} says
            why not (C{unknown_session}, C{not_supported},
            C{unknown_adapter}, C{failed}).
        """
        if not node_id:
            try:
                node_id = self.placer.single_node(adapter)
            except ServiceError as e:
                return defer.fail(e)
        request_id = new_id("term")
        message = messages.terminate_session(request_id, adapter, target, session_id, caller)
        d = self._ask(node_id, message, request_id, self._config().command_timeout(None))
        return d.addCallback(lambda r: (r.ok, r.reason, "" if r.ok else r.code or FAILED))

    def _ask(
        self,
        node_id: str,
        message: Message,
        request_id: str,
        timeout: float,
        on_progress: Callable[[Any], object] | None = None,
        abort: messages.CancelRequest | None = None,
    ) -> "Deferred[Any]":
        """
        Send C{message} to C{node_id} and wait for the answer to
        C{request_id}, at most C{timeout} seconds; C{abort} is what tells
        the Node to stop when the Edge gives up.
        """
        if self.drain.draining:
            return defer.fail(shutting_down())
        if self._config().node(node_id) is None:
            return defer.fail(ServiceError("not_found", f"no node {node_id!r} is configured"))
        link = self.registry.ready_link(node_id)
        if link is None:
            return defer.fail(ServiceError("unavailable", f"node {node_id} is not connected"))

        tell_node = None if abort is None else (lambda: link.send_quietly(abort))
        d = self.inflight.expect(link, request_id, on_progress, tell_node)
        try:
            link.wire.send(message)
        except Exception as e:
            self.inflight.unexpect(request_id)
            return defer.fail(ServiceError("failed", f"could not send to node {node_id}: {e}"))

        def timed_out(result: object, timeout: float) -> None:
            raise ServiceError("timeout", f"node {node_id} did not answer within {timeout:g}s")

        return d.addTimeout(timeout, self.clock, onTimeoutCancel=timed_out)
