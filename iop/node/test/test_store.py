"""
The SQLite run store, on a real database file. The adbapi pool runs its
one connection in a thread, so these tests wait on the reactor.
"""

import os
import sqlite3

from twisted.internet import defer, reactor
from twisted.logger import capturedLogs
from twisted.python.filepath import FilePath
from twisted.trial.unittest import TestCase

from iop.node import store as store_module
from iop.node.store import Retention, RunStore, stored_event
from iop.run import (
    COMPLETE,
    DELTA,
    ERROR,
    REASONING_DELTA,
    START,
    TOOL_CALL,
    RunEventData,
    RunFailure,
    ToolCall,
    Usage,
)


class Ticks:
    """
    A wall clock that moves one second per reading.
    """

    def __init__(self, start=1000):
        self.now = start

    def __call__(self):
        self.now += 1
        return self.now


class RunStoreTests(TestCase):
    def make_store(self, path, **kwargs):
        kwargs.setdefault("now", Ticks())
        kwargs.setdefault("prune_interval", 0)
        store = RunStore(reactor, path, **kwargs)
        store.startService()
        self.addCleanup(store.stopService)
        return store

    def path(self):
        return FilePath(self.mktemp()).path

    @defer.inlineCallbacks
    def test_records_a_run(self):
        """
        A run is recorded at start (running) and at its terminal, with its
        adapter, target, session, background flag, caller key, times, error
        and usage.
        """
        directory = FilePath(self.mktemp())
        directory.makedirs()
        store = self.make_store(f"file:{directory.child('iop.db').path}?cache=shared&mode=rwc")
        yield store.record_start("r1", "echo", "model-a", "sess-1", True, "team-a")
        [running] = yield store.recent()
        self.assertEqual(running["status"], "running")
        yield store.record_end("r1", "error", "boom", "adapter_error", Usage(3, 4, reasoning_tokens=1))
        yield store.record_start("r2", "echo")
        rows = yield store.recent(10)
        self.assertEqual([r["run_id"] for r in rows], ["r2", "r1"])
        self.assertEqual(
            rows[1],
            {
                "run_id": "r1",
                "kind": "run",
                "adapter": "echo",
                "target": "model-a",
                "session_id": "sess-1",
                "background": True,
                "status": "error",
                "started_at": 1002,
                "ended_at": 1003,
                "error": "boom",
                "error_code": "adapter_error",
                "usage": {"input_tokens": 3, "output_tokens": 4, "reasoning_tokens": 1},
                "bytes": None,
                "caller": "team-a",
            },
        )
        self.assertTrue(directory.child("iop.db").exists())

    @defer.inlineCallbacks
    def test_events_and_output(self):
        """
        Every event of a run is kept under its seq: C{get} gives the run
        with its whole output and the events after a given seq, in order.
        """
        store = self.make_store(self.path())
        store.record_start("r1", "echo")
        store.record_event("r1", 1, RunEventData(START))
        store.record_event("r1", 2, RunEventData(DELTA, text="one "))
        store.record_event("r1", 3, RunEventData(DELTA, text="two"))
        store.record_event("r1", 4, RunEventData(COMPLETE, usage=Usage(1, 2)))
        store.record_end("r1", COMPLETE, usage=Usage(1, 2))
        whole = yield store.get("r1")
        self.assertEqual(whole["run"]["output"], "one two")
        self.assertEqual([e["seq"] for e in whole["events"]], [1, 2, 3, 4])
        self.assertEqual(
            whole["events"][-1], {"seq": 4, "type": "complete", "usage": {"input_tokens": 1, "output_tokens": 2}}
        )
        rest = yield store.get("r1", after=2)
        self.assertEqual([(e["seq"], e.get("text")) for e in rest["events"]], [(3, "two"), (4, None)])
        self.assertIsNone((yield store.get("nope")))

    @defer.inlineCallbacks
    def test_error_event(self):
        """
        An error terminal keeps its code and message.
        """
        store = self.make_store(self.path())
        store.record_start("r1", "echo")
        store.record_event("r1", 1, RunEventData(ERROR, error=RunFailure("provider_error", "it broke")))
        got = yield store.get("r1")
        self.assertEqual(
            got["events"], [{"seq": 1, "type": "error", "error": {"code": "provider_error", "message": "it broke"}}]
        )

    @defer.inlineCallbacks
    def test_tunnels_and_filters(self):
        """
        Tunnels are recorded like runs (kind tunnel, usage, body bytes);
        the list filters by status and kind.
        """
        store = self.make_store(self.path())
        store.record_start("r1", "echo")
        store.record_tunnel_start("t1", "llm", "big-v2")
        store.record_tunnel_end("t1", "complete", usage=Usage(5, 6), size=1234)
        store.record_tunnel_start("t2", "llm")
        yield store.record_tunnel_end("t2", "cancelled", "the caller left", "cancelled", size=10)
        [tunnel] = yield store.list_runs(status="complete")
        self.assertEqual(
            {k: tunnel[k] for k in ("run_id", "kind", "adapter", "target", "status", "usage", "bytes")},
            {
                "run_id": "t1",
                "kind": "tunnel",
                "adapter": "llm",
                "target": "big-v2",
                "status": "complete",
                "usage": {"input_tokens": 5, "output_tokens": 6},
                "bytes": 1234,
            },
        )
        self.assertEqual([r["run_id"] for r in (yield store.list_runs(kind="tunnel"))], ["t2", "t1"])
        self.assertEqual([r["run_id"] for r in (yield store.list_runs(kind="run"))], ["r1"])
        self.assertEqual(len((yield store.list_runs(limit=2))), 2)

    @defer.inlineCallbacks
    def test_caller_filter(self):
        """
        Runs and tunnels keep the name of the caller key they belong to, and
        the list filters by it; work recorded without one belongs to no key.
        """
        store = self.make_store(self.path())
        store.record_start("a1", "echo", caller="team-a")
        store.record_tunnel_start("a2", "llm", caller="team-a")
        store.record_start("b1", "echo", caller="team-b")
        yield store.record_start("x1", "echo")
        mine = yield store.list_runs(caller="team-a")
        self.assertEqual([(r["run_id"], r["caller"]) for r in mine], [("a2", "team-a"), ("a1", "team-a")])
        self.assertEqual([r["run_id"] for r in (yield store.list_runs(caller="team-b"))], ["b1"])
        self.assertIsNone((yield store.get("x1"))["run"]["caller"])

    @defer.inlineCallbacks
    def test_batched(self):
        """
        Writes wait in memory and go to the database together: many
        records are one interaction with the database thread, not one
        each.
        """
        store = self.make_store(self.path(), flush_interval=60)
        yield store._ready
        interactions = []
        real = store.pool.runInteraction

        def counted(*a, **k):
            interactions.append(a[0])
            return real(*a, **k)

        self.patch(store.pool, "runInteraction", counted)
        store.record_start("r1", "echo")
        for seq in range(1, 201):
            store.record_event("r1", seq, RunEventData(DELTA, text="x"))
        self.assertEqual(interactions, [])
        got = yield store.get("r1")
        self.assertEqual(len(got["events"]), 200)
        self.assertEqual(len(interactions), 2)  # the batch, then the read

    @defer.inlineCallbacks
    def test_one_row_per_run_per_batch(self):
        """
        The events of one run queued in one batch are one row of
        event_batches, whatever else the batch holds; the next batch adds
        one more. Every kind of event reads back as it was recorded.
        """
        store = self.make_store(self.path(), flush_interval=60)
        for run_id in ("r1", "r2"):
            store.record_start(run_id, "echo")
        for seq in range(1, 4):
            for run_id in ("r1", "r2"):
                store.record_event(run_id, seq, RunEventData(DELTA, text=f"{run_id}.{seq} "))
        store.record_end("r2", COMPLETE)
        yield store.flush()
        call = ToolCall("call-1", "lookup", '{"q": "ß"}')
        store.record_event("r1", 4, RunEventData(TOOL_CALL, tool_call=call))
        store.record_event("r1", 5, RunEventData(REASONING_DELTA, text="hmm"))
        failure = RunFailure("provider_error", "slow down", 429)
        store.record_event("r1", 6, RunEventData(ERROR, usage=Usage(1, 2), error=failure, finish_reason="stop"))
        yield store.flush()
        rows = yield store.pool.runQuery("SELECT run_id, first_seq, last_seq FROM event_batches ORDER BY rowid")
        self.assertEqual(rows, [("r1", 1, 3), ("r2", 1, 3), ("r1", 4, 6)])
        got = yield store.get("r1", after=2)
        self.assertEqual(got["run"]["output"], "r1.1 r1.2 r1.3 ")
        self.assertEqual(
            got["events"],
            [
                {"seq": 3, "type": "delta", "text": "r1.3 "},
                {
                    "seq": 4,
                    "type": "tool_call",
                    "tool_call": {"id": "call-1", "name": "lookup", "arguments": '{"q": "ß"}'},
                },
                {"seq": 5, "type": "reasoning_delta", "text": "hmm"},
                {
                    "seq": 6,
                    "type": "error",
                    "finish_reason": "stop",
                    "usage": {"input_tokens": 1, "output_tokens": 2},
                    "error": {"code": "provider_error", "message": "slow down", "status": 429},
                },
            ],
        )
        self.assertEqual(stored_event(got["events"][1]), RunEventData(TOOL_CALL, tool_call=call))
        self.assertEqual((yield store.get("r2"))["run"]["status"], COMPLETE)

    @defer.inlineCallbacks
    def test_older_event_rows(self):
        """
        Events an older Node wrote one row each (table events) read back
        with those written since, in seq order, in the output too; a seq
        written more than once reads as its latest write.
        """
        path = self.path()
        first = self.make_store(path)
        yield first.record_start("r1", "echo")
        yield first.stopService()
        with sqlite3.connect(path) as db:
            db.executemany(
                "INSERT INTO events (run_id, seq, type, text, usage, error, finish_reason, tool_call)"
                " VALUES ('r1', ?, ?, ?, NULL, NULL, NULL, NULL)",
                [(1, "start", ""), (2, "delta", "old-2 "), (3, "delta", "old-3 "), (5, "delta", "old-5 ")],
            )
        store = self.make_store(path)
        store.record_event("r1", 4, RunEventData(DELTA, text="new-4 "))
        store.record_event("r1", 3, RunEventData(DELTA, text="new-3 "))
        yield store.flush()
        store.record_event("r1", 6, RunEventData(DELTA, text="new-6 "))
        store.record_event("r1", 4, RunEventData(DELTA, text="newer-4 "))
        got = yield store.get("r1")
        self.assertEqual(got["run"]["output"], "old-2 new-3 newer-4 old-5 new-6 ")
        self.assertEqual([e["seq"] for e in got["events"]], [1, 2, 3, 4, 5, 6])
        self.assertEqual(got["events"][0], {"seq": 1, "type": "start"})
        rest = yield store.get("r1", after=4)
        self.assertEqual([e["text"] for e in rest["events"]], ["old-5 ", "new-6 "])

    @defer.inlineCallbacks
    def test_prune_both_tables(self):
        """
        A pruned run's events go from both tables: the rows of an older
        Node and the batches.
        """
        path = self.path()
        store = self.make_store(path, retention=Retention(max_age_days=None, max_rows=1))
        for run_id in ("a", "b"):
            store.record_start(run_id, "echo")
            store.record_event(run_id, 2, RunEventData(DELTA, text="x"))
            store.record_end(run_id, "complete")
        yield store.flush()
        with sqlite3.connect(path) as db:
            db.execute(
                "INSERT INTO events (run_id, seq, type, text) VALUES ('a', 1, 'start', ''), ('b', 1, 'start', '')"
            )
        self.assertEqual((yield store.prune()), 1)
        for table in ("events", "event_batches"):
            rows = yield store.pool.runQuery(f"SELECT DISTINCT run_id FROM {table}")
            self.assertEqual(rows, [("b",)])

    @defer.inlineCallbacks
    def test_batch_size_counts_events(self):
        """
        Events count toward the batch's size limit one each, though a
        run's are one row.
        """
        store = self.make_store(self.path(), flush_interval=60, batch_max=10)
        yield store._ready
        for seq in range(1, 11):
            store.record_event("r1", seq, RunEventData(DELTA, text="x"))
        self.assertEqual(store._pending, [])
        yield store.flush()
        rows = yield store.pool.runQuery("SELECT COUNT(*) FROM event_batches")
        self.assertEqual(rows, [(1,)])

    @defer.inlineCallbacks
    def test_batch_size_flushes(self):
        """
        A batch that reaches its size limit is written without waiting for
        the interval.
        """
        store = self.make_store(self.path(), flush_interval=60, batch_max=10)
        for i in range(10):
            d = store.record_start(f"r{i}", "echo")
        yield d
        self.assertEqual(store._pending, [])

    @defer.inlineCallbacks
    def test_wal(self):
        """
        The database is in WAL mode, so readers never wait for the writer.
        """
        path = self.path()
        store = self.make_store(path)
        yield store.record_start("r1", "echo")
        with sqlite3.connect(path) as db:
            self.assertEqual(db.execute("PRAGMA journal_mode").fetchone()[0], "wal")

    @defer.inlineCallbacks
    def test_persistence_and_restart(self):
        """
        Records survive a restart; a run left running by the previous
        process (killed) is marked error with the code node_restarted at
        the next start, and finished ones are left alone.
        """
        path = self.path()
        first = RunStore(reactor, path, prune_interval=0)
        first.startService()
        first.record_start("r1", "echo")
        first.record_end("r1", "complete")
        yield first.record_start("r2", "echo", background=True)
        yield first.stopService()
        second = self.make_store(path)
        yield second._ready
        self.assertEqual(second.restarted, 1)
        rows = {r["run_id"]: r for r in (yield second.recent())}
        self.assertEqual(rows["r1"]["status"], "complete")
        self.assertEqual((rows["r2"]["status"], rows["r2"]["error_code"]), ("error", "node_restarted"))
        self.assertIsNotNone(rows["r2"]["ended_at"])

    @defer.inlineCallbacks
    def test_restarted_run_ends_its_events(self):
        """
        A run left running by a killed process also gets its terminal in
        its events at the next start — an C{error} coded C{node_restarted}
        after the last event it had — so that a reader replaying them sees
        it end; one whose terminal was written already, and a tunnel, get
        none.
        """
        path = self.path()
        first = RunStore(reactor, path, prune_interval=0)
        first.startService()
        first.record_start("r1", "echo")
        first.record_event("r1", 1, RunEventData(START))
        first.record_event("r1", 2, RunEventData(DELTA, text="half an answer"))
        first.record_start("r2", "echo")
        first.record_event("r2", 1, RunEventData(START))
        first.record_event("r2", 2, RunEventData(COMPLETE))
        first.record_start("r3", "echo")
        first.record_tunnel_start("t1", "llm")
        yield first.stopService()
        second = self.make_store(path)
        yield second._ready
        self.assertEqual(second.restarted, 4)
        r1 = yield second.get("r1")
        self.assertEqual(r1["run"]["status"], "error")
        self.assertEqual(
            r1["events"][-1],
            {
                "seq": 3,
                "type": "error",
                "error": {"code": "node_restarted", "message": "the node restarted while this ran"},
            },
        )
        self.assertEqual(r1["run"]["output"], "half an answer")
        r2 = yield second.get("r2")
        self.assertEqual([(e["seq"], e["type"]) for e in r2["events"]], [(1, "start"), (2, "complete")])
        r3 = yield second.get("r3")
        self.assertEqual(
            [(e["seq"], e["type"], e["error"]["code"]) for e in r3["events"]], [(1, "error", "node_restarted")]
        )
        t1 = yield second.get("t1")
        self.assertEqual(t1["events"], [])
        yield second.stopService()
        third = self.make_store(path)
        yield third._ready
        self.assertEqual(third.restarted, 0)
        self.assertEqual(len((yield third.get("r1"))["events"]), 3)

    @defer.inlineCallbacks
    def test_restarted_run_with_older_event_rows(self):
        """
        The terminal a restarted run gets follows its last event in either
        table: the rows of an older Node count too.
        """
        path = self.path()
        first = self.make_store(path)
        first.record_start("r1", "echo")
        yield first.stopService()
        with sqlite3.connect(path) as db:
            db.executemany(
                "INSERT INTO events (run_id, seq, type, text) VALUES ('r1', ?, ?, ?)",
                [(1, "start", ""), (2, "delta", "old ")],
            )
        store = self.make_store(path)
        yield store._ready
        got = yield store.get("r1")
        self.assertEqual([(e["seq"], e["type"]) for e in got["events"]], [(1, "start"), (2, "delta"), (3, "error")])

    @defer.inlineCallbacks
    def test_older_database(self):
        """
        A database written by an older Node (no kind, error_code, usage,
        bytes or caller columns, no events table) is upgraded in place at
        start; its rows belong to no caller key.
        """
        path = self.path()
        with sqlite3.connect(path) as db:
            db.execute(
                "CREATE TABLE runs (run_id TEXT PRIMARY KEY, adapter TEXT NOT NULL, target TEXT NOT NULL,"
                " session_id TEXT NOT NULL, background INTEGER NOT NULL, status TEXT NOT NULL,"
                " started_at REAL NOT NULL, ended_at REAL, error TEXT)"
            )
            db.execute("INSERT INTO runs VALUES ('old', 'echo', '', '', 0, 'complete', 5, 6, NULL)")
        store = self.make_store(path)
        [row] = yield store.recent()
        self.assertEqual((row["run_id"], row["kind"], row["status"], row["caller"]), ("old", "run", "complete", None))
        yield store.record_tunnel_start("t1", "llm", caller="team-a")
        self.assertEqual(len((yield store.recent())), 2)
        self.assertEqual([r["run_id"] for r in (yield store.list_runs(caller="team-a"))], ["t1"])

    @defer.inlineCallbacks
    def test_prune_rows(self):
        """
        Beyond max_rows the oldest finished runs go, with their events;
        a run still in progress is never pruned.
        """
        store = self.make_store(self.path(), retention=Retention(max_age_days=None, max_rows=2))
        store.record_start("running", "echo")
        for run_id in ("a", "b", "c"):
            store.record_start(run_id, "echo")
            store.record_event(run_id, 1, RunEventData(START))
            store.record_end(run_id, "complete")
        yield store.flush()
        self.assertEqual((yield store.prune()), 2)
        self.assertEqual(sorted(r["run_id"] for r in (yield store.recent())), ["c", "running"])
        self.assertEqual((yield store.get("a")), None)
        yield store.pool.runQuery("SELECT 1")
        rows = yield store.pool.runQuery("SELECT DISTINCT run_id FROM event_batches")
        self.assertEqual(rows, [("c",)])

    @defer.inlineCallbacks
    def test_prune_a_chunk_per_transaction(self):
        """
        A large prune deletes PRUNE_CHUNK runs per transaction (a write
        queued meanwhile goes between two of them), oldest first, and as
        many as are past the retention in all.
        """
        self.patch(store_module, "PRUNE_CHUNK", 3)
        store = self.make_store(self.path(), retention=Retention(max_age_days=None, max_rows=2))
        for i in range(10):
            store.record_start(f"r{i}", "echo")
            store.record_end(f"r{i}", "complete")
        yield store.flush()
        transactions = []
        real = store.pool.runInteraction

        def counted(f, *args, **kwargs):
            transactions.append(f.__name__)
            return real(f, *args, **kwargs)

        self.patch(store.pool, "runInteraction", counted)
        self.assertEqual((yield store.prune()), 8)
        self.assertEqual(transactions.count("_prune"), 3)
        self.assertEqual(sorted(r["run_id"] for r in (yield store.recent())), ["r8", "r9"])

    @defer.inlineCallbacks
    def test_prune_age(self):
        """
        Finished runs older than max_age_days go; newer ones stay.
        """
        clock = Ticks(start=0)
        store = self.make_store(self.path(), now=clock, retention=Retention(max_age_days=1, max_rows=None))
        store.record_start("old", "echo")
        store.record_end("old", "complete")
        clock.now = 2 * 86400
        store.record_start("new", "echo")
        store.record_end("new", "complete")
        yield store.flush()
        self.assertEqual((yield store.prune()), 1)
        self.assertEqual([r["run_id"] for r in (yield store.recent())], ["new"])

    @defer.inlineCallbacks
    def test_write_failure_logged(self):
        """
        A failing write is logged and its Deferred still succeeds, so the
        relay that made it never sees an error; the rest of its batch is
        written.
        """
        store = self.make_store(self.path())
        store.record_start("r1", "echo")
        store.record_start("r1", None)  # NOT NULL violation
        yield store.record_start("r2", "echo")
        self.assertEqual(len(self.flushLoggedErrors(sqlite3.IntegrityError)), 1)
        self.assertEqual(sorted(r["run_id"] for r in (yield store.recent())), ["r1", "r2"])

    @defer.inlineCallbacks
    def test_event_write_failure_logged(self):
        """
        A run's events that cannot be written are reported like a failing
        statement, counted one failed write each; the other runs' events
        and the rest of the batch are written.
        """
        store = self.make_store(self.path())
        store.record_start("r1", "echo")
        store.record_event("r1", 1, RunEventData(START))
        store.record_event(None, 1, RunEventData(START))  # NOT NULL violation
        store.record_event(None, 2, RunEventData(DELTA, text="x"))
        store.record_event("r1", 2, RunEventData(DELTA, text="y"))
        with capturedLogs() as logged:
            yield store.record_end("r1", COMPLETE)
        self.assertEqual(len(self.flushLoggedErrors(sqlite3.IntegrityError)), 1)
        [failed] = [e for e in logged if "RUN STORE FAILED" in e["log_format"]]
        self.assertEqual(failed["what"], "recording 2 event(s) of run None")
        self.assertEqual(store.health()["failed_writes"], 2)
        got = yield store.get("r1")
        self.assertEqual((got["run"]["status"], got["run"]["output"]), (COMPLETE, "y"))

    @defer.inlineCallbacks
    def test_failing_batch_counts_events(self):
        """
        A batch that cannot be written at all (its file was deleted) is
        reported as one failure of all its records, each event one.
        """
        path = self.path()
        store = self.make_store(path)
        yield store.record_start("r1", "echo")
        os.unlink(path)
        for seq in range(1, 4):
            store.record_event("r1", seq, RunEventData(DELTA, text="x"))
        yield store.record_end("r1", COMPLETE)
        self.flushLoggedErrors()
        health = store.health()
        self.assertEqual(health["failed_writes"], 4)
        self.assertIn("writing 4 record(s): the database file", health["error"])

    @defer.inlineCallbacks
    def test_locked_database_fails_the_batch_once(self):
        """
        A database another process holds locked fails a batch at its first
        statement: the rest of the batch is not tried (each would wait out
        SQLite's busy timeout again, holding the store's one thread for
        the timeout times the size of the batch), and the batch is reported
        as one failure of all its records. Once the lock is gone the next
        batch is written.
        """
        path = self.path()
        store = self.make_store(path, flush_interval=60)
        yield store._ready
        yield store.pool.runOperation("PRAGMA busy_timeout = 0")
        tried = []
        real = store._write_batch

        class Counted:
            def __init__(self, txn):
                self.txn = txn

            def execute(self, *args):
                tried.append(args[0])
                return self.txn.execute(*args)

        self.patch(store, "_write_batch", lambda txn, batch: real(Counted(txn), batch))
        holder = sqlite3.connect(path, timeout=0, isolation_level=None)
        self.addCleanup(holder.close)
        holder.execute("BEGIN IMMEDIATE")
        for i in range(3):
            store.record_start(f"r{i}", "echo")
        store.record_event("r0", 1, RunEventData(START))
        yield store.flush()
        self.flushLoggedErrors(sqlite3.OperationalError)
        self.assertEqual(len(tried), 1)
        health = store.health()
        self.assertEqual(health["failed_writes"], 4)
        self.assertIn("writing 4 record(s): database is locked", health["error"])
        holder.execute("ROLLBACK")
        store.record_start("r9", "echo")
        yield store.flush()
        self.assertEqual([r["run_id"] for r in (yield store.recent())], ["r9"])
        self.assertEqual(store.health()["status"], "ok")

    @defer.inlineCallbacks
    def test_one_batch_at_a_time(self):
        """
        While a batch is being written (a slow or locked database), what is
        recorded meanwhile waits in memory and goes in the next batch, as
        one: the store's thread never holds a queue of batches (each one
        more for a read to wait behind), and nothing is lost or reordered.
        """
        store = self.make_store(self.path(), flush_interval=60, batch_max=10)
        yield store._ready
        slow: defer.Deferred[None] = defer.Deferred()
        batches = []
        real = store.pool.runInteraction

        def held(f, *args, **kwargs):
            if getattr(f, "__name__", "") != "_write_batch":
                return real(f, *args, **kwargs)
            batches.append(sum(len(q.events) if hasattr(q, "events") else 1 for q in args[0]))
            if len(batches) == 1:
                return slow.addCallback(lambda _: real(f, *args, **kwargs))
            return real(f, *args, **kwargs)

        self.patch(store.pool, "runInteraction", held)
        store.record_start("r1", "echo")
        for seq in range(1, 51):
            store.record_event("r1", seq, RunEventData(DELTA, text=f"{seq} "))
        self.assertEqual(batches, [10])
        read = store.get("r1")
        self.assertEqual(batches, [10])
        slow.callback(None)
        got = yield read
        self.assertEqual(batches, [10, 41])
        self.assertEqual([e["seq"] for e in got["events"]], list(range(1, 51)))
        self.assertEqual(got["run"]["output"], "".join(f"{seq} " for seq in range(1, 51)))

    @defer.inlineCallbacks
    def test_stop_writes_what_comes_during_its_flush(self):
        """
        A record made while the stopping store writes its last batch (a run
        whose cancel ends a moment later) is written too before the
        database closes, and its Deferred fires.
        """
        path = self.path()
        store = RunStore(reactor, path, prune_interval=0)
        store.startService()
        yield store.record_start("r1", "echo")
        stopping = store.stopService()
        store.record_event("r1", 1, RunEventData(START))
        ended = store.record_end("r1", COMPLETE)
        yield stopping
        self.assertTrue(ended.called)
        with sqlite3.connect(path) as db:
            self.assertEqual(db.execute("SELECT status FROM runs").fetchall(), [(COMPLETE,)])
            self.assertEqual(db.execute("SELECT first_seq FROM event_batches").fetchall(), [(1,)])
