"""
Logical sessions belong to the caller key whose run first used them
(docs/edge.md, "Isolation"): the owner map's rules, a Node refusing
another key's run on a session and answering another key's terminate as
for an unknown session, and the owners read back from a real run store
after a restart, before the Node takes any work.
"""

from twisted.internet import defer, reactor
from twisted.python.filepath import FilePath
from twisted.trial.unittest import SynchronousTestCase, TestCase

from iop.node.owners import SessionOwners
from iop.node.store import RunStore
from iop.protocols import messages
from iop.run import CAPACITY_EXCEEDED, COMPLETE, ERROR, SESSION_OWNED
from iop.testing.node import (
    FakeEdge,
    accepted,
    adapter_config,
    connect,
    hosted,
    make_context,
    manual,
    node_config,
    ready_node,
    run_request,
)

#: A manual adapter that keeps sessions (it knows session C{s1}), and one
#: that keeps none.
SESSIONS = adapter_config("manual", max_concurrency=3, sessions=True)
PLAIN = adapter_config("plain", type="plain")


class SessionOwnersTests(SynchronousTestCase):
    def test_first_caller_owns(self):
        """
        The first caller to use a session owns it: it may use it again,
        another caller may not; sessions of one id on two adapters are
        two sessions.
        """
        owners = SessionOwners()
        self.assertTrue(owners.claim("cli", "s1", "alice"))
        self.assertTrue(owners.claim("cli", "s1", "alice"))
        self.assertFalse(owners.claim("cli", "s1", "bob"))
        self.assertTrue(owners.claim("other", "s1", "bob"))
        self.assertFalse(owners.claim("other", "s1", "alice"))

    def test_empty_caller_neither_claims_nor_is_refused(self):
        """
        A run without a caller (from an older Edge) may use any session
        and leaves a free one free.
        """
        owners = SessionOwners()
        self.assertTrue(owners.claim("cli", "s1", ""))
        self.assertTrue(owners.claim("cli", "s1", "bob"))
        self.assertTrue(owners.claim("cli", "s1", ""))
        self.assertFalse(owners.claim("cli", "s1", "alice"))

    def test_who_may_end_a_session(self):
        """
        A caller may end its own session only; an empty caller (an admin
        key) any, known or not; a session nobody owns, no caller.
        """
        owners = SessionOwners()
        owners.claim("cli", "s1", "alice")
        self.assertTrue(owners.owned_by("cli", "s1", "alice"))
        self.assertFalse(owners.owned_by("cli", "s1", "bob"))
        self.assertTrue(owners.owned_by("cli", "s1", ""))
        self.assertFalse(owners.owned_by("cli", "ghost", "alice"))
        self.assertTrue(owners.owned_by("cli", "ghost", ""))

    def test_load(self):
        """
        The stored uses fill the map, the first use of a session naming
        its owner; L{SessionOwners.loaded} fires only once they are in,
        and at once when nothing is loading.
        """
        owners = SessionOwners()
        self.successResultOf(owners.loaded())
        uses: defer.Deferred[list[tuple[str, str, str]]] = defer.Deferred()
        owners.load(uses)
        waiting = owners.loaded()
        self.assertNoResult(waiting)
        uses.callback([("cli", "s1", "alice"), ("cli", "s1", "bob"), ("cli", "s2", "bob")])
        self.successResultOf(waiting)
        self.successResultOf(owners.loaded())
        self.assertFalse(owners.claim("cli", "s1", "bob"))
        self.assertFalse(owners.claim("cli", "s2", "alice"))

    def test_failed_load(self):
        """
        A store that cannot answer is logged, and the Node still becomes
        able to take work (with the sessions used from then on).
        """
        owners = SessionOwners()
        uses: defer.Deferred[list[tuple[str, str, str]]] = defer.Deferred()
        owners.load(uses)
        waiting = owners.loaded()
        uses.errback(RuntimeError("disk gone"))
        self.successResultOf(waiting)
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)
        self.assertTrue(owners.claim("cli", "s1", "alice"))


class SessionRunTests(SynchronousTestCase):
    def setUp(self):
        self.session, self.edge, self.pump, self.context = ready_node(SESSIONS, PLAIN)
        self.adapter = manual(self.context.host, "manual")

    def start(self, run_id, caller, session_id="s1", adapter="manual"):
        self.edge.connection.send(run_request(run_id, adapter=adapter, session_id=session_id, caller=caller))
        self.pump.flush()
        return [e for e in self.edge.of("run_event") if e.run_id == run_id]

    def test_another_callers_run_is_refused(self):
        """
        Bob's run on Alice's session ends with one C{session_owned} error,
        and the adapter never sees it (it would resume her
        conversation); its capacity slot is free again.
        """
        self.start("r1", "alice")
        events = self.start("r2", "bob")
        self.assertEqual([(e.seq, e.type, e.error.code) for e in events], [(1, ERROR, SESSION_OWNED)])
        self.assertNotIn("alice", events[0].error.message)
        self.assertEqual([run.run_id for run, _, _ in self.adapter.runs], ["r1"])
        self.assertEqual(hosted(self.context.host, "manual").gate.in_use, 1)

    def test_owner_and_older_edges_go_on(self):
        """
        Alice's own second run and a run without a caller (an older Edge)
        reach the adapter; so does a run on a session of an adapter that
        keeps none.
        """
        self.start("r1", "alice")
        self.assertEqual(self.start("r2", "alice"), [])
        self.assertEqual(self.start("r3", ""), [])
        self.assertEqual([run.run_id for run, _, _ in self.adapter.runs], ["r1", "r2", "r3"])
        plain = self.start("p1", "alice", adapter="plain") + self.start("p2", "bob", adapter="plain")
        self.assertEqual(
            [(e.run_id, e.type) for e in plain if e.type in (COMPLETE, ERROR)], [("p1", COMPLETE), ("p2", COMPLETE)]
        )

    def test_refused_run_claims_nothing(self):
        """
        A run the Node refuses before its adapter saw it (here: the
        adapter is full) does not make the session its caller's.
        """
        for run_id in ("a", "b", "c"):
            self.start(run_id, "alice", session_id=run_id)
        events = self.start("r4", "bob", session_id="s9")
        self.assertEqual(events[0].error.code, CAPACITY_EXCEEDED)
        self.assertTrue(self.context.owners.claim("manual", "s9", "carol"))


class TerminateTests(SynchronousTestCase):
    def setUp(self):
        self.session, self.edge, self.pump, self.context = ready_node(SESSIONS, PLAIN)
        self.adapter = manual(self.context.host, "manual")
        self.edge.connection.send(run_request("r1", session_id="s1", caller="alice"))
        self.pump.flush()

    def terminate(self, caller, session_id="s1", adapter="manual"):
        self.edge.connection.send(messages.terminate_session("q", adapter, "t", session_id, caller))
        self.pump.flush()
        [response] = self.edge.of("cancel_response")
        self.edge.received.clear()
        return response

    def test_another_callers_terminate_is_unknown(self):
        """
        Bob's terminate of Alice's session is answered exactly as one of a
        session that does not exist; the adapter is not asked and Alice's
        run goes on.
        """
        theirs = self.terminate("bob")
        self.assertEqual(self.adapter.terminated, [])
        self.assertEqual(self.adapter.cancelled, [])
        self.assertIn("r1", self.session.inflight)
        ghost = self.terminate("", session_id="ghost")
        self.assertEqual((theirs.ok, theirs.code), (False, "unknown_session"))
        self.assertEqual((theirs.code, theirs.reason.replace("'s1'", "'ghost'")), (ghost.code, ghost.reason))

    def test_owner_and_admin_may_terminate(self):
        """
        Alice ends her session; an admin key (no caller) ends any; the
        session stays hers afterwards.
        """
        self.assertTrue(self.terminate("alice").ok)
        self.adapter.sessions.add("s1")
        self.assertTrue(self.terminate("").ok)
        self.assertEqual(self.adapter.terminated, [("t", "s1"), ("t", "s1")])
        self.assertFalse(self.context.owners.claim("manual", "s1", "bob"))

    def test_adapter_without_sessions_still_says_so(self):
        """
        A caller's terminate on an adapter that keeps no sessions is still
        "not supported", not an unknown session.
        """
        self.assertEqual(self.terminate("bob", adapter="plain").code, "not_supported")


class ReadyWaitsTests(SynchronousTestCase):
    def test_ready_waits_for_the_owners(self):
        """
        The Node does not say it is ready (so the Edge sends no work)
        until the owners are loaded; then another key's run on a stored
        session is refused.
        """
        context = make_context()
        uses: defer.Deferred[list[tuple[str, str, str]]] = defer.Deferred()
        context.owners.load(uses)
        edge = FakeEdge(accepted(node_config(SESSIONS)), messages.ready_response(True))
        session, pump = connect(context, edge)
        pump.flush()
        self.assertEqual(edge.of("node_ready_request"), [])
        self.assertNoResult(session.ready)
        uses.callback([("manual", "s1", "alice")])
        pump.flush()
        self.successResultOf(session.ready)
        edge.connection.send(run_request("r1", session_id="s1", caller="bob"))
        pump.flush()
        [event] = edge.of("run_event")
        self.assertEqual(event.error.code, SESSION_OWNED)


class RestartTests(TestCase):
    """
    The owners read back from a real SQLite run store (its adbapi thread
    runs on the reactor, so these tests wait on it).
    """

    def setUp(self):
        self.path = FilePath(self.mktemp()).path

    @defer.inlineCallbacks
    def life(self):
        """
        One Node process: a store on the same file, its owners loaded,
        and a ready session. @return: C{(session, edge, pump, context)}
        once the owners are in.
        """
        owners = SessionOwners()
        store = RunStore(reactor, self.path, prune_interval=0, owners=owners)
        store.startService()
        self.addCleanup(store.stopService)
        yield owners.loaded()
        return (*ready_node(SESSIONS, store=store, owners=owners), store)

    @defer.inlineCallbacks
    def test_owner_survives_a_restart(self):
        """
        Alice's session stays hers after the Node restarts: Bob's run on it
        is refused and his terminate answered as unknown.
        """
        session, edge, pump, context, store = yield self.life()
        edge.connection.send(run_request("r1", session_id="s1", caller="alice"))
        edge.connection.send(run_request("r2", session_id="s1", caller="bob"))
        edge.connection.send(run_request("r3", session_id="s2", caller=""))
        pump.flush()
        yield store.stopService()
        session, edge, pump, context, store = yield self.life()
        edge.connection.send(run_request("r4", session_id="s1", caller="bob"))
        pump.flush()
        [event] = edge.of("run_event")
        self.assertEqual(event.error.code, SESSION_OWNED)
        edge.connection.send(messages.terminate_session("q", "manual", "", "s1", "bob"))
        pump.flush()
        self.assertEqual(edge.of("cancel_response")[0].code, "unknown_session")
        # s2 was used only without a caller: still free.
        self.assertTrue(context.owners.claim("manual", "s2", "carol"))

    @defer.inlineCallbacks
    def test_refused_runs_own_nothing(self):
        """
        A stored run the Node refused before its adapter saw it claims
        nothing when read back, even as the oldest left of its session
        (the owner's older runs pruned); nor does a tunnel or a run
        without a caller or a session.
        """
        store = RunStore(reactor, self.path, prune_interval=0)
        store.startService()
        store.record_start("r1", "manual", "", "s1", False, "bob")
        store.record_end("r1", ERROR, "refused", SESSION_OWNED)
        store.record_start("r2", "manual", "", "s1", False, "alice")
        store.record_start("r3", "manual", "", "s2", False, "")
        store.record_start("r4", "manual", "", "", False, "bob")
        store.record_tunnel_start("t1", "manual", "", "bob")
        yield store.stopService()
        owners = SessionOwners()
        store = RunStore(reactor, self.path, prune_interval=0, owners=owners)
        store.startService()
        self.addCleanup(store.stopService)
        yield owners.loaded()
        self.assertFalse(owners.claim("manual", "s1", "bob"))
        self.assertTrue(owners.claim("manual", "s1", "alice"))
        self.assertTrue(owners.claim("manual", "s2", "carol"))
