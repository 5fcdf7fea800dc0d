"""
Node commands: questions the Edge asks a Node outside of any run.

The common commands (C{capabilities}, C{transport_status},
C{usage_status}, C{session_list}) are answered here from the Node's own
state; anything else is an adapter's own command (the Ollama model API)
and is passed to the named adapter's C{command}.
"""

import json

from twisted.internet import defer
from twisted.logger import Logger

from iop.adapters.interface import NotSupported
from iop.protocols import iop_pb2


class CommandError(Exception):
    """
    A command that cannot be answered; the message goes to the Edge.
    """


class CommandHandler:
    """
    Answers the C{NodeCommandRequest}s of one connection.

    @param context: the L{iop.node.context.NodeContext}.
    @param send: sends one wire message (a no-op once the connection is gone).
    """

    log = Logger()

    def __init__(self, context, send):
        self.context = context
        self.send = send
        self._pending = set()

    def handle(self, request):
        """
        Answer one request with exactly one C{NodeCommandResponse}.
        """
        d = defer.maybeDeferred(self._run, request)
        self._pending.add(d)
        d.addBoth(self._forget, d)
        d.addCallback(json.dumps)
        d.addCallbacks(
            lambda result: iop_pb2.NodeCommandResponse(request_id=request.request_id, ok=True, result_json=result),
            lambda failure: self._error(request, failure),
        )
        d.addCallback(self.send)
        d.addErrback(lambda f: self.log.failure("answering command {command} failed", f, command=request.command))
        return d

    def cancel_all(self):
        """
        The connection is gone: stop waiting for adapter commands.
        """
        for d in list(self._pending):
            d.cancel()

    def _forget(self, result, d):
        self._pending.discard(d)
        return result

    def _error(self, request, failure):
        if failure.check(defer.CancelledError):
            message = "command cancelled"
        elif failure.check(CommandError, NotSupported):
            message = str(failure.value)
        else:
            self.log.failure("command {command} failed", failure, command=request.command)
            message = f"{request.command} failed: {failure.value}"
        return iop_pb2.NodeCommandResponse(request_id=request.request_id, ok=False, error=message)

    def _run(self, request):
        try:
            args = json.loads(request.args_json) if request.args_json else {}
        except ValueError as e:
            raise CommandError(f"args_json is not valid JSON: {e}") from None
        common = {
            "capabilities": self.capabilities,
            "transport_status": self.transport_status,
            "usage_status": self.usage_status,
            "session_list": self.session_list,
        }
        if request.command in common:
            return common[request.command](request.adapter, args)
        if not request.adapter:
            raise CommandError(f"command {request.command!r} is not a node command; name the adapter it is for")
        return self._hosted(request.adapter).adapter.command(request.command, args)

    def _hosted(self, name):
        hosted = self.context.host.get(name)
        if hosted is None:
            raise CommandError(f"no adapter named {name!r} on this node")
        return hosted

    def _selected(self, adapter):
        if adapter:
            return [self._hosted(adapter)]
        return self.context.host.all()

    def capabilities(self, adapter, args):
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
                    "in_use": hosted.gate.in_use,
                }
            )
        return {"adapters": result}

    def transport_status(self, adapter, args):
        return self.context.transport.snapshot()

    def usage_status(self, adapter, args):
        usage = self.context.usage.snapshot()
        if adapter:
            self._hosted(adapter)
            usage = {adapter: usage.get(adapter, {})}
        return {"adapters": usage}

    @defer.inlineCallbacks
    def session_list(self, adapter, args):
        selected = [h for h in self._selected(adapter) if h.adapter.capabilities().sessions]
        if adapter and not selected:
            raise CommandError(f"adapter {adapter} does not support sessions")
        result = {}
        for hosted in selected:
            result[hosted.name] = yield defer.maybeDeferred(hosted.adapter.command, "session_list", args)
        return {"adapters": result}
