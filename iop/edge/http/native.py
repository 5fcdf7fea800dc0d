"""
The native surface: runs as event streams, cancel, sessions, node
commands and the status snapshot.

  POST /v1/runs                     submit a run; text/event-stream of events
  POST /v1/runs/{run_id}/cancel     cancel a run in flight
  POST /v1/sessions/terminate       end a logical session on a node
  POST /v1/nodes/{node}/commands    run a node command (admin)
  GET  /v1/status                   every configured node and model group
"""

from twisted.web.server import NOT_DONE_YET
from zope.interface import implementer

from iop.edge.dispatch import IRunListener
from iop.edge.errors import ServiceError
from iop.edge.http.common import Call, EventStream, HTTPError, JSONResource, error_body, write_json
from iop.edge.http.notes import note_usage
from iop.edge.http.openai import parse_messages
from iop.edge.http.validate import boolean, invalid, mapping, string
from iop.edge.spec import RunSpec
from iop.protocols.convert import usage_to_json
from iop.run import TERMINAL_TYPES


def run_event_json(run_id, event):
    """
    One native event: C{run_id}, C{type}, C{text} for deltas, C{tool_call}
    (C{id}, C{name}, C{arguments}) for a tool call, C{usage},
    C{finish_reason} and C{error} on terminals (usage breakdown only when
    reported).
    """
    payload = {"run_id": run_id, "type": event.type}
    if event.text:
        payload["text"] = event.text
    if event.tool_call is not None:
        call = event.tool_call
        payload["tool_call"] = {"id": call.id, "name": call.name, "arguments": call.arguments}
    if event.finish_reason:
        payload["finish_reason"] = event.finish_reason
    if event.usage is not None:
        payload["usage"] = usage_to_json(event.usage)
    if event.error is not None:
        payload["error"] = {"code": event.error.code, "message": event.error.message}
        if event.error.status:
            payload["error"]["status"] = event.error.status
    return payload


@implementer(IRunListener)
class EventStreamListener:
    """
    Native run events as SSE, one C{data:} JSON per event.
    """

    def __init__(self, call, run_id):
        self.call = call
        self.run_id = run_id
        self.stream = EventStream(call.request)

    def use_producer(self, producer):
        self.call.use_producer(producer)

    def event(self, event):
        if self.call.gone:
            return
        self.stream.send(run_event_json(self.run_id, event))
        if event.type in TERMINAL_TYPES:
            note_usage(self.call.request, event.usage)
            self.call.finish()


@implementer(IRunListener)
class CollectingListener:
    """
    For C{"stream": false}: every event, answered as one JSON document.
    """

    def __init__(self, call, run_id):
        self.call = call
        self.run_id = run_id
        self.events = []

    def event(self, event):
        self.events.append(run_event_json(self.run_id, event))
        if event.type in TERMINAL_TYPES and not self.call.gone:
            note_usage(self.call.request, event.usage)
            text = "".join(e.get("text", "") for e in self.events if e["type"] == "delta")
            result = {"run_id": self.run_id, "status": event.type, "text": text, "events": self.events}
            write_json(self.call.request, 200, result)


def parse_run(body):
    """
    The native run request, every field checked: C{adapter} (or C{model}),
    C{target}, C{input} as text or chat messages, C{node}, C{session_id},
    C{background}, C{options}.

    @raise HTTPError: naming the first bad field.
    """
    value = body.get("input")
    if isinstance(value, str):
        messages = [{"role": "user", "content": value}]
    elif isinstance(value, list):
        messages = parse_messages(value, "input")
    else:
        raise invalid("input", "must be text or a list of messages", "invalid_input")
    adapter, model = string(body, "adapter"), string(body, "model") or None
    if not adapter and not model:
        raise invalid("adapter", "adapter (or model) is required", "missing_adapter")
    return RunSpec(
        messages=messages,
        adapter=adapter,
        model=model,
        target=string(body, "target"),
        node=string(body, "node") or None,
        session_id=string(body, "session_id"),
        background=boolean(body, "background"),
        options=mapping(body, "options"),
    )


class Runs(JSONResource):
    def handle_POST(self, request):
        body = self.read_json(request)
        spec = parse_run(body)
        listener_class = EventStreamListener if boolean(body, "stream", True) else CollectingListener
        call = Call(self.service, request)
        return call.submit(spec, lambda kind, run_id: listener_class(call, run_id))


class CancelRun(JSONResource):
    def handle_POST(self, request):
        run_id = request.path_params["run_id"]
        if not self.service.cancel(run_id):
            raise HTTPError("not_found", f"no run {run_id} is in flight", code="run_not_found")
        return {"run_id": run_id, "cancelling": True}


class Status(JSONResource):
    def handle_GET(self, request):
        return self.service.status()


#: HTTP status and error kind for a session termination that was not done.
_TERMINATE_FAILURES = {
    "unknown_session": (404, "not_found"),
    "unknown_adapter": (404, "not_found"),
    "not_supported": (400, "invalid"),
}


class TerminateSession(JSONResource):
    def handle_POST(self, request):
        body = self.read_json(request)
        adapter = string(body, "adapter", required=True)
        session_id = string(body, "session_id", required=True)
        node, target = string(body, "node") or None, string(body, "target")
        d = self.service.terminate_session(node, adapter, target, session_id)
        return d.addCallback(self._answer, session_id)

    def _answer(self, result, session_id):
        """
        C{terminated: true} (200) only when the adapter ended a session it
        knew; otherwise C{terminated: false} with the reason, under the
        status that says whose mistake it was (404 for an unknown session).
        """
        ok, reason, code = result
        answer = {"session_id": session_id, "terminated": ok, "reason": reason}
        if ok:
            return answer
        status, kind = _TERMINATE_FAILURES.get(code, (502, "failed"))
        answer.update(error_body(kind, reason, code))
        return status, answer


class NodeCommands(JSONResource):
    """
    Run a node command (admin). With C{"stream": true} the answer is
    C{text/event-stream}: one event per progress update the Node reports
    (a model pull's C{status}, C{completed}, C{total}), then one terminal,
    C{{"done": true, "result": ...}} or C{{"error": ...}}. A caller who
    goes away cancels the command on the Node.
    """

    admin = True

    def handle_POST(self, request):
        node_id = request.path_params["node"]
        body = self.read_json(request)
        command = string(body, "command", required=True)
        adapter = string(body, "adapter")
        args = mapping(body, "args")
        if body.get("stream"):
            return self._stream(request, node_id, command, adapter, args)
        d = self.service.command(node_id, command, adapter, args)
        request.notifyFinish().addErrback(lambda _: d.cancel())
        return d.addCallback(lambda result: {"node": node_id, "command": command, "result": result})

    def _stream(self, request, node_id, command, adapter, args):
        stream = EventStream(request)
        d = self.service.command(node_id, command, adapter, args, progress=stream.send)
        request.notifyFinish().addErrback(lambda _: d.cancel())

        def done(result):
            if not (request.finished or request._disconnected):
                stream.send({"done": True, "node": node_id, "command": command, "result": result})
                request.finish()

        def failed(failure):
            if request.finished or request._disconnected:
                return None
            if not stream.open:
                return failure  # nothing sent yet: a plain error response
            error = failure.value if failure.check(ServiceError) else ServiceError("failed", "internal error")
            stream.send(error_body(error.kind, error.message, error.code))
            request.finish()
            return None

        return d.addCallbacks(done, failed).addCallback(lambda _: NOT_DONE_YET)
