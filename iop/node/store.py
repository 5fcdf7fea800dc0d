"""
The Node's local run history in SQLite.

It is a local record for the operator of this machine (what ran, when, how
it ended), not a global audit API. SQLite wants one connection on one
thread, so the store owns a one-connection C{adbapi} pool, started and
closed with the service. Writes are fire-and-forget: a failing write is
logged and never delays or breaks the relay of a run.
"""

import time

from twisted.application.service import Service
from twisted.enterprise import adbapi
from twisted.internet import defer
from twisted.logger import Logger

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


class RunStore(Service):
    """
    @param path: an SQLite path, or a C{file:} URI (C{file:iop.db?mode=rwc}).
    @param now: wall-clock time source (seconds since the epoch).
    """

    log = Logger()

    def __init__(self, reactor, path, now=time.time):
        self.reactor = reactor
        self.path = path
        self.now = now
        self.pool = None
        self._ready = None

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
        self._ready = self.pool.runOperation(_SCHEMA)
        self._ready.addErrback(self._logged, "creating the runs table")

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

    def _write(self, sql, params, what):
        if self.pool is None:
            self.log.warn("run store not running; not {what}", what=what)
            return defer.succeed(None)
        d = self.pool.runOperation(sql, params)
        d.addErrback(self._logged, what)
        return d

    def _logged(self, failure, what):
        self.log.failure("run store failed {what}", failure, what=what)


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
