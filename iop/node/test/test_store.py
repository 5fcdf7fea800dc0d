"""
The SQLite run store, on a real database file. The adbapi pool runs its
one connection in a thread, so these tests wait on the reactor.
"""

from twisted.internet import defer, reactor
from twisted.python.filepath import FilePath
from twisted.trial.unittest import TestCase

from iop.node.store import RunStore


class RunStoreTests(TestCase):
    def make_store(self, path):
        times = iter(range(1000, 2000))
        store = RunStore(reactor, path, now=lambda: next(times))
        store.startService()
        self.addCleanup(store.stopService)
        return store

    @defer.inlineCallbacks
    def test_records_a_run(self):
        """
        A run is recorded at start (running) and at its terminal, with its
        adapter, target, session, background flag, times and error.
        """
        directory = FilePath(self.mktemp())
        directory.makedirs()
        store = self.make_store(f"file:{directory.child('iop.db').path}?cache=shared&mode=rwc")
        yield store.record_start("r1", "echo", "model-a", "sess-1", True)
        [running] = yield store.recent()
        self.assertEqual(running["status"], "running")
        yield store.record_end("r1", "error", "adapter_error: boom")
        yield store.record_start("r2", "echo")
        rows = yield store.recent(10)
        self.assertEqual([r["run_id"] for r in rows], ["r2", "r1"])
        self.assertEqual(
            rows[1],
            {
                "run_id": "r1",
                "adapter": "echo",
                "target": "model-a",
                "session_id": "sess-1",
                "background": True,
                "status": "error",
                "started_at": 1000,
                "ended_at": 1001,
                "error": "adapter_error: boom",
            },
        )
        self.assertTrue(directory.child("iop.db").exists())

    @defer.inlineCallbacks
    def test_plain_path_and_persistence(self):
        """
        A plain file path works too, and records survive a restart.
        """
        path = FilePath(self.mktemp()).path
        first = RunStore(reactor, path)
        first.startService()
        yield first.record_start("r1", "echo")
        yield first.record_end("r1", "complete")
        yield first.stopService()
        second = self.make_store(path)
        [row] = yield second.recent()
        self.assertEqual((row["run_id"], row["status"]), ("r1", "complete"))

    @defer.inlineCallbacks
    def test_write_failure_logged(self):
        """
        A failing write is logged and its Deferred still succeeds, so the
        relay that made it never sees an error.
        """
        store = self.make_store(FilePath(self.mktemp()).path)
        yield store.record_start("r1", "echo")
        yield store.record_start("r1", None)  # NOT NULL violation
        self.assertEqual(len(self.flushLoggedErrors()), 1)
