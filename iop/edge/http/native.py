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
from iop.edge.http.common import Call, EventStream, HTTPError, JSONResource, error_body, read_json, write_json
from iop.edge.http.openai import parse_messages
from iop.edge.spec import RunSpec
from iop.protocols.convert import usage_to_json
from iop.run import TERMINAL_TYPES


def run_event_json(run_id, event):
    """
    One native event: C{run_id}, C{type}, C{text} for deltas, C{usage} and
    C{error} on terminals (usage breakdown only when reported).
    """
    payload = {"run_id": run_id, "type": event.type}
    if event.text:
        payload["text"] = event.text
    if event.usage is not None:
        payload["usage"] = usage_to_json(event.usage)
    if event.error is not None:
        payload["error"] = {"code": event.error.code, "message": event.error.message}
        if event.error.status:
            payload["error"]["status"] = event.error.status
    return payload


def _string(body, key, default=""):
    value = body.get(key, default)
    if value is None:
        return default
    if not isinstance(value, str):
        raise HTTPError("invalid", f"{key} must be a string", code="invalid_" + key)
    return value


@implementer(IRunListener)
class EventStreamListener:
    """
    Native run events as SSE, one C{data:} JSON per event.
    """

    def __init__(self, call, run_id):
        self.call = call
        self.run_id = run_id
        self.stream = EventStream(call.request)

    def event(self, event):
        if self.call.gone:
            return
        self.stream.send(run_event_json(self.run_id, event))
        if event.type in TERMINAL_TYPES:
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
            text = "".join(e.get("text", "") for e in self.events if e["type"] == "delta")
            result = {"run_id": self.run_id, "status": event.type, "text": text, "events": self.events}
            write_json(self.call.request, 200, result)


def parse_run(body):
    """
    The native run request: C{adapter} (or C{model}), C{target}, C{input}
    as text or chat messages, C{node}, C{session_id}, C{background}.
    """
    value = body.get("input")
    if isinstance(value, str):
        messages = [{"role": "user", "content": value}]
    elif isinstance(value, list):
        messages = parse_messages(value)
    else:
        raise HTTPError("invalid", "input must be text or a list of messages", code="invalid_input")
    adapter, model = _string(body, "adapter"), _string(body, "model") or None
    if not adapter and not model:
        raise HTTPError("invalid", "adapter (or model) is required", code="missing_adapter")
    options = body.get("options") or {}
    if not isinstance(options, dict):
        raise HTTPError("invalid", "options must be an object", code="invalid_options")
    return RunSpec(
        messages=messages,
        adapter=adapter,
        model=model,
        target=_string(body, "target"),
        node=_string(body, "node") or None,
        session_id=_string(body, "session_id"),
        background=bool(body.get("background", False)),
        options=options,
    )


class Runs(JSONResource):
    def handle_POST(self, request):
        body = read_json(request)
        spec = parse_run(body)
        call = Call(self.service, request)
        listener_class = EventStreamListener if body.get("stream", True) else CollectingListener
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
        body = read_json(request)
        session_id = _string(body, "session_id")
        adapter = _string(body, "adapter")
        if not session_id or not adapter:
            raise HTTPError("invalid", "adapter and session_id are required", code="missing_session")
        d = self.service.terminate_session(_string(body, "node") or None, adapter, _string(body, "target"), session_id)
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
        body = read_json(request)
        command = _string(body, "command")
        if not command:
            raise HTTPError("invalid", "command is required", code="missing_command")
        args = body.get("args") or {}
        if not isinstance(args, dict):
            raise HTTPError("invalid", "args must be an object", code="invalid_args")
        adapter = _string(body, "adapter")
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
