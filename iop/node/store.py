"""
The Node's local record of its work in SQLite: every run and tunnel (what
ran, where, when, how it ended, what it cost) and every event of every
run (those of a run written in one batch as one row), so that the Edge
can read a run back after it left the Edge's memory (the C{run_get} and
C{run_list} node commands, docs/node.md "Run store").

SQLite wants one connection on one thread, so the store owns a
one-connection C{adbapi} pool, started and closed with the service. The
database runs in WAL mode, and writes are batched: they queue in memory
and go to the database together, in one transaction, every
L{FLUSH_INTERVAL_SEC} (sooner once L{BATCH_MAX} are waiting), one batch at
a time: what comes while one is being written goes in the next. A relay never
waits for a write and never sees one fail. Reads flush first, so they see
everything recorded before them.

But a store that fails is never silent. Whether the database is corrupted,
unwritable, or deleted or replaced under the running Node (SQLite would
go on writing to the unlinked file, so each batch first checks that the
path still names the file opened at start), the first failure is logged
loudly, once, as an error; the store's L{RunStore.health} then says
C{failed} with the reason, which the C{transport_status} node command and
the Node's metrics (C{iop_node_store_ok}, C{iop_node_store_failures_total})
report. A later successful write is logged as a recovery. A statement that
fails alone does not keep the rest of its batch from committing; a failure
of the database itself (locked past its busy timeout, full, unwritable)
fails the whole batch at once, rather than once per statement.

At start, rows a previous process left C{running} (it was killed, or the
machine lost power) are ended as C{error} with the code
C{node_restarted}, and a run's events end with that C{error} as its
terminal: nothing is left running forever, and a reader replaying its
events sees how it ended. Old rows are pruned in
the background by L{Retention} (C{store.retention} in node.yaml). Right
after that, the store reads whose each logical session is (the caller of
its first run that reached the adapter) into the Node's
L{iop.node.owners.SessionOwners}, which the Node waits for before it
takes work.
"""

import json
import os
import sqlite3
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import unquote, urlsplit

from twisted.application.service import IServiceCollection, Service
from twisted.enterprise import adbapi
from twisted.internet import defer
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.internet.task import LoopingCall
from twisted.logger import Logger, LogLevel
from twisted.python.failure import Failure

from iop.node.owners import NEVER_RAN, SessionOwners, Use
from iop.protocols.convert import event_details_json, usage_to_json
from iop.run import ERROR, NODE_RESTARTED, TERMINAL_TYPES, RunEventData, RunFailure, ToolCall, Usage

if TYPE_CHECKING:
    from iop.node.metrics import NodeMetrics

#: A run or tunnel as the store gives it back (columns by name).
Record = dict[str, Any]
#: One queued statement: C{(sql, params, what)}.
_Statement = tuple[str, tuple[Any, ...], str]


@dataclass(slots=True)
class _Events:
    """
    The events of one run queued in one batch, as C{(seq, event)} in the
    order they were recorded: written as one row of C{event_batches}, at
    the place in the batch where the first of them was queued. The events
    are kept as they are (an event is a value, never changed once
    emitted), so that recording one is an append and the pool's thread
    does the encoding.
    """

    run_id: str
    events: list[tuple[int, RunEventData]] = field(default_factory=list)


#: What a batch holds, in the order it was queued.
_Queued = _Statement | _Events

#: How long a write may wait in memory before its batch goes to the database.
FLUSH_INTERVAL_SEC = 0.2
#: A batch this large is written at once (statements and events, counted
#: one each).
BATCH_MAX = 1000
#: How often old rows are pruned (and once at start).
PRUNE_INTERVAL_SEC = 600.0
#: Runs pruned per transaction, so a large prune never holds the store's
#: thread long (writes and reads queued meanwhile go between), and at most
#: this many transactions per prune.
PRUNE_CHUNK = 500
PRUNE_ROUNDS = 200

RUN = "run"
TUNNEL = "tunnel"

_SCHEMA = (
    """
    CREATE TABLE IF NOT EXISTS runs (
        run_id TEXT PRIMARY KEY,
        adapter TEXT NOT NULL,
        target TEXT NOT NULL,
        session_id TEXT NOT NULL,
        background INTEGER NOT NULL,
        status TEXT NOT NULL,
        started_at REAL NOT NULL,
        ended_at REAL,
        error TEXT
    )
    """,
    """
    CREATE TABLE IF NOT EXISTS events (
        run_id TEXT NOT NULL,
        seq INTEGER NOT NULL,
        type TEXT NOT NULL,
        text TEXT NOT NULL DEFAULT '',
        usage TEXT,
        error TEXT,
        finish_reason TEXT,
        tool_call TEXT,
        PRIMARY KEY (run_id, seq)
    ) WITHOUT ROWID
    """,
    # Each row: the events of one run written in one batch, as a JSON
    # array (L{_encoded}). Its rowid is the order of writing, by which a
    # seq written again reads as its latest write.
    """
    CREATE TABLE IF NOT EXISTS event_batches (
        run_id TEXT NOT NULL,
        first_seq INTEGER NOT NULL,
        last_seq INTEGER NOT NULL,
        events TEXT NOT NULL
    )
    """,
)

#: Columns added after the first release, with their definitions: an older
#: database gets them at start (ALTER TABLE), its rows keep their values.
_ADDED_COLUMNS = (
    ("kind", "TEXT NOT NULL DEFAULT 'run'"),
    ("error_code", "TEXT"),
    ("usage", "TEXT"),
    ("bytes", "INTEGER"),
    ("caller", "TEXT"),
)

_INDEXES = (
    "CREATE INDEX IF NOT EXISTS runs_started ON runs (started_at)",
    "CREATE INDEX IF NOT EXISTS runs_status ON runs (status)",
    "CREATE INDEX IF NOT EXISTS runs_caller ON runs (caller, started_at)",
    "CREATE INDEX IF NOT EXISTS event_batches_run ON event_batches (run_id)",
)

_COLUMNS = (
    "run_id",
    "kind",
    "adapter",
    "target",
    "session_id",
    "background",
    "status",
    "started_at",
    "ended_at",
    "error",
    "error_code",
    "usage",
    "bytes",
    "caller",
)

#: Why a row left C{running} by a previous process ended.
_RESTARTED_MESSAGE = "the node restarted while this ran"
#: The rows a previous process left running.
_LEFT_RUNNING = "SELECT run_id, kind FROM runs WHERE status IN ('running', 'queued')"
#: What such a row becomes at start.
_RESTARTED = (
    "UPDATE runs SET status = 'error', error_code = ?, ended_at = ?,"
    f" error = '{_RESTARTED_MESSAGE}' WHERE status IN ('running', 'queued')"
)


@dataclass(frozen=True)
class Retention:
    """
    How long the store keeps finished work (C{store.retention} in
    node.yaml). Runs still in progress are never pruned.

    @ivar max_age_days: finished runs older than this are deleted, with
        their events; C{None} keeps them regardless of age.
    @ivar max_rows: beyond this many runs and tunnels, the oldest finished
        ones are deleted; C{None} for no limit.
    """

    max_age_days: float | None = 30.0
    max_rows: int | None = 100_000


def _json(value: object) -> str | None:
    return None if value is None else json.dumps(value, separators=(",", ":"))


def _usage(usage: Usage | dict[str, Any] | None) -> str | None:
    """
    A L{iop.run.Usage} or a usage dict as stored JSON (or C{None}).
    """
    if usage is None:
        return None
    return _json(usage if isinstance(usage, dict) else usage_to_json(usage))


def _whole_database(error: Exception) -> bool:
    """
    Whether C{error}, raised by one statement of a batch, is the
    database's rather than the statement's: locked or busy, full,
    read-only, an I/O error, a missing table (C{OperationalError}) or a
    corrupt file (a plain C{DatabaseError}). The rest of the batch would
    fail the same way, each statement after waiting out SQLite's busy
    timeout, so it is not tried. A constraint or a value SQLite refuses
    fails its statement alone.
    """
    return isinstance(error, sqlite3.OperationalError) or type(error) is sqlite3.DatabaseError


class StoreGone(Exception):
    """
    The database file was deleted or replaced under the running store.
    """


def database_file(path: str) -> str | None:
    """
    The file an SQLite path or C{file:} URI names, or C{None} for an
    in-memory database.
    """
    if path.startswith("file:"):
        parts = urlsplit(path)
        if "mode=memory" in parts.query:
            return None
        path = unquote(parts.path)
    if path in ("", ":memory:"):
        return None
    return path


class RunStore(Service):
    """
    @param path: an SQLite path, or a C{file:} URI (C{file:iop.db?mode=rwc}).
    @param now: wall-clock time source (seconds since the epoch).
    @param retention: a L{Retention}.

    @ivar restarted: how many rows the start marked C{node_restarted}
        (once the start's work is done).
    @param metrics: the L{iop.node.metrics.NodeMetrics} told about failures.
    @param owners: the Node's L{SessionOwners}, loaded from the stored
        runs at start (C{None}: not loaded).
    """

    log = Logger()

    def __init__(
        self,
        reactor: IReactorTime,
        path: str,
        now: Callable[[], float] = time.time,
        retention: Retention = Retention(),
        flush_interval: float = FLUSH_INTERVAL_SEC,
        batch_max: int = BATCH_MAX,
        prune_interval: float = PRUNE_INTERVAL_SEC,
        metrics: "NodeMetrics | None" = None,
        owners: SessionOwners | None = None,
    ) -> None:
        self.reactor = reactor
        self.owners = owners
        self.path = path
        self.now = now
        self.retention = retention
        self.flush_interval = flush_interval
        self.batch_max = batch_max
        self.prune_interval = prune_interval
        self.metrics = metrics
        self.pool: adbapi.ConnectionPool | None = None
        self.restarted: int | None = None
        self._ready: Deferred[None] | None = None
        self._pending: list[_Queued] = []
        #: The runs with events in the pending batch, by id.
        self._events: dict[str, _Events] = {}
        #: How many statements and events are pending.
        self._count = 0
        self._waiters: list[Deferred[None]] = []
        #: The callers of L{flush} waiting for the next batch.
        self._flushes: list[Deferred[None]] = []
        #: Whether a batch is being written, and whether another was asked
        #: for meanwhile.
        self._writing = False
        self._again = False
        self._timer: IDelayedCall | None = None
        self._pruner: LoopingCall | None = None
        self._file = database_file(path)
        self._identity: tuple[int, int] | None = None
        self.error: str | None = None
        self.failed_since: float | None = None
        self.failures = 0

    # -- service --------------------------------------------------------------

    def startService(self) -> None:
        super().startService()
        self.pool = adbapi.ConnectionPool(
            "sqlite3",
            self.path,
            check_same_thread=False,
            uri=self.path.startswith("file:"),
            cp_min=1,
            cp_max=1,
            cp_reactor=self.reactor,
        )
        self.pool.start()
        self._ready = self.pool.runInteraction(self._open, self.now())
        self._ready.addCallbacks(self._opened, self._failed, errbackArgs=("creating the runs table",))
        if self.owners is not None:
            # The pool's one thread runs it after the open.
            self.owners.load(self.pool.runInteraction(_session_uses))
        if self.prune_interval:
            self._pruner = LoopingCall(self.prune)
            self._pruner.clock = self.reactor
            self._pruner.start(self.prune_interval, now=True).addErrback(self._failed, "pruning")

    def stopService(self) -> Deferred[None]:
        """
        Write what is queued, then close the database.
        """
        super().stopService()
        if self._pruner is not None and self._pruner.running:
            self._pruner.stop()
        self._pruner = None
        pool = self.pool
        if pool is None:
            return defer.succeed(None)

        def close(_: object) -> Deferred[None] | None:
            if self._pending:
                # Recorded while the last batch was being written: written
                # too, in one more.
                return self.flush().addBoth(close)
            self.pool = None
            # Queued work runs before the pool's thread stops.
            pool.close()
            return None

        return self.flush().addBoth(close)

    def _open(self, txn: adbapi.Transaction, now: float) -> int:
        """
        In the pool's thread: WAL, the tables (adding columns an older
        database lacks), and rows a previous process left running.
        """
        txn.execute("PRAGMA journal_mode=WAL")
        txn.execute("PRAGMA synchronous=NORMAL")
        for statement in _SCHEMA:
            txn.execute(statement)
        txn.execute("PRAGMA table_info(runs)")
        present = {row[1] for row in txn.fetchall()}
        for name, definition in _ADDED_COLUMNS:
            if name not in present:
                txn.execute(f"ALTER TABLE runs ADD COLUMN {name} {definition}")
        for statement in _INDEXES:
            txn.execute(statement)
        txn.execute(_LEFT_RUNNING)
        left = [run_id for run_id, kind in txn.fetchall() if kind == RUN]
        txn.execute(_RESTARTED, (NODE_RESTARTED, now))
        restarted: int = txn.rowcount
        for run_id in left:
            _end_events(txn, run_id)
        if self._file is not None:
            st = os.stat(self._file)
            self._identity = (st.st_dev, st.st_ino)
        return restarted

    def _opened(self, restarted: int) -> None:
        self.restarted = restarted
        if restarted:
            self.log.warn(
                "run store: {count} run(s) left running by a previous process marked error ({code})",
                count=restarted,
                code=NODE_RESTARTED,
            )

    # -- writing (batched) ----------------------------------------------------

    def record_start(
        self,
        run_id: str,
        adapter: str,
        target: str = "",
        session_id: str = "",
        background: bool = False,
        caller: str = "",
    ) -> Deferred[None]:
        """
        Record that a run started (status C{running}), and the name of the
        caller key it belongs to (C{RunRequest.caller}; C{None} when the
        Edge did not say).
        """
        return self._write(
            "INSERT OR REPLACE INTO runs (run_id, kind, adapter, target, session_id, background, status, started_at,"
            " caller) VALUES (?, 'run', ?, ?, ?, ?, 'running', ?, ?)",
            (run_id, adapter, target, session_id, int(bool(background)), self.now(), caller or None),
            "recording the start of run " + run_id,
        )

    def record_event(self, run_id: str, seq: int, event: RunEventData) -> None:
        """
        Record one event of a run (a L{iop.run.RunEventData}) under its
        wire C{seq}. Called for every event, so it only appends the event
        to its run's part of the batch: the events of a run queued in one
        batch are encoded and written as one row, in the pool's thread.
        """
        if self.pool is None:
            self.log.warn("run store not running; not recording an event of run {run_id}", run_id=run_id)
            return
        queued = self._events.get(run_id)
        if queued is None:
            queued = self._events[run_id] = _Events(run_id)
            self._pending.append(queued)
        queued.events.append((seq, event))
        self._added()

    def record_end(
        self,
        run_id: str,
        status: str,
        error: str | None = None,
        code: str | None = None,
        usage: Usage | dict[str, Any] | None = None,
    ) -> Deferred[None]:
        """
        Record a run's terminal status (C{complete}, C{error},
        C{cancelled}) with the error's message and code, and its usage.
        """
        return self._write(
            "UPDATE runs SET status = ?, ended_at = ?, error = ?, error_code = ?, usage = ? WHERE run_id = ?",
            (status, self.now(), error, code, _usage(usage), run_id),
            "recording the end of run " + run_id,
        )

    def record_tunnel_start(self, tunnel_id: str, adapter: str, target: str = "", caller: str = "") -> Deferred[None]:
        """
        Record that a provider tunnel started (status C{running}), and
        whose it is (as L{record_start}).
        """
        return self._write(
            "INSERT OR REPLACE INTO runs (run_id, kind, adapter, target, session_id, background, status, started_at,"
            " bytes, caller) VALUES (?, 'tunnel', ?, ?, '', 0, 'running', ?, 0, ?)",
            (tunnel_id, adapter, target, self.now(), caller or None),
            "recording the start of tunnel " + tunnel_id,
        )

    def record_tunnel_end(
        self,
        tunnel_id: str,
        status: str,
        error: str | None = None,
        code: str | None = None,
        usage: Usage | dict[str, Any] | None = None,
        size: int = 0,
    ) -> Deferred[None]:
        """
        Record a tunnel's end: C{complete}, C{error} or C{cancelled}, the
        usage observed in its body, and how many body bytes it relayed.
        """
        return self._write(
            "UPDATE runs SET status = ?, ended_at = ?, error = ?, error_code = ?, usage = ?, bytes = ?"
            " WHERE run_id = ?",
            (status, self.now(), error, code, _usage(usage), size, tunnel_id),
            "recording the end of tunnel " + tunnel_id,
        )

    def health(self) -> dict[str, Any]:
        """
        C{{"status": "ok" | "failed" | "stopped", "path", "error",
        "failed_since", "failed_writes"}}: what C{transport_status} reports.
        """
        status = "failed" if self.error is not None else ("ok" if self.pool is not None else "stopped")
        return {
            "status": status,
            "path": self.path,
            "error": self.error,
            "failed_since": self.failed_since,
            "failed_writes": self.failures,
        }

    def _write(self, sql: str, params: tuple[Any, ...], what: str) -> Deferred[None]:
        """
        Queue one statement for the next batch.

        @return: a Deferred firing (never failing) once its batch is
            written (at once when the store is not running).
        """
        d: Deferred[None] = Deferred()
        return d if self._queue(sql, params, what, d) else defer.succeed(None)

    def _queue(self, sql: str, params: tuple[Any, ...], what: str, waiter: Deferred[None] | None) -> bool:
        """
        Queue one statement, and C{waiter} (if any) to fire once its batch
        is written. @return: whether it was queued (the store runs).
        """
        if self.pool is None:
            self.log.warn("run store not running; not {what}", what=what)
            return False
        self._pending.append((sql, params, what))
        if waiter is not None:
            self._waiters.append(waiter)
        self._added()
        return True

    def _added(self) -> None:
        """
        One more statement or event is pending: write the batch once it
        holds L{batch_max}, else within the interval.
        """
        self._count += 1
        if self._count >= self.batch_max:
            self._kick()
        elif self._timer is None:
            self._timer = self.reactor.callLater(self.flush_interval, self._kick)

    def flush(self) -> Deferred[None]:
        """
        Write every queued statement now, in one transaction (once the
        batch being written, if any, is).

        @return: a Deferred firing once they are written (after the work
            already queued in the pool, when nothing is pending).
        """
        if self.pool is None:
            return defer.succeed(None)
        d: Deferred[None] = Deferred()
        self._flushes.append(d)
        self._kick()
        return d

    def _kick(self) -> None:
        """
        Write what is pending now, or, while a batch is being written, as
        soon as it is: one batch at a time, so that a slow or locked
        database makes the next batch larger (what came meanwhile, in one
        transaction) instead of queueing batch after batch on the store's
        thread, each one more for a read to wait behind.
        """
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None
        if self._writing:
            self._again = True
        elif self.pool is not None:
            self._write_next(self.pool)

    def _write_next(self, pool: adbapi.ConnectionPool) -> None:
        """
        Hand every pending record to the pool as one batch; once it is
        written, fire the Deferreds waiting for it, and write the next one
        if anything asked meanwhile.
        """
        batch, self._pending = self._pending, []
        count, self._count = self._count, 0
        self._events = {}
        waiters, self._waiters = self._waiters + self._flushes, []
        self._flushes = []
        self._writing = True
        self._again = False
        d: Deferred[Any]
        if not batch:
            d = pool.runInteraction(lambda txn: None)
        else:
            d = pool.runInteraction(self._write_batch, batch)
            d.addCallbacks(self._written, self._failed, errbackArgs=(f"writing {count} record(s)", count))

        def settle(result: object) -> None:
            self._writing = False
            for waiter in waiters:
                waiter.callback(None)
            if (self._again or self._flushes) and not self._writing:
                self._kick()

        d.addBoth(settle)

    def _write_batch(self, txn: adbapi.Transaction, batch: list[_Queued]) -> tuple[int, list[tuple[Failure, str, int]]]:
        """
        In the pool's thread: check that the path still names the file
        opened at start, then every statement of the batch, in order, and
        each run's events as one row; one that fails is reported, the
        others still commit.

        @return: C{(written, [(failure, what, count)])}, counting
            statements and events.
        """
        if self._identity is not None and self._file is not None:
            try:
                st = os.stat(self._file)
            except FileNotFoundError:
                raise StoreGone(f"the database file {self._file} was deleted") from None
            if (st.st_dev, st.st_ino) != self._identity:
                raise StoreGone(f"the database file {self._file} was replaced")
        written = 0
        failures: list[tuple[Failure, str, int]] = []
        for queued in batch:
            count = 1
            try:
                if isinstance(queued, _Events):
                    count = len(queued.events)
                    what = f"recording {count} event(s) of run {queued.run_id}"
                    txn.execute(_EVENT_BATCH, _event_batch(queued))
                else:
                    sql, params, what = queued
                    txn.execute(sql, params)
                written += count
            except Exception as e:
                if _whole_database(e):
                    # Every statement after it would fail the same way (a
                    # locked database waiting out its busy timeout each
                    # time): the batch fails as one, rolled back.
                    raise
                failures.append((Failure(), what, count))
        return written, failures

    def _written(self, outcome: tuple[int, list[tuple[Failure, str, int]]]) -> None:
        written, failures = outcome
        for failure, what, count in failures:
            self._failed(failure, what, count)
        if written:
            self._succeeded(None)

    def _succeeded(self, result: None) -> None:
        if self.error is not None:
            self.log.info(
                "run store recovered after {count} failed write(s): {path}", count=self.failures, path=self.path
            )
            self.error = None
            self.failed_since = None
            if self.metrics is not None:
                self.metrics.store_ok(True)
        return result

    def _failed(self, failure: Failure, what: str, count: int = 1) -> None:
        self.failures += count
        if self.metrics is not None:
            for _ in range(count):
                self.metrics.store_failed()
        if self.error is None:
            self.error = f"{what}: {failure.getErrorMessage() or type(failure.value).__name__}"
            self.failed_since = self.now()
            if self.metrics is not None:
                self.metrics.store_ok(False)
            # Loud, once: every later failure is counted, not logged.
            self.log.failure(
                "RUN STORE FAILED ({path}) {what}: runs go on but are no longer recorded until it is fixed;"
                " transport_status and iop_node_store_ok report it",
                failure,
                path=self.path,
                what=what,
                level=LogLevel.error,
            )
        return None

    # -- reading ----------------------------------------------------------------

    def _read(self, interaction: Callable[..., Any], *args: object) -> Deferred[Any]:
        if self.pool is None:
            return defer.fail(RuntimeError("the run store is not running"))

        def read(_: object) -> Deferred[Any]:
            if self.pool is None:
                raise RuntimeError("the run store is not running")
            return self.pool.runInteraction(interaction, *args)

        return self.flush().addCallback(read)

    def get(self, run_id: str, after: int = 0) -> "Deferred[dict[str, Any] | None]":
        """
        One run or tunnel with its events after C{after} and its whole
        output (the text of its deltas).

        @return: a Deferred firing with C{{"run": row, "events": [...]}}
            (rows as L{list_runs} gives them, plus C{output}), or C{None}
            when the store knows no such id.
        """
        return self._read(_get, run_id, after)

    def list_runs(
        self, status: str | None = None, kind: str | None = None, limit: int = 50, caller: str | None = None
    ) -> Deferred[list[Record]]:
        """
        @return: a Deferred list of the latest C{limit} runs and tunnels as
            dicts (newest first), only those of C{status}, C{kind} (C{run},
            C{tunnel}) and C{caller} (a caller key's name) when given.
        """
        return self._read(_list, status, kind, limit, caller)

    def recent(self, limit: int = 50) -> Deferred[list[Record]]:
        """
        The latest C{limit} runs and tunnels, newest first.
        """
        return self.list_runs(limit=limit)

    # -- retention ----------------------------------------------------------------

    def prune(self) -> Deferred[int | None]:
        """
        Delete finished runs (and their events) beyond the L{Retention}.

        @return: a Deferred firing with how many runs were deleted
            (C{None} when pruning failed: the failure is reported).
        """
        if self.pool is None:
            return defer.succeed(0)
        retention = self.retention
        if retention.max_age_days is None and retention.max_rows is None:
            return defer.succeed(0)
        cutoff = None if retention.max_age_days is None else self.now() - retention.max_age_days * 86400
        pool = self.pool
        total = 0

        @defer.inlineCallbacks
        def chunks() -> Generator[Deferred[int], int, int]:
            nonlocal total
            # A chunk per transaction, at most PRUNE_ROUNDS of them: what is
            # left waits for the next prune.
            for _ in range(PRUNE_ROUNDS):
                count = yield pool.runInteraction(_prune, cutoff, retention.max_rows)
                total += count
                if count < PRUNE_CHUNK:
                    break
            return total

        def pruned(count: int | None) -> int | None:
            if count:
                self.log.info("run store: pruned {count} finished run(s) past the retention", count=count)
            return count

        d: Deferred[int | None] = chunks().addCallback(pruned)
        return d.addErrback(self._failed, "pruning old runs")


def _row(row: tuple[Any, ...]) -> Record:
    record = dict(zip(_COLUMNS, row, strict=True))
    record["background"] = bool(record["background"])
    record["usage"] = json.loads(record["usage"]) if record["usage"] else None
    return record


def _event(row: tuple[Any, ...]) -> dict[str, Any]:
    """
    A row of the C{events} table (written by older versions, one per
    event) as L{RunStore.get} gives it.
    """
    seq, kind, text, usage, error, finish_reason, tool_call = row
    event: dict[str, Any] = {"seq": seq, "type": kind}
    if text:
        event["text"] = text
    if tool_call:
        event["tool_call"] = json.loads(tool_call)
    if finish_reason:
        event["finish_reason"] = finish_reason
    if usage:
        event["usage"] = json.loads(usage)
    if error:
        error = json.loads(error)
        if not error.get("status"):
            error.pop("status", None)
        event["error"] = error
    return event


_EVENT_BATCH = "INSERT INTO event_batches (run_id, first_seq, last_seq, events) VALUES (?, ?, ?, ?)"


def _encoded(seq: int, event: RunEventData) -> list[Any]:
    """
    One event in an C{event_batches} row: C{[seq, type]}, then its text,
    then an object of whatever else is set (C{tool_call},
    C{finish_reason}, C{usage}, C{error}, an error's C{status} only when
    it has one). Positional, so that a delta costs little more than its
    text: the keys of every event would make the rows larger than the
    old per-event rows.
    """
    rest = event_details_json(event)
    if rest:
        return [seq, event.type, event.text, rest]
    return [seq, event.type, event.text] if event.text else [seq, event.type]


def _decoded(encoded: list[Any]) -> dict[str, Any]:
    """
    An event of an C{event_batches} row (L{_encoded}) as L{RunStore.get}
    gives it, like L{_event} an old row.
    """
    event: dict[str, Any] = {"seq": encoded[0], "type": encoded[1]}
    if len(encoded) > 2 and encoded[2]:
        event["text"] = encoded[2]
    if len(encoded) > 3:
        event.update(encoded[3])
    return event


def _event_batch(queued: _Events) -> tuple[str, int, int, str]:
    """
    The C{event_batches} row of one run's events in one batch.
    """
    seqs = [seq for seq, _ in queued.events]
    # ASCII (the default): a stray surrogate in a text is escaped, where
    # as UTF-8 it would fail the whole row.
    encoded = json.dumps([_encoded(seq, event) for seq, event in queued.events], separators=(",", ":"))
    return queued.run_id, min(seqs), max(seqs), encoded


def stored_event(payload: dict[str, Any]) -> RunEventData:
    """
    A stored event (as L{RunStore.get} gives it) as the L{RunEventData}
    it was, to send it again.
    """
    usage = payload.get("usage")
    error = payload.get("error")
    call = payload.get("tool_call")
    return RunEventData(
        type=payload["type"],
        text=payload.get("text", ""),
        usage=Usage(**usage) if usage else None,
        error=RunFailure(error.get("code", ""), error.get("message", ""), error.get("status", 0)) if error else None,
        finish_reason=payload.get("finish_reason"),
        tool_call=ToolCall(call["id"], call["name"], call.get("arguments", "{}")) if call else None,
    )


def _last_event(txn: adbapi.Transaction, run_id: str) -> tuple[int, str] | None:
    """
    The C{(seq, type)} of a run's last stored event (of either table, the
    latest write of its seq), or C{None} when it has none.
    """
    last: tuple[int, str] | None = None
    txn.execute("SELECT seq, type FROM events WHERE run_id = ? ORDER BY seq DESC LIMIT 1", (run_id,))
    row = txn.fetchone()
    if row is not None:
        last = (row[0], row[1])
    txn.execute(
        "SELECT events FROM event_batches WHERE run_id = ? ORDER BY last_seq DESC, rowid DESC LIMIT 1", (run_id,)
    )
    row = txn.fetchone()
    if row is not None:
        # (A batch written later wins a seq: the old table's, or its own
        # earlier write of it.)
        for encoded in json.loads(row[0]):
            if last is None or encoded[0] >= last[0]:
                last = (encoded[0], encoded[1])
    return last


def _end_events(txn: adbapi.Transaction, run_id: str) -> None:
    """
    End the stored events of a run a previous process left running with
    the terminal it ended with (C{error}, C{node_restarted}), after its
    last one, unless that was a terminal already (the process died between
    writing it and the row's end).
    """
    last = _last_event(txn, run_id)
    if last is not None and last[1] in TERMINAL_TYPES:
        return
    seq = 1 if last is None else last[0] + 1
    terminal = RunEventData(ERROR, error=RunFailure(NODE_RESTARTED, _RESTARTED_MESSAGE))
    txn.execute(_EVENT_BATCH, _event_batch(_Events(run_id, [(seq, terminal)])))


def _get(txn: adbapi.Transaction, run_id: str, after: int) -> dict[str, Any] | None:
    txn.execute(f"SELECT {', '.join(_COLUMNS)} FROM runs WHERE run_id = ?", (run_id,))
    row = txn.fetchone()
    if row is None:
        return None
    run = _row(row)
    # By seq, the latest write winning: the rows of older versions first,
    # then the batches in the order they were written.
    by_seq: dict[int, dict[str, Any]] = {}
    txn.execute(
        "SELECT seq, type, text, usage, error, finish_reason, tool_call FROM events WHERE run_id = ?", (run_id,)
    )
    for old in txn.fetchall():
        by_seq[old[0]] = _event(old)
    txn.execute("SELECT events FROM event_batches WHERE run_id = ? ORDER BY rowid", (run_id,))
    for (batch,) in txn.fetchall():
        for encoded in json.loads(batch):
            by_seq[encoded[0]] = _decoded(encoded)
    events = [by_seq[seq] for seq in sorted(by_seq)]
    run["output"] = "".join(event.get("text", "") for event in events if event["type"] == "delta")
    return {"run": run, "events": [event for event in events if event["seq"] > after]}


def _list(
    txn: adbapi.Transaction, status: str | None, kind: str | None, limit: int, caller: str | None = None
) -> list[Record]:
    where: list[str] = []
    params: list[str] = []
    for column, value in (("status", status), ("kind", kind), ("caller", caller)):
        if value:
            where.append(f"{column} = ?")
            params.append(value)
    clause = f" WHERE {' AND '.join(where)}" if where else ""
    txn.execute(
        f"SELECT {', '.join(_COLUMNS)} FROM runs{clause} ORDER BY started_at DESC, rowid DESC LIMIT ?",
        (*params, limit),
    )
    return [_row(r) for r in txn.fetchall()]


def _session_uses(txn: adbapi.Transaction) -> list[Use]:
    """
    The first use of each session by a caller key: of the stored runs
    with a session id and a caller that the Node did not refuse before
    their adapter saw them (L{NEVER_RAN}), the oldest per C{(adapter,
    session_id)} (SQLite takes a bare column from the row C{MIN} picks),
    so a session of many runs is one row.
    """
    marks = ", ".join("?" * len(NEVER_RAN))
    txn.execute(
        "SELECT adapter, session_id, caller, MIN(started_at) FROM runs"
        " WHERE kind = 'run' AND session_id != '' AND caller != ''"
        f" AND (error_code IS NULL OR error_code NOT IN ({marks})) GROUP BY adapter, session_id",
        NEVER_RAN,
    )
    return [(adapter, session_id, caller) for adapter, session_id, caller, _ in txn.fetchall()]


def _prune(txn: adbapi.Transaction, cutoff: float | None, max_rows: int | None) -> int:
    """
    Delete at most L{PRUNE_CHUNK} finished runs past the retention, oldest
    first: those ended before C{cutoff}, then the oldest beyond
    C{max_rows}. One transaction holds the store's one thread: L{RunStore.prune}
    asks again, so that the writes and reads queued meanwhile go between.

    @return: how many were deleted (C{PRUNE_CHUNK}: there may be more).
    """
    doomed: list[str] = []
    if cutoff is not None:
        txn.execute("SELECT run_id FROM runs WHERE status != 'running' AND ended_at < ? LIMIT ?", (cutoff, PRUNE_CHUNK))
        doomed.extend(run_id for (run_id,) in txn.fetchall())
    if max_rows is not None and len(doomed) < PRUNE_CHUNK:
        txn.execute("SELECT COUNT(*) FROM runs")
        (total,) = txn.fetchone()
        excess = min(total - len(doomed) - max_rows, PRUNE_CHUNK - len(doomed))
        if excess > 0:
            marks = ", ".join("?" * len(doomed))
            skip = f"AND run_id NOT IN ({marks})" if doomed else ""
            txn.execute(
                f"SELECT run_id FROM runs WHERE status != 'running' {skip} ORDER BY started_at ASC, rowid ASC LIMIT ?",
                (*doomed, excess),
            )
            doomed.extend(run_id for (run_id,) in txn.fetchall())
    if doomed:
        marks = ", ".join("?" * len(doomed))
        txn.execute(f"DELETE FROM events WHERE run_id IN ({marks})", doomed)
        txn.execute(f"DELETE FROM event_batches WHERE run_id IN ({marks})", doomed)
        txn.execute(f"DELETE FROM runs WHERE run_id IN ({marks})", doomed)
    return len(doomed)


class NullStore:
    """
    A store that records nothing (tests, or a Node with no history).
    """

    def record_start(
        self,
        run_id: str,
        adapter: str,
        target: str = "",
        session_id: str = "",
        background: bool = False,
        caller: str = "",
    ) -> Deferred[None]:
        return defer.succeed(None)

    def record_event(self, run_id: str, seq: int, event: RunEventData) -> None:
        pass

    def record_end(
        self,
        run_id: str,
        status: str,
        error: str | None = None,
        code: str | None = None,
        usage: Usage | dict[str, Any] | None = None,
    ) -> Deferred[None]:
        return defer.succeed(None)

    def record_tunnel_start(self, tunnel_id: str, adapter: str, target: str = "", caller: str = "") -> Deferred[None]:
        return defer.succeed(None)

    def record_tunnel_end(
        self,
        tunnel_id: str,
        status: str,
        error: str | None = None,
        code: str | None = None,
        usage: Usage | dict[str, Any] | None = None,
        size: int = 0,
    ) -> Deferred[None]:
        return defer.succeed(None)

    def get(self, run_id: str, after: int = 0) -> "Deferred[dict[str, Any] | None]":
        return defer.succeed(None)

    def list_runs(
        self, status: str | None = None, kind: str | None = None, limit: int = 50, caller: str | None = None
    ) -> Deferred[list[Record]]:
        return defer.succeed([])

    def recent(self, limit: int = 50) -> Deferred[list[Record]]:
        return defer.succeed([])

    def health(self) -> dict[str, Any]:
        return {"status": "none"}


class Store(Protocol):
    """
    What the relays record to and commands read from: the SQLite
    L{RunStore}, the L{NullStore}, or a test's recorder.
    """

    def record_start(
        self,
        run_id: str,
        adapter: str,
        target: str = "",
        session_id: str = "",
        background: bool = False,
        caller: str = "",
    ) -> Deferred[None]: ...

    def record_event(self, run_id: str, seq: int, event: RunEventData) -> None: ...

    def record_end(
        self,
        run_id: str,
        status: str,
        error: str | None = None,
        code: str | None = None,
        usage: Usage | dict[str, Any] | None = None,
    ) -> Deferred[None]: ...

    def record_tunnel_start(
        self, tunnel_id: str, adapter: str, target: str = "", caller: str = ""
    ) -> Deferred[None]: ...

    def record_tunnel_end(
        self,
        tunnel_id: str,
        status: str,
        error: str | None = None,
        code: str | None = None,
        usage: Usage | dict[str, Any] | None = None,
        size: int = 0,
    ) -> Deferred[None]: ...

    def get(self, run_id: str, after: int = 0) -> "Deferred[dict[str, Any] | None]": ...

    def list_runs(
        self, status: str | None = None, kind: str | None = None, limit: int = 50, caller: str | None = None
    ) -> Deferred[list[Record]]: ...

    def health(self) -> dict[str, Any]: ...


class StoreService(Store, Protocol):
    """
    A L{Store} that is also a service of the Node's tree (started and
    stopped with it): the L{RunStore}, or a test's recorder.
    """

    def setServiceParent(self, parent: IServiceCollection) -> None: ...

    def stopService(self) -> "Deferred[None] | None": ...
