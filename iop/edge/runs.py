"""
The Edge's record of runs and tunnels: what each one is, how it is going,
and — for runs — a bounded log of its events, so that a caller can read a
run back (C{GET /v1/runs/{id}}) or replay and follow its events from any
point (C{GET /v1/runs/{id}/events} with C{Last-Event-ID}).

The L{RunBook} is the one owner of these records; the dispatches of the
in-flight table report to it, and it publishes each piece of work on the
event bus: a run's start and terminal on C{run}, its deltas on
C{run_delta} only when a subscriber asked for them, a tunnel's start, end
and error on C{tunnel}.

Memory is bounded. A run's log keeps at most C{max_bytes} of events (the
oldest go first); a finished run stays for C{max_age_sec}, and at most
C{max_runs} finished runs are kept. Past that, the run's Node is the
record: its store holds every event (docs/node.md, "Run store"), and the
book asks for what it lacks through a C{fetch(run_id, node, after)}
callable (the C{run_get} node command).

Every run and tunnel belongs to the caller key that started it (its
C{caller}, the key's name): a reader limited to one key (an C{owner})
sees only that key's work, and anything else is answered as if it did
not exist (docs/edge.md, "Isolation").

Events are numbered by the C{seq} the Node gave them on the wire, so the
Edge's log, the Node's store and a resumed stream agree; an event the Edge
makes up itself (a cancel the Node never confirmed, a lost Node) takes the
next number.
"""

from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any

from twisted.internet import defer
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from iop.edge.bus import EventBus
from iop.edge.errors import ServiceError
from iop.protocols.convert import event_details_json
from iop.run import (
    CANCELLED,
    COMPLETE,
    DELTA,
    ERROR,
    REASONING_DELTA,
    START,
    TERMINAL_TYPES,
    RunEventData,
    RunFailure,
)

RUN = "run"
TUNNEL = "tunnel"

QUEUED = "queued"
RUNNING = "running"

#: Default limits (C{run_log} in edge.yaml).
DEFAULT_MAX_BYTES = 1024 * 1024
DEFAULT_MAX_AGE_SEC = 600.0
DEFAULT_MAX_RUNS = 1000
#: How many finished ids the book remembers the node of, once their
#: records are gone, so it knows which Node to ask.
WHERE_SIZE = 100_000

#: What one logged event costs beyond its text, for the byte bound.
_EVENT_OVERHEAD = 64

#: Bus topics.
RUN_TOPIC = "run"
DELTA_TOPIC = "run_delta"
TUNNEL_TOPIC = "tunnel"

#: A run's event as the Edge logs, replays and publishes it (L{event_json}).
Payload = dict[str, Any]

#: C{fetch(run_id, node_id, after)}: a Deferred of C{(node_id, answer)}
#: from a Node's store (see L{RunBook}).
Fetch = Callable[[str, str | None, int], "defer.Deferred[tuple[str, dict[str, Any]]]"]


def visible(owner: str | None, caller: str | None) -> bool:
    """
    Whether work that belongs to the caller key named C{caller} may be
    seen by a reader limited to C{owner} (C{None}: a reader who sees all).
    """
    return owner is None or caller == owner


def no_such_run(run_id: str) -> ServiceError:
    """
    What a reader is told of a run that does not exist, or is another
    key's: the same answer, so that it learns nothing of the other.
    """
    return ServiceError("not_found", f"no run {run_id}", code="run_not_found")


def event_json(run_id: str, seq: int | None, event: RunEventData) -> Payload:
    """
    One native run event: C{run_id}, C{seq}, C{type}, C{text} for deltas,
    C{tool_call} (C{id}, C{name}, C{arguments}) for a tool call, C{usage},
    C{finish_reason} and C{error} on terminals (usage breakdown only when
    reported). C{seq} is C{None} for an event of a run the book no longer
    holds.
    """
    payload: Payload = {"run_id": run_id, "seq": seq, "type": event.type}
    if event.text:
        payload["text"] = event.text
    payload.update(event_details_json(event))
    return payload


class RunRecord:
    """
    One run or tunnel, as the Edge knows it.

    @ivar log: C{(seq, payload)} of the run's events still in memory, oldest
        first; C{first_seq} is the seq of the oldest event ever logged that
        is still there (1 when nothing was dropped).
    @ivar followers: the L{Follower}s waiting for more events.
    @ivar on_end: callables to call once when the work ends (see
        L{RunBook.when_ended}).
    """

    def __init__(self, run_id: str, kind: str, created_at: float, **fields: Any) -> None:
        self.id = run_id
        self.kind = kind
        self.status: str = fields.pop("status", RUNNING)
        self.node: str | None = fields.pop("node", None)
        self.adapter: str = fields.pop("adapter", "")
        self.target: str = fields.pop("target", "")
        self.model: str | None = fields.pop("model", None)
        self.provider: str | None = fields.pop("provider", None)
        self.background: bool = fields.pop("background", False)
        self.caller: str | None = fields.pop("caller", None)
        self.wire_id: str = fields.pop("wire_id", None) or run_id
        if fields:
            raise TypeError(f"unknown run fields: {', '.join(fields)}")
        self.created_at = created_at
        self.ended_at: float | None = None
        self.usage: dict[str, Any] | None = None
        self.error: dict[str, str] | None = None
        self.log: deque[tuple[int, Payload]] = deque()
        self.log_bytes = 0
        self.dropped = 0
        self.last_seq = 0
        self.followers: list[Follower] = []
        self.on_end: list[Callable[[], None]] = []

    @property
    def done(self) -> bool:
        return self.status in TERMINAL_TYPES

    @property
    def first_seq(self) -> int:
        """
        The lowest seq the log can replay (C{last_seq + 1} when empty).
        """
        return self.log[0][0] if self.log else self.last_seq + 1

    @property
    def complete_log(self) -> bool:
        """
        Whether the log still holds every event since the start.
        """
        return self.dropped == 0

    def output(self) -> str:
        return "".join(payload.get("text", "") for _, payload in self.log if payload["type"] == DELTA)

    def as_json(self, output: bool = True) -> dict[str, Any]:
        """
        The C{GET /v1/runs/{id}} object (without C{output} for lists).
        """
        answer: dict[str, Any] = {
            "id": self.id,
            "object": "run",
            "kind": self.kind,
            "status": self.status,
            "node": self.node,
            "adapter": self.adapter,
            "target": self.target,
            "model": self.model,
            "background": self.background,
            "created_at": self.created_at,
            "ended_at": self.ended_at,
            "usage": self.usage,
            "error": self.error,
            "key": self.caller,
        }
        if output and self.kind == RUN:
            answer["output"] = self.output()
        return answer

    def labels(self) -> dict[str, Any]:
        """
        What the bus says about this work besides the event itself.
        """
        return {
            "run_id": self.id,
            "node": self.node,
            "adapter": self.adapter,
            "target": self.target,
            "model_group": self.model or "",
            "provider": self.provider or "",
            "key": self.caller or "anonymous",
            "background": self.background,
        }


def stored_json(node_id: str, row: dict[str, Any], run_id: str | None = None) -> dict[str, Any]:
    """
    A Node store row (C{run_get}, C{run_list}) as a C{GET /v1/runs} object
    (under C{run_id} when the caller knows the run by another id than its
    attempt's on the wire).
    """
    error = None
    if row.get("error") or row.get("error_code"):
        error = {"code": row.get("error_code") or "", "message": row.get("error") or ""}
    answer: dict[str, Any] = {
        "id": run_id or row["run_id"],
        "object": "run",
        "kind": row.get("kind", RUN),
        "status": row["status"],
        "node": node_id,
        "adapter": row.get("adapter", ""),
        "target": row.get("target", ""),
        "model": None,
        "background": bool(row.get("background")),
        "created_at": row.get("started_at"),
        "ended_at": row.get("ended_at"),
        "usage": row.get("usage"),
        "error": error,
        "key": row.get("caller"),
    }
    if "output" in row and answer["kind"] == RUN:
        answer["output"] = row["output"]
    return answer


class Follower:
    """
    One reader of a run's events (an SSE response), given each event once,
    in seq order, after C{after}.

    While it catches up from the Node's store (its log in memory no longer
    goes back far enough) live events are held, and released behind the
    history: nothing is written twice, nothing out of order.

    @param write: C{write(seq, payload)} for each event.
    @param end: called once after the terminal was written (or when the
        run turns out to be over with nothing more to write).
    """

    def __init__(self, write: Callable[[int, Payload], object], end: Callable[[], object], after: int = 0) -> None:
        self.write = write
        self.end = end
        self.after = after
        self.catching_up = False
        self.closed = False
        self._held: dict[int, Payload] = {}

    def offer(self, seq: int, payload: Payload) -> None:
        if self.closed:
            return
        if seq <= self.after:
            # A resume point past the terminal (a bogus Last-Event-ID):
            # the run is over all the same.
            if payload.get("type") in TERMINAL_TYPES and not self.catching_up:
                self.close()
            return
        if self.catching_up:
            self._held[seq] = payload
            return
        self._deliver(seq, payload)

    def caught_up(self, events: list[tuple[int, Payload]]) -> None:
        """
        The history arrived (C{[(seq, payload)]}): write it, then what was
        held meanwhile.
        """
        self.catching_up = False
        for seq, payload in sorted(events, key=lambda pair: pair[0]) + sorted(self._held.items()):
            self.offer(seq, payload)
        self._held = {}

    def _deliver(self, seq: int, payload: Payload) -> None:
        self.after = seq
        self.write(seq, payload)
        if payload.get("type") in TERMINAL_TYPES:
            self.close()

    def close(self) -> None:
        """
        No more events (the terminal was written, or the reader left).
        """
        if not self.closed:
            self.closed = True
            self._held = {}
            self.end()


class RunBook:
    """
    @param clock: an C{IReactorTime} (C{seconds()} stamps the records).
    @param bus: the L{iop.edge.bus.EventBus}.
    @param fetch: C{fetch(run_id, node_id, after)} returns a Deferred of
        C{(node_id, {"run": row, "events": [...]})} from a Node's store,
        asking every ready node when C{node_id} is C{None}; it fails with
        a L{ServiceError}.
    """

    log = Logger()

    def __init__(
        self,
        clock: IReactorTime,
        bus: EventBus,
        fetch: Fetch | None = None,
        max_bytes: int = DEFAULT_MAX_BYTES,
        max_age_sec: float = DEFAULT_MAX_AGE_SEC,
        max_runs: int = DEFAULT_MAX_RUNS,
    ) -> None:
        self.clock = clock
        self.bus = bus
        self.fetch = fetch
        self.max_bytes = max_bytes
        self.max_age_sec = max_age_sec
        self.max_runs = max_runs
        self._live: dict[str, RunRecord] = {}
        self._finished: OrderedDict[str, RunRecord] = OrderedDict()
        #: run id -> (node id, wire id) of finished runs.
        self._where: OrderedDict[str, tuple[str, str]] = OrderedDict()
        #: wire id -> run id of the records in memory whose latest
        #: attempt has an id of its own on the wire (C{<id>-<n>}).
        self._by_wire: dict[str, str] = {}

    # -- records

    def open(self, run_id: str, kind: str, **fields: Any) -> RunRecord:
        """
        The record of C{run_id}, made now if new; C{fields} update it.
        """
        record = self.get(run_id)
        if record is None:
            record = RunRecord(run_id, kind, self.clock.seconds(), **fields)
            self._live[run_id] = record
        else:
            self._unindex(record)
            for name, value in fields.items():
                setattr(record, name, value)
        if record.wire_id != run_id:
            self._by_wire[record.wire_id] = run_id
        return record

    def _unindex(self, record: RunRecord) -> None:
        """
        C{record}'s wire id no longer leads to it (it changes, or the
        record is forgotten).
        """
        if self._by_wire.get(record.wire_id) == record.id:
            del self._by_wire[record.wire_id]

    def get(self, run_id: str) -> RunRecord | None:
        self._evict()
        return self._live.get(run_id) or self._finished.get(run_id)

    def for_wire(self, wire_id: str) -> RunRecord | None:
        """
        The record of the work with C{wire_id} on the wire: a Node names
        an attempt by that id, which after a failover is not the id its
        caller knows (C{<id>-<n>}).
        """
        return self.get(self._by_wire.get(wire_id, wire_id))

    def records(self) -> list[RunRecord]:
        """
        Every record in memory, newest first.
        """
        self._evict()
        every = list(self._live.values()) + list(self._finished.values())
        return sorted(every, key=lambda r: r.created_at, reverse=True)

    def when_ended(self, record: RunRecord, callback: Callable[[], None]) -> None:
        """
        Call C{callback()} once when C{record}'s work ends, however it ends
        (a terminal, a failure or cancel before it started); at once if it
        has ended already.
        """
        if record.done:
            callback()
        else:
            record.on_end.append(callback)

    def locate(self, run_id: str) -> tuple[str | None, str]:
        """
        Where to ask about a run the book may no longer hold: C{(node_id,
        wire_id)} — the node it ran on (C{None} when forgotten) and the id
        its last attempt had there.
        """
        record = self.get(run_id)
        if record is not None:
            return record.node, record.wire_id
        return self._where.get(run_id, (None, run_id))

    # -- runs

    def started(self, record: RunRecord) -> None:
        """
        Placed work starts (the dispatch is on its way to the Node).
        """
        record.status = RUNNING
        if record.kind == TUNNEL:
            self._publish(TUNNEL_TOPIC, record, {"type": START})

    def event(self, record: RunRecord, event: RunEventData, seq: int | None = None) -> None:
        """
        One event of a run: logged, given to followers, published.

        @param seq: its wire seq, or C{None} for an event the Edge made up
            (it takes the next number). An event at or below the last seq
            is a repeat and is dropped.
        """
        if record.done:
            return
        if seq is None:
            seq = record.last_seq + 1
        elif seq <= record.last_seq:
            return
        record.last_seq = seq
        payload = event_json(record.id, seq, event)
        self._keep(record, seq, payload)
        if event.type in TERMINAL_TYPES:
            self._ended(record, event.type, payload.get("usage"), payload.get("error"))
        for follower in list(record.followers):
            follower.offer(seq, payload)
        if event.type in TERMINAL_TYPES:
            record.followers = [f for f in record.followers if not f.closed]
        if event.type in (DELTA, REASONING_DELTA):
            if self.bus.wants(DELTA_TOPIC):
                self.bus.publish(DELTA_TOPIC, dict(record.labels(), seq=seq, type=event.type, text=event.text))
        else:
            self._publish(RUN_TOPIC, record, {k: v for k, v in payload.items() if k != "run_id"})
        if event.type in TERMINAL_TYPES:
            self._retire(record)

    def _keep(self, record: RunRecord, seq: int, payload: Payload) -> None:
        size = len(payload.get("text", "")) + _EVENT_OVERHEAD
        record.log.append((seq, payload))
        record.log_bytes += size
        while record.log_bytes > self.max_bytes and len(record.log) > 1:
            _, dropped = record.log.popleft()
            record.log_bytes -= len(dropped.get("text", "")) + _EVENT_OVERHEAD
            record.dropped += 1

    def not_started(self, record: RunRecord, code: str, message: str, status: str = ERROR) -> None:
        """
        Work that ends on the Edge without a terminal from a Node (a
        background run that failed or was cancelled in the queue, a
        request that could not be sent): a run logs a made-up terminal its
        followers get; a tunnel ends.
        """
        if record.done:
            return
        if record.kind == TUNNEL:
            self.tunnel_ended(record, status, None, {"code": code, "message": message})
        else:
            self.event(record, RunEventData(status, error=RunFailure(code=code, message=message)))

    # -- tunnels

    def tunnel_ended(
        self,
        record: RunRecord,
        status: str,
        usage: dict[str, Any] | None = None,
        error: dict[str, Any] | None = None,
    ) -> None:
        """
        A tunnel's end (C{complete}) or error (C{error}, C{cancelled}).
        """
        if record.done:
            return
        self._ended(record, status, usage, error)
        payload: Payload = {"type": "end" if status == COMPLETE else ERROR, "status": status}
        if usage is not None:
            payload["usage"] = usage
        if error is not None:
            payload["error"] = error
        self._publish(TUNNEL_TOPIC, record, payload)
        self._retire(record)

    # -- bookkeeping

    def _ended(
        self, record: RunRecord, status: str, usage: dict[str, Any] | None, error: dict[str, Any] | None
    ) -> None:
        record.status = status
        record.ended_at = self.clock.seconds()
        if usage is not None:
            record.usage = usage
        if error is not None:
            record.error = {"code": error.get("code", ""), "message": error.get("message", "")}
        elif status == CANCELLED and record.error is None:
            record.error = {"code": CANCELLED, "message": "cancelled"}
        callbacks, record.on_end = record.on_end, []
        for callback in callbacks:
            callback()

    def _retire(self, record: RunRecord) -> None:
        if self._live.pop(record.id, None) is None:
            return
        self._finished[record.id] = record
        if record.node:
            self._where[record.id] = (record.node, record.wire_id)
            while len(self._where) > WHERE_SIZE:
                self._where.popitem(last=False)
        self._evict()

    def _evict(self) -> None:
        cutoff = self.clock.seconds() - self.max_age_sec
        while self._finished:
            oldest = next(iter(self._finished.values()))
            ended = oldest.ended_at
            if len(self._finished) <= self.max_runs and ended is not None and ended >= cutoff:
                break
            self._finished.popitem(last=False)
            self._unindex(oldest)

    def _publish(self, topic: str, record: RunRecord, payload: Payload) -> None:
        self.bus.publish(topic, dict(record.labels(), **payload))

    # -- reading back

    def follow(
        self,
        run_id: str,
        after: int,
        write: Callable[[int, Payload], object],
        end: Callable[[], object],
        owner: str | None = None,
    ) -> "defer.Deferred[Follower]":
        """
        Replay a run's events after C{after}, then follow it live until
        its terminal.

        @param owner: only a run of this caller key's (C{None}: any).
        @return: a Deferred firing with the L{Follower} once it is
            attached (its first events may already be written), or failing
            with a L{ServiceError} (C{not_found}: no such run, or not
            C{owner}'s).
        """
        follower = Follower(write, end, after)
        record = self.get(run_id)
        if record is not None and not visible(owner, record.caller):
            return defer.fail(no_such_run(run_id))
        if record is not None and record.kind == TUNNEL:
            return defer.fail(ServiceError("invalid", f"{run_id} is a tunnel: it has no events", code="not_a_run"))
        if record is not None and after + 1 >= record.first_seq:
            self._attach(record, follower)
            return defer.succeed(follower)
        node_id, wire_id = self.locate(run_id)
        if record is None and self.fetch is None:
            return defer.fail(no_such_run(run_id))
        if record is not None:
            # Hold live events while the Node's store fills the gap.
            follower.catching_up = True
            record.followers.append(follower)
        if self.fetch is None:
            d: defer.Deferred[tuple[str, dict[str, Any]]] = defer.fail(
                ServiceError("unavailable", f"run {run_id}: no node store to read its events from")
            )
        else:
            d = self.fetch(wire_id, node_id, after)

        def fetched(found: tuple[str, dict[str, Any]]) -> Follower:
            _, answer = found
            if record is None and not visible(owner, answer.get("run", {}).get("caller")):
                raise no_such_run(run_id)
            if answer.get("run", {}).get("kind") == TUNNEL:
                raise ServiceError("invalid", f"{run_id} is a tunnel: it has no events", code="not_a_run")
            events = [(e["seq"], dict(e, run_id=run_id)) for e in answer.get("events", [])]
            if record is not None:
                # What the Edge still holds goes behind the Node's history:
                # a terminal the Edge made up itself, or events a Node's
                # failed store never had (the follower drops repeats).
                events += list(record.log)
            follower.caught_up(events)
            if record is None or record.done:
                self._detach(record, follower)
            return follower

        def failed(failure: Failure) -> Follower | Failure:
            if record is None:
                return failure
            # The in-memory log is the best there is: the Node could not
            # fill the gap, so the reader gets what the Edge still has.
            self.log.warn(
                "run {run_id}: events {after}..{first} could not be read from its node: {why}",
                run_id=run_id,
                after=after + 1,
                first=record.first_seq - 1,
                why=failure.getErrorMessage(),
            )
            follower.caught_up(list(record.log))
            if record.done:
                self._detach(record, follower)
            return follower

        return d.addCallbacks(fetched, failed)

    def _attach(self, record: RunRecord, follower: Follower) -> None:
        for seq, payload in list(record.log):
            follower.offer(seq, payload)
        if record.done:
            follower.close()
        elif not follower.closed:
            record.followers.append(follower)

    def _detach(self, record: RunRecord | None, follower: Follower) -> None:
        if record is not None and follower in record.followers:
            record.followers.remove(follower)
        follower.close()

    def unfollow(self, run_id: str, follower: Follower) -> None:
        """
        The reader left.
        """
        record = self.get(run_id)
        if record is not None and follower in record.followers:
            record.followers.remove(follower)
        follower.closed = True
