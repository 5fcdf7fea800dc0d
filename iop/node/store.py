"""
The Node's local run history in SQLite.

It is a local record for the operator of this machine (what ran, when, how
it ended), not a global audit API. SQLite wants one connection on one
thread, so the store owns a one-connection C{adbapi} pool, started and
closed with the service. Writes are fire-and-forget: a failing write never
delays or breaks the relay of a run.

But a store that fails is never silent. Whether the database is corrupted,
unwritable, or deleted or replaced under the running Node (SQLite would
go on writing to the unlinked file, so each write first checks that the
path still names the file opened at start), the first failure is logged
loudly, once, as an error; the store's L{RunStore.health} then says
C{failed} with the reason, which the C{transport_status} node command and
the Node's metrics (C{iop_node_store_ok}, C{iop_node_store_failures_total})
report. A later successful write is logged as a recovery.
"""

import os
import time
from urllib.parse import unquote, urlsplit

from twisted.application.service import Service
from twisted.enterprise import adbapi
from twisted.internet import defer
from twisted.logger import Logger, LogLevel

_SCHEMA = """
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
"""

_COLUMNS = ("run_id", "adapter", "target", "session_id", "background", "status", "started_at", "ended_at", "error")


class StoreGone(Exception):
    """
    The database file was deleted or replaced under the running store.
    """


def database_file(path):
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
    @param metrics: the L{iop.node.metrics.NodeMetrics} told about failures.
    """

    log = Logger()

    def __init__(self, reactor, path, now=time.time, metrics=None):
        self.reactor = reactor
        self.path = path
        self.now = now
        self.metrics = metrics
        self.pool = None
        self._ready = None
        self._file = database_file(path)
        self._identity = None
        self.error = None
        self.failed_since = None
        self.failures = 0

    def startService(self):
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
        self._ready = self.pool.runInteraction(self._create)
        self._ready.addCallbacks(self._succeeded, self._failed, errbackArgs=("creating the runs table",))

    def _create(self, txn):
        txn.execute(_SCHEMA)
        if self._file is not None:
            st = os.stat(self._file)
            self._identity = (st.st_dev, st.st_ino)

    def stopService(self):
        super().stopService()
        pool, self.pool = self.pool, None
        if pool is not None:
            # Queued writes run before the pool's thread stops.
            pool.close()
        return defer.succeed(None)

    def record_start(self, run_id, adapter, target="", session_id="", background=False):
        """
        Record that a run started (status C{running}).
        """
        return self._write(
            "INSERT OR REPLACE INTO runs (run_id, adapter, target, session_id, background, status, started_at)"
            " VALUES (?, ?, ?, ?, ?, 'running', ?)",
            (run_id, adapter, target, session_id, int(bool(background)), self.now()),
            "recording the start of run " + run_id,
        )

    def record_end(self, run_id, status, error=None):
        """
        Record a run's terminal status (C{complete}, C{error}, C{cancelled})
        and the error message, if any.
        """
        return self._write(
            "UPDATE runs SET status = ?, ended_at = ?, error = ? WHERE run_id = ?",
            (status, self.now(), error, run_id),
            "recording the end of run " + run_id,
        )

    def recent(self, limit=50):
        """
        @return: a Deferred list of the latest C{limit} runs as dicts,
            newest first.
        """
        if self.pool is None:
            return defer.fail(RuntimeError("the run store is not running"))
        d = self.pool.runQuery(
            f"SELECT {', '.join(_COLUMNS)} FROM runs ORDER BY started_at DESC, rowid DESC LIMIT ?", (limit,)
        )
        d.addCallback(lambda rows: [_row(r) for r in rows])
        return d

    def health(self):
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

    def _write(self, sql, params, what):
        if self.pool is None:
            self.log.warn("run store not running; not {what}", what=what)
            return defer.succeed(None)
        d = self.pool.runInteraction(self._execute, sql, params)
        d.addCallbacks(self._succeeded, self._failed, errbackArgs=(what,))
        return d

    def _execute(self, txn, sql, params):
        """
        In the pool's thread: check that the path still names the file
        opened at start, then write.
        """
        if self._identity is not None:
            try:
                st = os.stat(self._file)
            except FileNotFoundError:
                raise StoreGone(f"the database file {self._file} was deleted") from None
            if (st.st_dev, st.st_ino) != self._identity:
                raise StoreGone(f"the database file {self._file} was replaced")
        txn.execute(sql, params)

    def _succeeded(self, result):
        if self.error is not None:
            self.log.info(
                "run store recovered after {count} failed write(s): {path}", count=self.failures, path=self.path
            )
            self.error = None
            self.failed_since = None
            if self.metrics is not None:
                self.metrics.store_ok(True)
        return None

    def _failed(self, failure, what):
        self.failures += 1
        if self.metrics is not None:
            self.metrics.store_failed()
        if self.error is None:
            self.error = f"{what}: {failure.getErrorMessage() or failure.type.__name__}"
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


def _row(row):
    record = dict(zip(_COLUMNS, row, strict=True))
    record["background"] = bool(record["background"])
    return record


class NullStore:
    """
    A store that records nothing (tests, or a Node with no history).
    """

    def record_start(self, run_id, adapter, target="", session_id="", background=False):
        return defer.succeed(None)

    def record_end(self, run_id, status, error=None):
        return defer.succeed(None)

    def recent(self, limit=50):
        return defer.succeed([])

    def health(self):
        return {"status": "none"}
