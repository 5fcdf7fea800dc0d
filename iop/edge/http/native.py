"""
The native surface: runs as event streams, run history, cancel, sessions,
node commands, the events feed and the status snapshot.

  POST /v1/runs                     submit a run; text/event-stream of events
                                    (202 with the run at once for a
                                    background run with "stream": false)
  GET  /v1/runs                     recent runs (?node=&status=&limit=, and
                                    ?key= for an admin key)
  GET  /v1/runs/{run_id}            one run: status, usage, error, output
  GET  /v1/runs/{run_id}/events     its events from the start (or after
                                    Last-Event-ID / ?after=SEQ), then live
  POST /v1/runs/{run_id}/cancel     cancel a run in flight (or queued)
  POST /v1/sessions/terminate       end a logical session on a node
  POST /v1/nodes/{node}/commands    run a node command (admin)
  GET  /v1/events                   the Edge's event bus as SSE (admin)
  GET  /v1/status                   every configured node and model group
  GET  /v1/queue                    the caller's work waiting for room (admin:
                                    everyone's, with a count per key)

In an Edge cluster the runs, their events and cancels, node commands and
session terminations work at any Edge: a run this Edge does not hold is
looked for at the others (L{iop.edge.http.anywhere}), a node another Edge
owns is asked there.
"""

from collections.abc import Callable
from typing import Any

from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IDelayedCall, IPushProducer, IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.server import NOT_DONE_YET
from zope.interface import implementer

from iop.edge.dispatch import IRunListener, Unheard
from iop.edge.errors import ServiceError
from iop.edge.flow import STALL_TIMEOUT_SEC, ReceiveWindow, StallWatch
from iop.edge.http import anywhere
from iop.edge.http.api import EdgeAPI
from iop.edge.http.common import (
    Call,
    EventStream,
    JSONResource,
    answered_or_gone,
    caller_name,
    claim,
    cut_off,
    error_body,
    forwarded,
    hold_until_ended,
    identify,
    proxy,
    query,
    query_int,
    register_producer,
    release_producer,
    run_owner,
    write_json,
)
from iop.edge.http.notes import note_usage
from iop.edge.http.openai import RUN_ID_HEADER, parse_messages
from iop.edge.http.request import EdgeRequest
from iop.edge.http.validate import HTTPError, boolean, invalid, mapping, string
from iop.edge.runs import Follower, event_json
from iop.edge.seam import Forward
from iop.edge.spec import RunSpec
from iop.edge.status import seen_by
from iop.edge.tenants import Tenant
from iop.run import ERROR, TERMINAL_TYPES, RunEventData

log = Logger()

#: Statuses a run can have (C{GET /v1/runs?status=}).
RUN_STATUSES = ("queued", "running", "complete", "error", "cancelled")
#: The most runs one C{GET /v1/runs} answers with.
RUN_LIST_MAX = 1000


class _Listener:
    """
    What the native listeners share: the run's record (for the C{seq} of
    each event, which the run book numbered before the listener hears of
    it) and the C{x-iop-run-id} header, with the run's id as the
    answer's C{x-request-id} too (as on the OpenAI surface).
    """

    def __init__(self, call: Call, run_id: str) -> None:
        self.call = call
        self.run_id = run_id
        self.record = call.service.runs.get(run_id)
        if not call.gone:
            call.request.setHeader(RUN_ID_HEADER, run_id.encode("ascii"))
            identify(call.request, run_id)

    def payload(self, event: RunEventData) -> dict[str, Any]:
        return event_json(self.run_id, self.record.last_seq if self.record is not None else None, event)


@implementer(IRunListener)
class EventStreamListener(_Listener):
    """
    Native run events as SSE: one C{data:} JSON per event, each with its
    C{id: <seq>}, so a reader cut off can resume from C{/events}.
    """

    def __init__(self, call: Call, run_id: str) -> None:
        super().__init__(call, run_id)
        self.stream = EventStream(call.request)

    def use_producer(self, producer: ReceiveWindow) -> None:
        self.call.use_producer(producer)

    def event(self, event: RunEventData) -> None:
        if self.call.gone:
            return
        payload = self.payload(event)
        self.stream.send_event(payload, payload["seq"])
        if event.type in TERMINAL_TYPES:
            note_usage(self.call.request, event.usage)
            self.call.finish()


@implementer(IRunListener)
class CollectingListener(_Listener):
    """
    For C{"stream": false}: every event, answered as one JSON document
    naming the node, provider and model that served it (as a streamed
    run's record does), so a caller can tell where its answer came from.
    """

    def __init__(self, call: Call, run_id: str) -> None:
        super().__init__(call, run_id)
        self.events: list[dict[str, Any]] = []

    def event(self, event: RunEventData) -> None:
        self.events.append(self.payload(event))
        if event.type in TERMINAL_TYPES and not self.call.gone:
            note_usage(self.call.request, event.usage)
            text = "".join(e.get("text", "") for e in self.events if e["type"] == "delta")
            result: dict[str, Any] = {"run_id": self.run_id, "status": event.type, "text": text, "events": self.events}
            if self.record is not None:
                result.update(node=self.record.node, provider=self.record.provider, model=self.record.model)
            write_json(self.call.request, 200, result)


def _tell_queued(stream: EventStream, position: int, eta_ms: int) -> None:
    """
    A streamed native run that waits for room: a C{queued} event (no
    C{id:}, it is not one of the run's events) per update.
    """
    stream.send_event({"type": "queued", "position": position, "eta_ms": eta_ms})


def _end_queued(stream: EventStream, error: ServiceError) -> None:
    stream.send_event({"type": ERROR, "error": {"code": error.code, "message": error.message}})


def parse_run(body: dict[str, Any]) -> RunSpec:
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
    runs_work = True

    def handle_POST(self, request: EdgeRequest) -> object:
        body = self.read_json(request)
        spec = claim(parse_run(body), request)
        # A native run may be resumed: in a cluster its Node keeps it
        # should its Edge die (background runs are kept anyway).
        spec.outlives_edge = not spec.background and self.service.cluster.keeps_runs
        stream = boolean(body, "stream", True)
        if spec.background and not stream:
            return self._background(request, spec)
        call = Call(self.service, request, background=spec.background)
        listener_class = EventStreamListener if stream else CollectingListener
        on_queued = call.queued_stream(_tell_queued, _end_queued) if stream else None
        return call.submit(spec, lambda kind, run_id: listener_class(call, run_id), on_queued)

    def _background(self, request: EdgeRequest, spec: RunSpec) -> object:
        """
        A background run answered at once: 202 with the run (queued, or
        running when there was room), or the error that kept it from
        being queued at all (unknown model, nothing live, ...).
        """
        d = self.service.submit(spec, lambda kind, run_id: Unheard(), may_forward=not forwarded(request))
        hold_until_ended(request, self.service, spec.run_id)
        outcome: list[str | Failure] = []

        def seen(result: str | Failure) -> str | Failure:
            outcome.append(result)
            return result

        d.addBoth(seen)
        if outcome and isinstance(outcome[0], Failure):
            if outcome[0].check(Forward):
                # Another Edge of the cluster takes it (and answers the 202).
                d.addErrback(lambda failure: None)
                proxy(self.service, request, outcome[0])
                return NOT_DONE_YET
            return d
        # Later failures (a queue timeout) are on the run's record.
        d.addErrback(lambda failure: None)
        request.setHeader(b"location", f"/v1/runs/{spec.run_id}".encode("ascii"))
        request.setHeader(RUN_ID_HEADER, spec.run_id.encode("ascii"))
        identify(request, spec.run_id)
        record = self.service.runs.get(spec.run_id)
        assert record is not None  # (a background run is on record from its submission)
        return 202, record.as_json()

    def handle_GET(self, request: EdgeRequest) -> Deferred[dict[str, Any]]:
        """
        Recent runs of the caller's key (an admin key: of every key, or of
        the one C{?key=} names): C{?node=}, C{?status=}, C{?limit=} (50).
        """
        status = query(request, "status") or None
        if status is not None and status not in RUN_STATUSES:
            raise HTTPError("invalid", f"status must be one of {', '.join(RUN_STATUSES)}", code="invalid_status")
        limit = query_int(request, "limit", 50, 1, RUN_LIST_MAX)
        owner = run_owner(request)
        if owner is None:
            owner = query(request, "key") or None
        local = self.service.list_runs(query(request, "node") or None, status, limit, owner)
        return anywhere.list_runs(self.service, request, local, limit)


class Run(JSONResource):
    """
    One run of the caller's key (any run, for an admin key); another
    key's is a 404, as if it did not exist.
    """

    def handle_GET(self, request: EdgeRequest) -> Deferred[object]:
        return anywhere.get_run(self.service, request, request.path_params["run_id"], run_owner(request))


#: The largest seq a reader may resume after: what the wire and the
#: Node's store (SQLite integers) carry.
MAX_SEQ = 2**63 - 1


def resume_point(request: EdgeRequest) -> int:
    """
    Where a reader resumes: C{Last-Event-ID} (what C{EventSource} sends
    after a cut), else C{?after=SEQ}, else the start. Either is bounded as
    a seq is: past L{MAX_SEQ} it could not be asked of a Node's store.
    """
    header = request.getHeader(b"last-event-id")
    if header is not None and header.strip():
        try:
            after = int(header.strip())
        except ValueError:
            raise HTTPError("invalid", "Last-Event-ID must be an event seq", code="invalid_last_event_id") from None
        if not 0 <= after <= MAX_SEQ:
            raise HTTPError("invalid", "Last-Event-ID must be an event seq", code="invalid_last_event_id")
        return after
    return query_int(request, "after", 0, 0, MAX_SEQ)


class RunEvents(JSONResource):
    """
    A run's events as SSE, each with its C{id: <seq>}: those after the
    resume point first (from the Edge's memory, or the Node's store once
    the Edge has forgotten them), then live ones until the terminal, after
    which the stream ends. No event is sent twice or skipped.
    """

    def handle_GET(self, request: EdgeRequest) -> Deferred[object]:
        run_id = request.path_params["run_id"]
        after = resume_point(request)
        stream = EventStream(request)
        state: dict[str, Any] = {"gone": False, "follower": None, "reader": None}

        def write(seq: int, payload: dict[str, Any]) -> None:
            if state["gone"]:
                return
            if state["reader"] is None:
                # (Only once this Edge answers: not when the read is
                # proxied to the Edge that holds the run.)
                state["reader"] = SlowReader(request)
            if state["reader"].keeps_up(len(payload.get("text", ""))):
                stream.send_event(payload, seq)

        def end() -> None:
            if not (state["gone"] or request.finished):
                stream.start()
                if state["reader"] is not None:
                    request.unregisterProducer()
                request.finish()

        def attached(follower: Follower) -> object:
            state["follower"] = follower
            if state["gone"]:
                self.service.runs.unfollow(run_id, follower)
            elif not request.finished:
                stream.comment(f"following {run_id}")
            return NOT_DONE_YET

        def gone(_: object) -> None:
            state["gone"] = True
            if state["follower"] is not None:
                self.service.runs.unfollow(run_id, state["follower"])

        request.notifyFinish().addErrback(gone)
        d = self.service.follow(run_id, after, write, end, run_owner(request), may_forward=not forwarded(request))
        return d.addCallbacks(
            attached, lambda failure: anywhere.proxy_to_holder(self.service, request, run_id, failure)
        )


#: What a reader of a run's events that does not read may have waiting in
#: the Edge (written while its connection was paused) before it is cut
#: off: it resumes where it stopped with C{Last-Event-ID}.
FOLLOW_BUFFER_MAX = 4 * 1024 * 1024


@implementer(IPushProducer)
class SlowReader:
    """
    The flow of one reader of a run's events: the Edge writes the run's
    events as they come (the run goes at its first caller's pace, not at
    this reader's), so a reader that stops reading would make the Edge
    hold all of them. While its connection is paused, what is written is
    counted; past L{FOLLOW_BUFFER_MAX} its connection is closed.
    """

    def __init__(self, request: EdgeRequest) -> None:
        self.request = request
        self.paused = False
        self.held = 0
        request.registerProducer(self, True)

    def keeps_up(self, size: int) -> bool:
        """
        Whether an event of C{size} characters may be written now (else the
        reader is cut off).
        """
        if not self.paused:
            return True
        self.held += size + 64
        if self.held <= FOLLOW_BUFFER_MAX:
            return True
        if self.request.channel is not None:
            cut_off(self.request.channel.transport)
        return False

    def pauseProducing(self) -> None:
        self.paused = True

    def resumeProducing(self) -> None:
        self.paused = False
        self.held = 0

    def stopProducing(self) -> None:
        self.paused = True


#: How often an idle events feed sends a comment, so that proxies keep it.
KEEPALIVE_SEC = 15.0


@implementer(IPushProducer)
class EventFeed:
    """
    One reader of C{GET /v1/events}: the bus's events that pass its
    filter, as SSE (C{event: <topic>}, C{data: <payload>}).

    A reader that does not keep up never holds the Edge up or makes it
    buffer without bound: while its connection is paused (its socket is
    full), events are dropped and counted, and the next one it gets is
    preceded by an C{event: dropped} with the count.

    @param types: topics or event types to pass (empty: all).
    @param node: only events naming this node (C{None}: all).
    """

    def __init__(
        self, service: EdgeAPI, request: EdgeRequest, types: frozenset[str], node: str | None, deltas: bool
    ) -> None:
        self.request = request
        self.stream = EventStream(request)
        self.types = types
        self.node = node
        self.paused = False
        self.dropped = 0
        self.clock = service.clock
        self.subscription = service.bus.subscribe(self.offer, opt_in=("run_delta",) if deltas else ())
        self._keepalive: IDelayedCall | None = None
        request.registerProducer(self, True)
        request.notifyFinish().addBoth(lambda _: self.stopProducing())
        self.stream.comment("iop events")
        self._schedule()

    def passes(self, topic: str, payload: dict[str, Any]) -> bool:
        if self.node is not None and payload.get("node") != self.node:
            return False
        if not self.types:
            return True
        return bool(self.types & {topic, payload.get("type"), payload.get("event"), payload.get("status")})

    def offer(self, topic: str, payload: dict[str, Any]) -> None:
        if self.request.finished or not self.passes(topic, payload):
            return
        if self.paused:
            self.dropped += 1
            return
        if self.dropped:
            self.stream.send_event({"dropped": self.dropped}, name="dropped")
            self.dropped = 0
        self.stream.send_event(payload, name=topic)
        self._schedule()

    def _schedule(self) -> None:
        if self._keepalive is not None and self._keepalive.active():
            self._keepalive.cancel()
        self._keepalive = self.clock.callLater(KEEPALIVE_SEC, self._ping)

    def _ping(self) -> None:
        self._keepalive = None
        if not self.request.finished:
            self.stream.comment("keepalive")
            self._schedule()

    def pauseProducing(self) -> None:
        self.paused = True

    def resumeProducing(self) -> None:
        self.paused = False

    def stopProducing(self) -> None:
        self.subscription.cancel()
        if self._keepalive is not None and self._keepalive.active():
            self._keepalive.cancel()
        self._keepalive = None


class Events(JSONResource):
    """
    C{GET /v1/events} (admin): the Edge's event bus as SSE, for operators:
    runs' starts and terminals, tunnels' starts, ends and errors, node
    lifecycle, provider events. C{?type=} (comma-separated) keeps events of
    those topics or types (C{run}, C{tunnel}, C{node}, C{complete},
    C{error}, C{disconnected}, ...), C{?node=} those of one node,
    C{?deltas=true} adds every run delta (topic C{run_delta}).
    """

    admin = True

    def handle_GET(self, request: EdgeRequest) -> int:
        types = frozenset(t for t in (query(request, "type") or "").split(",") if t)
        deltas = (query(request, "deltas") or "").lower() in ("1", "true", "yes") or "run_delta" in types
        EventFeed(self.service, request, types, query(request, "node") or None, deltas)
        return NOT_DONE_YET


class CancelRun(JSONResource):
    """
    Cancel a run of the caller's key (any run, for an admin key); another
    key's is a 404, as if it were not in flight. One that ended already
    (as this Edge remembers it, or as its Node's store has it) is a 409
    C{run_finished} saying how it ended: nothing was cancelled.
    """

    def handle_POST(self, request: EdgeRequest) -> object:
        run_id = request.path_params["run_id"]
        owner = run_owner(request)
        if self.service.cancel(run_id, owner):
            return {"run_id": run_id, "cancelling": True}
        missing = Failure(HTTPError("not_found", f"no run {run_id} is in flight", code="run_not_found"))

        def read(run: dict[str, Any]) -> object:
            if run.get("status") in TERMINAL_TYPES:
                raise HTTPError("conflict", f"run {run_id} already ended ({run['status']})", code="run_finished")
            # (Another Edge of the cluster may hold it.)
            return anywhere.proxy_to_holder(self.service, request, run_id, missing)

        def unread(failure: Failure) -> dict[str, Any]:
            failure.trap(ServiceError)
            return {}  # (no status: asked of the other Edges, or not found)

        # Ended, as this Edge remembers it or its Node's store has it?
        return self.service.get_run(run_id, owner, may_forward=False).addErrback(unread).addCallback(read)


class Status(JSONResource):
    """
    C{GET /v1/status}: every node, provider and model group. A caller key
    that is not an admin's sees a provider's C{last_error} as its code
    only (L{seen_by}).
    """

    def handle_GET(self, request: EdgeRequest) -> dict[str, Any]:
        return seen_by(self.service.status(), request.sees_all)


#: HTTP status and error kind for a session termination that was not done.
_TERMINATE_FAILURES = {
    "unknown_session": (404, "not_found"),
    "unknown_adapter": (404, "not_found"),
    "not_supported": (400, "invalid"),
}


class TerminateSession(JSONResource):
    """
    End a logical session of the caller's key (any session, for an admin
    key). Whose a session is, the Node decides (the key whose run first
    used it): another key's is a 404 like a session that does not exist.
    """

    def handle_POST(self, request: EdgeRequest) -> Deferred[object]:
        body = self.read_json(request)
        adapter = string(body, "adapter", required=True)
        session_id = string(body, "session_id", required=True)
        node, target = string(body, "node") or None, string(body, "target")
        if node is not None and anywhere.proxied_to_owner(self.service, request, node):
            return succeed(NOT_DONE_YET)
        d = self.service.terminate_session(node, adapter, target, session_id, self._caller(request))
        return d.addCallback(self._answer, session_id)

    def _caller(self, request: EdgeRequest) -> str:
        """
        Whose sessions C{request} may end, as the Node is told: its caller
        key's name, the owner its runs carry (C{anonymous} for an open API:
        every caller is one owner there), or empty for an admin key (any).
        """
        return "" if self.keys.is_admin(getattr(request, "caller_key", None)) else caller_name(request)

    def _answer(self, result: tuple[bool, str, str], session_id: str) -> object:
        """
        C{terminated: true} (200) only when the adapter ended a session it
        knew; otherwise C{terminated: false} with the reason, under the
        status that says whose mistake it was (404 for an unknown session).
        """
        ok, reason, code = result
        answer: dict[str, Any] = {"session_id": session_id, "terminated": ok, "reason": reason}
        if ok:
            return answer
        status, kind = _TERMINATE_FAILURES.get(code, (502, "failed"))
        answer.update(error_body(kind, reason, code))
        return status, answer


class Queue(JSONResource):
    """
    C{GET /v1/queue}: the caller key's work waiting for room, in the order
    it will be served (model group, priority, position, time waited and
    expected, run id when known), and what is left of its token budgets.
    An admin key sees every key's work and how much each has waiting.
    """

    def handle_GET(self, request: EdgeRequest) -> dict[str, Any]:
        key = getattr(request, "caller_key", None)
        if self.keys.is_admin(key):
            waiting = self.service.queue()
            by_key: dict[str, int] = {}
            for entry in waiting:
                by_key[entry["key"]] = by_key.get(entry["key"], 0) + 1
            return {"queued": waiting, "by_key": by_key}
        tenant = key.tenant() if key is not None else Tenant()
        answer: dict[str, Any] = {"key": tenant.name, "queued": self.service.queue(tenant.name)}
        budgets = self.service.budgets.remaining(tenant)
        if budgets:
            answer["tokens_left"] = budgets
        return answer


@implementer(IPushProducer)
class CommandProgress:
    """
    The flow of a streamed node command's progress to its caller. The Node
    reports progress at its own pace (a model pull may run for an hour),
    so a caller that stops reading would make the Edge hold every update
    for it. While its connection does not drain (twisted.web paused this
    producer), an update is not written but kept in place of the one
    before (each says where the command stands, superseding the last),
    and the latest is written once the connection drains: the Edge holds
    at most one update beyond what the connection buffers. A connection
    that stays undrained for C{stall_timeout} seconds is cut off and the
    command cancelled on the Node, as for a caller who hung up.

    @param cancel: cancels the command (its Deferred's C{cancel}).
    """

    def __init__(
        self,
        request: EdgeRequest,
        stream: EventStream,
        clock: IReactorTime,
        cancel: Callable[[], object],
        stall_timeout: float = STALL_TIMEOUT_SEC,
    ) -> None:
        self.request = request
        self.stream = stream
        self.cancel = cancel
        self.paused = False
        #: Whether the command is over for this caller: answered, or cut off.
        self.ended = False
        self.cut = False
        self._latest: tuple[object] | None = None
        self._stall = StallWatch(clock, stall_timeout, self._stalled)
        register_producer(request, self)

    def update(self, progress: object) -> None:
        """
        One progress update from the Node: written now, or, while the
        caller's connection does not drain, kept as the latest.
        """
        if self.ended or answered_or_gone(self.request):
            return
        if self.paused:
            self._latest = (progress,)
            return
        self.stream.send(progress)

    def end(self) -> None:
        """
        The command answered (its terminal is written next, superseding
        any update still kept): the response needs no producer any more.
        """
        self.ended = True
        self._latest = None
        self._stall.stop()
        release_producer(self.request)

    def _stalled(self) -> None:
        if self.ended or answered_or_gone(self.request):
            return
        log.info("caller of a streamed node command took nothing for too long; closing its connection")
        self.ended = self.cut = True
        self._latest = None
        cut_off(self.request.channel.transport)
        self.cancel()

    # -- IPushProducer: the caller's connection

    def pauseProducing(self) -> None:
        self.paused = True
        if not self.ended:
            self._stall.start()

    def resumeProducing(self) -> None:
        self.paused = False
        self._stall.stop()
        latest, self._latest = self._latest, None
        if latest is not None:
            self.update(latest[0])

    def stopProducing(self) -> None:
        self.ended = True
        self._latest = None
        self._stall.stop()


class NodeCommands(JSONResource):
    """
    Run a node command (admin). With C{"stream": true} the answer is
    C{text/event-stream}: one event per progress update the Node reports
    (a model pull's C{status}, C{completed}, C{total}), then one terminal,
    C{{"done": true, "result": ...}} or C{{"error": ...}}. A caller who
    goes away cancels the command on the Node, and so does one that stops
    reading a stream for its stall timeout (L{CommandProgress}).
    """

    admin = True
    runs_work = True

    def handle_POST(self, request: EdgeRequest) -> Deferred[object]:
        node_id = request.path_params["node"]
        body = self.read_json(request)
        command = string(body, "command", required=True)
        adapter = string(body, "adapter")
        args = mapping(body, "args")
        if anywhere.proxied_to_owner(self.service, request, node_id):
            return succeed(NOT_DONE_YET)
        if boolean(body, "stream"):
            return self._stream(request, node_id, command, adapter, args)
        d = self.service.command(node_id, command, adapter, args)
        request.notifyFinish().addErrback(lambda _: d.cancel())
        return d.addCallback(lambda result: {"node": node_id, "command": command, "result": result})

    def _stream(
        self, request: EdgeRequest, node_id: str, command: str, adapter: str, args: dict[str, Any]
    ) -> Deferred[object]:
        stream = EventStream(request)
        commanded: list[Deferred[Any]] = []
        flow = CommandProgress(request, stream, self.service.clock, lambda: commanded[0].cancel())
        d = self.service.command(node_id, command, adapter, args, progress=flow.update)
        commanded.append(d)
        request.notifyFinish().addErrback(lambda _: d.cancel())

        def done(result: object) -> None:
            flow.end()
            if not (flow.cut or answered_or_gone(request)):
                stream.send({"done": True, "node": node_id, "command": command, "result": result})
                request.finish()

        def failed(failure: Failure) -> Failure | None:
            flow.end()
            if flow.cut or answered_or_gone(request):
                return None
            if not stream.open:
                return failure  # nothing sent yet: a plain error response
            error = (
                failure.value if isinstance(failure.value, ServiceError) else ServiceError("failed", "internal error")
            )
            stream.send(error_body(error.kind, error.message, error.code))
            request.finish()
            return None

        return d.addCallbacks(done, failed).addCallback(lambda _: NOT_DONE_YET)
