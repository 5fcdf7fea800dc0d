"""
A failing run store is never silent (issue 12, "Run store integrity"):
corrupted, unwritable, deleted or replaced, it is logged loudly once,
reported by L{RunStore.health} (hence C{transport_status}) and the Node's
metrics, and work is never failed by it. On real database files, so these
tests wait on the reactor (the adbapi pool runs in a thread).
"""

import os

from twisted.internet import defer, reactor
from twisted.logger import LogLevel, capturedLogs
from twisted.python.filepath import FilePath
from twisted.trial.unittest import SynchronousTestCase, TestCase

from iop.node.context import TransportState
from iop.node.metrics import NodeMetrics
from iop.node.store import NullStore, RunStore, database_file


class StoreHealthTests(TestCase):
    def make_store(self, path, started=True):
        self.metrics = NodeMetrics()
        store = RunStore(reactor, path, metrics=self.metrics)
        if started:
            store.startService()
            self.addCleanup(store.stopService)
        return store

    def failure_lines(self, events):
        return [e for e in events if e.get("log_level") == LogLevel.error and "RUN STORE FAILED" in e["log_format"]]

    @defer.inlineCallbacks
    def test_deleted_file(self):
        """
        A database file deleted under the running store: the next write
        fails (SQLite would write to the unlinked file), logged once as an
        error however many writes follow; health and metrics say so; the
        writes' Deferreds still succeed.
        """
        path = FilePath(self.mktemp()).path
        store = self.make_store(path)
        yield store.record_start("r1", "echo")
        self.assertEqual(store.health()["status"], "ok")
        os.unlink(path)
        with capturedLogs() as events:
            for _ in range(3):
                result = yield store.record_end("r1", "complete")
                self.assertIsNone(result)
        self.assertEqual(len(self.failure_lines(events)), 1)
        self.flushLoggedErrors()
        health = store.health()
        self.assertEqual((health["status"], health["failed_writes"]), ("failed", 3))
        self.assertIn("was deleted", health["error"])
        self.assertEqual(self.metrics.value("iop_node_store_ok"), 0)
        self.assertEqual(self.metrics.value("iop_node_store_failures_total"), 3)

    @defer.inlineCallbacks
    def test_replaced_file(self):
        """
        A database file replaced by another file is a failure too.
        """
        path = FilePath(self.mktemp()).path
        store = self.make_store(path)
        yield store.record_start("r1", "echo")
        os.rename(path, path + ".old")
        with open(path, "wb"):
            pass
        yield store.record_end("r1", "complete")
        self.flushLoggedErrors()
        self.assertIn("was replaced", store.health()["error"])

    @defer.inlineCallbacks
    def test_corrupted_file(self):
        """
        A file that is not an SQLite database fails at start, loudly.
        """
        path = FilePath(self.mktemp()).path
        with open(path, "wb") as f:
            f.write(b"this is not a database" * 100)
        with capturedLogs() as events:
            store = self.make_store(path)
            yield store._ready
            yield store.record_start("r1", "echo")
        self.flushLoggedErrors()
        self.assertEqual(len(self.failure_lines(events)), 1)
        health = store.health()
        self.assertEqual(health["status"], "failed")
        self.assertIn("creating the runs table", health["error"])

    @defer.inlineCallbacks
    def test_unwritable(self):
        """
        A database that cannot be written (opened read-only) fails on the
        first write.
        """
        path = FilePath(self.mktemp()).path
        first = self.make_store(path)
        yield first._ready
        yield first.stopService()
        store = self.make_store(f"file:{path}?mode=ro")
        yield store.record_start("r1", "echo")
        self.flushLoggedErrors()
        self.assertIn("readonly", store.health()["error"])

    @defer.inlineCallbacks
    def test_recovery(self):
        """
        A write that succeeds after failures puts the store back to ok, and
        says so.
        """
        path = FilePath(self.mktemp()).path
        store = self.make_store(path)
        yield store.record_start("r1", "echo")
        yield store.record_start("r1", None)  # NOT NULL: fails
        self.flushLoggedErrors()
        self.assertEqual(store.health()["status"], "failed")
        with capturedLogs() as events:
            yield store.record_end("r1", "complete")
        self.assertEqual(store.health()["status"], "ok")
        self.assertEqual(self.metrics.value("iop_node_store_ok"), 1)
        self.assertTrue(any("recovered" in e["log_format"] for e in events))


class ReportTests(SynchronousTestCase):
    def test_transport_status_reports_the_store(self):
        """
        C{transport_status} (the transport snapshot) carries the store's
        health; a Node without a store says so.
        """
        state = TransportState(store=RunStore(reactor, "file:x.db?mode=rwc"))
        self.assertEqual(state.snapshot()["store"]["status"], "stopped")
        self.assertEqual(TransportState(store=NullStore()).snapshot()["store"], {"status": "none"})
        self.assertEqual(TransportState().snapshot()["store"], {"status": "none"})

    def test_database_file(self):
        """
        The file a store path names; none for in-memory databases.
        """
        self.assertEqual(database_file("file:iop.db?cache=shared&mode=rwc"), "iop.db")
        self.assertEqual(database_file("file:/var/lib/iop/a%20b.db"), "/var/lib/iop/a b.db")
        self.assertEqual(database_file("/tmp/x.db"), "/tmp/x.db")
        self.assertIsNone(database_file(":memory:"))
        self.assertIsNone(database_file("file:mem?mode=memory&cache=shared"))
