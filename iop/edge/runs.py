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

A run placed again goes by another id on the wire (C{<id>-<n>},
L{iop.edge.failover.Work.wire_id}), perhaps on another Node, and an
attempt that continues a cut answer numbers its events after what the
caller already has (its C{seq_base}: Node seq C{k} is the caller's
C{seq_base + k}; L{iop.edge.dispatch.RunDispatch}). The book keeps each
record's attempts (L{Attempt}), also once the record is gone, and reads a
run back across them (L{read_attempts}): what the caller got of an attempt
is its events up to where the next one took over.
"""

from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
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
#: How many finished ids the book remembers the attempts of (node, wire
#: id, seq base), once their records are gone, so it knows which Nodes to
#: ask and how to number what they answer.
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

#: One attempt of a run: C{(node_id, wire_id, seq_base)} — the node it was
#: sent to (C{None}: unknown), its id on the wire there, and the last seq
#: the caller had when it began (its Node seq C{k} is the caller's
#: C{seq_base + k}; 0 for a first attempt or one placed again before any
#: output).
Attempt = tuple[str | None, str, int]


def split_wire_id(wire_id: str) -> tuple[str, int]:
    """
    The run id and attempt number a wire id names by the starter's
    convention (L{iop.edge.failover.Work.wire_id}): a first attempt goes by
    its run's id, attempt C{n >= 2} by C{<id>-<n>}. Only for ids of work
    the book does not know: the convention cannot tell C{<id>-<n>} from a
    first attempt whose id ends that way, so an id is split only when what
    is left still looks like a run id (C{<prefix>-<token>}, L{iop.edge.spec.new_id}).
    """
    numbered = _numbered(wire_id)
    if numbered is not None and "-" in numbered[0]:
        return numbered
    return wire_id, 1


def _numbered(wire_id: str) -> tuple[str, int] | None:
    """
    C{(run id, n)} when C{wire_id} has the form of attempt C{n >= 2} of a
    run (C{<id>-<n>}), else C{None}.
    """
    head, _, tail = wire_id.rpartition("-")
    if head and tail.isascii() and tail.isdigit() and tail == str(int(tail)) and int(tail) >= 2:
        return head, int(tail)
    return None


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
        #: The caller's last seq when the current attempt began (see
        #: L{Attempt}); the attempts before it, oldest first.
        self.seq_base = 0
        self.earlier: list[Attempt] = []
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
    def attempts(self) -> list[Attempt]:
        """
        Every attempt, the current one last.
        """
        return [*self.earlier, (self.node, self.wire_id, self.seq_base)]

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


def _spans(attempts: Sequence[Attempt]) -> list[tuple[Attempt, int | None]]:
    """
    Each attempt with the last of the caller's seqs it gave (where the
    next one took over; C{None} for the last attempt: no end).
    """
    ends: list[int | None] = [later[2] for later in attempts[1:]]
    return list(zip(attempts, [*ends, None], strict=True))


def _worth_keeping(attempts: Sequence[Attempt]) -> tuple[Attempt, ...]:
    """
    The attempts a forgotten run is read back from: those its caller got
    events of, and the last (one placed again before any output gave none).
    """
    return tuple(attempt for attempt, end in _spans(attempts) if end is None or end > attempt[2])


class ReadBack:
    """
    A run as the stores of its attempts have it (L{read_attempts}), in its
    caller's numbering.

    @ivar rows: C{(node_id, row)}: the store row of each attempt read,
        oldest first.
    @ivar last: the last attempt's C{(node_id, row)} — the run's status,
        usage and error — or C{None} when it could not be read.
    @ivar events: C{(seq, payload)} after the caller's resume point, in
        order.
    @ivar missing: C{(attempt, failure)} of each attempt that could not be
        read.
    """

    def __init__(self) -> None:
        self.rows: list[tuple[str, dict[str, Any]]] = []
        self.last: tuple[str, dict[str, Any]] | None = None
        self.events: list[tuple[int, Payload]] = []
        self.missing: list[tuple[Attempt, Failure]] = []
        #: Whether a store answered in part: its events past what fits in
        #: the answers the Edge reads (C{more_events}).
        self.cut = False
        self._texts: list[str] = []

    @property
    def partial(self) -> bool:
        """
        Whether some of what was asked could not be read.
        """
        return bool(self.missing) or self.cut

    @property
    def output(self) -> str:
        """
        The text of the deltas read (the run's whole output when read from
        its start with nothing L{missing}).
        """
        return "".join(self._texts)

    def failure(self) -> Failure:
        """
        Why nothing could be read: a failure other than C{not_found} (a
        node offline) before one that is.
        """
        for _, failure in self.missing:
            if not (isinstance(failure.value, ServiceError) and failure.value.kind == "not_found"):
                return failure
        return self.missing[-1][1]

    def why_missing(self) -> str:
        """
        The attempts that could not be read and why, for a log line.
        """
        return "; ".join(
            f"{wire_id} on {node_id or 'any node'}: {failure.getErrorMessage()}"
            for (node_id, wire_id, _), failure in self.missing
        )


def read_attempts(fetch: Fetch, run_id: str, attempts: Sequence[Attempt], after: int) -> "defer.Deferred[ReadBack]":
    """
    Read a run back from the stores of its attempts (each asked at once,
    with C{after} in its own numbering): their events after the caller's
    C{after}, shifted into the caller's numbering and joined in order —
    each attempt's up to where the next one took over (later events never
    reached the caller, nor did a terminal there), a continuation's own
    C{start} left out (the caller's answer had started) — and its output.

    @return: a Deferred of the L{ReadBack}; it does not fail: an attempt
        that could not be read is in its C{missing}.
    """
    asked: list[tuple[Attempt, int | None, defer.Deferred[tuple[str, dict[str, Any]]]]] = []
    for attempt, end in _spans(attempts):
        node_id, wire_id, base = attempt
        if end is not None and end <= max(base, after):
            continue  # none of its events are after the resume point
        asked.append((attempt, end, defer.maybeDeferred(fetch, wire_id, node_id, max(0, after - base))))

    def joined(results: list[tuple[bool, Any]]) -> ReadBack:
        back = ReadBack()
        for (attempt, end, _), (ok, found) in zip(asked, results, strict=True):
            if not ok:
                back.missing.append((attempt, found))
                continue
            node_id, answer = found
            row: dict[str, Any] = answer.get("run") or {}
            base = attempt[2]
            back.rows.append((node_id, row))
            events: list[tuple[int, Payload]] = []
            for stored in answer.get("events", []):
                seq = base + stored["seq"]
                if seq <= after or (end is not None and (seq > end or stored.get("type") in TERMINAL_TYPES)):
                    continue
                if base and stored.get("type") == START:
                    continue
                events.append((seq, dict(stored, seq=seq, run_id=run_id)))
            back.events += events
            if end is None:
                back.last = (node_id, row)
            cut = bool(answer.get("more_events"))
            if end is None and after == 0 and "output" in row and not row.get("output_truncated"):
                back._texts.append(row["output"])
            else:
                back._texts.append("".join(p.get("text", "") for _, p in events if p.get("type") == DELTA))
                cut = cut or bool(row.get("output_truncated") and after == 0 and not events)
            back.cut = back.cut or cut
        back.events.sort(key=lambda pair: pair[0])
        return back

    return defer.DeferredList([d for _, _, d in asked], consumeErrors=True).addCallback(joined)


class Follower:
    """
    One reader of a run's events (an SSE response), given each event once,
    in seq order, after C{after}; and the terminal, whatever C{after}.

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
            # A resume point at or past the terminal (a reader that saw it,
            # or one whose last id the Node's store gave the terminal after
            # a crash lost its last events): it is told how the run ended,
            # so that a resumed stream always ends with its terminal.
            if payload.get("type") in TERMINAL_TYPES and not self.catching_up:
                self.write(seq, payload)
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
        #: run id -> the attempts of finished runs (those the caller got
        #: events of, and the last).
        self._where: OrderedDict[str, tuple[Attempt, ...]] = OrderedDict()
        #: wire id -> run id of the records in memory whose latest
        #: attempt has an id of its own on the wire (C{<id>-<n>}).
        self._by_wire: dict[str, str] = {}

    # -- records

    def open(self, run_id: str, kind: str, **fields: Any) -> RunRecord:
        """
        The record of C{run_id}, made now if new; C{fields} update it.
        A new C{node} or C{wire_id} for a record that was placed is its
        next attempt (L{RunRecord.attempts}), from the caller's last seq.
        """
        record = self.get(run_id)
        if record is None:
            record = RunRecord(run_id, kind, self.clock.seconds(), **fields)
            self._live[run_id] = record
        else:
            self._unindex(record)
            node, wire_id = record.node, record.wire_id
            for name, value in fields.items():
                setattr(record, name, value)
            if node is not None and (record.node, record.wire_id) != (node, wire_id):
                # Another attempt: the caller got events 1..last_seq, and
                # a continuation numbers its own after them (the starter
                # gives RunDispatch.seq_base the same last_seq; an attempt
                # placed again before any output starts from 0, as
                # nothing was logged).
                record.earlier.append((node, wire_id, record.seq_base))
                record.seq_base = record.last_seq
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
        wire_id)} — the node its last attempt ran on (C{None} when
        forgotten) and the id it had there (see L{attempts} for all).
        """
        node_id, wire_id, _ = self.attempts(run_id)[-1]
        return node_id, wire_id

    def attempts(self, run_id: str) -> list[Attempt]:
        """
        Every attempt of a run the book may no longer hold, oldest first
        (once forgotten: C{[(None, run_id, 0)]}, to ask every node).
        """
        record = self.get(run_id)
        if record is not None:
            return record.attempts
        return list(self._where.get(run_id, ((None, run_id, 0),)))

    def forgotten(self, node_id: str, wire_id: str) -> bool:
        """
        Whether C{wire_id} on C{node_id} is an attempt of a run that ended
        here and whose record is gone (the book remembers its attempts):
        a Node that reports it running after that is not told of a new
        run, but that the Edge is done with it.
        """
        numbered = _numbered(wire_id)
        for run_id in (wire_id, numbered[0] if numbered is not None else None):
            if run_id is None or self.get(run_id) is not None:
                continue
            if any((node, wire) == (node_id, wire_id) for node, wire, _ in self._where.get(run_id, ())):
                return True
        return False

    def listed_as(self, node_id: str, wire_id: str) -> tuple[str, int] | None:
        """
        How a Node's store row of the attempt C{wire_id} on C{node_id} is
        listed (C{GET /v1/runs}): C{(run_id, rank)}, under the id its
        caller knows, the row of highest rank winning among one run's; or
        C{None}, not at all — the book holds the run (its record is the
        listing, whatever its status), or remembers that its last attempt
        was another one.

        A run the book knows nothing of is listed by the wire-id
        convention (L{split_wire_id}): its latest attempt in the rows
        stands for it, which may not be its last if that one is missing.
        """
        numbered = _numbered(wire_id)
        for run_id in (wire_id, numbered[0] if numbered is not None else None):
            if run_id is None:
                continue
            if self.get(run_id) is not None:
                return None
            attempts = self._where.get(run_id)
            if attempts is not None:
                last_node, last_wire, _ = attempts[-1]
                if (last_node, last_wire) != (node_id, wire_id):
                    return None
                return run_id, len(attempts)
        return split_wire_id(wire_id)

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
            self._where[record.id] = _worth_keeping(record.attempts)
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
        attempts = self.attempts(run_id)
        if record is None and self.fetch is None:
            return defer.fail(no_such_run(run_id))
        if record is not None:
            # Hold live events while the Node's store fills the gap.
            follower.catching_up = True
            record.followers.append(follower)
        if self.fetch is None:
            unread = ReadBack()
            unread.missing.append(
                (
                    attempts[-1],
                    Failure(ServiceError("unavailable", f"run {run_id}: no node store to read its events from")),
                )
            )
            d = defer.succeed(unread)
        else:
            # (From one before: the event at the resume point, when it is
            # the terminal, is told again.)
            d = read_attempts(self.fetch, run_id, attempts, max(after - 1, 0))

        def fetched(back: ReadBack) -> Follower | Failure:
            if not back.rows:
                if record is None:
                    return back.failure()
                # The in-memory log is the best there is: the Node could
                # not fill the gap, so the reader gets what the Edge still
                # has.
                self.log.warn(
                    "run {run_id}: events {after}..{first} could not be read from its node: {why}",
                    run_id=run_id,
                    after=after + 1,
                    first=record.first_seq - 1,
                    why=back.why_missing(),
                )
                follower.caught_up(list(record.log))
                if record.done:
                    self._detach(record, follower)
                return follower
            if record is None and not all(visible(owner, row.get("caller")) for _, row in back.rows):
                raise no_such_run(run_id)
            if any(row.get("kind") == TUNNEL for _, row in back.rows):
                raise ServiceError("invalid", f"{run_id} is a tunnel: it has no events", code="not_a_run")
            if back.partial:
                # What can be read, in the caller's numbering: a gap where
                # an attempt could not be read, or past what a store's
                # answers hold (a stream that ends without a terminal when
                # it is the last; the reader may resume).
                self.log.warn(
                    "run {run_id}: events after {after} could not all be read: {why}",
                    run_id=run_id,
                    after=after,
                    why=back.why_missing() or "more than the answers of its node's store hold",
                )
            events = back.events
            if record is not None:
                # What the Edge still holds goes behind the Node's history:
                # a terminal the Edge made up itself, or events a Node's
                # failed store never had (the follower drops repeats).
                events += list(record.log)
            follower.caught_up(events)
            if record is None or record.done:
                self._detach(record, follower)
            return follower

        return d.addCallback(fetched)

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
