"""
An Edge cluster in memory: two real Edge services sharing one in-memory
etcd (L{iop.testing.etcd}) on one clock, Nodes joined to them by iosim.
Membership, ownership by etcd transaction (fenced by revision), the
duplicate refusal across Edges, etcd outages and lease expiry, the status
view, draining, and where a request that finds no room goes.
"""

import copy
import json
from typing import Any

from twisted.internet.defer import CancelledError
from twisted.internet.error import ConnectionDone
from twisted.internet.task import Clock
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.test.requesthelper import DummyRequest

from iop.config import ConfigError, Section
from iop.edge.cluster.etcd import Created
from iop.edge.cluster.membership import LOST, OK
from iop.edge.cluster.test.support import SECRET, cluster_yaml, group_run
from iop.edge.config import parse
from iop.edge.errors import ServiceError
from iop.edge.http.common import Call
from iop.edge.runs import RUN
from iop.edge.seam import Forward
from iop.edge.spec import RunSpec
from iop.protocols import messages
from iop.run import NODE_DISCONNECTED
from iop.testing.edge import EDGE_YAML, EdgeHarness, Recorder
from iop.testing.etcd import MemoryEtcd


class TwoEdges(SynchronousTestCase):
    def setUp(self):
        self.clock = Clock()
        self.etcd = MemoryEtcd(self.clock)
        self.a = self.edge("edge-a")
        self.b = self.edge("edge-b")

    def edge(self, edge_id, ttl=3):
        harness = EdgeHarness(cluster_yaml(edge_id, ttl), clock=self.clock, etcd=self.etcd.client())
        assert harness.service.cluster is not None
        harness.service.cluster.startService()
        return harness

    def owner_key(self, node_id):
        return self.etcd.data.get(f"/iop/nodes/{node_id}")

    def advance(self, seconds):
        # Both Edges' connections keep their heartbeats going.
        steps = int(seconds / 0.5)
        for _ in range(steps):
            self.clock.advance(0.5)
            self.a.flush()
            self.b.flush()


class MembershipTests(TwoEdges):
    def test_joined(self):
        """
        Each Edge holds a lease and a membership key naming its advertise
        address; each sees the other.
        """
        for harness, edge_id in ((self.a, "edge-a"), (self.b, "edge-b")):
            cluster = harness.service.cluster.membership
            self.assertEqual(cluster.session, OK)
            kv = self.etcd.data[f"/iop/edges/{edge_id}"]
            self.assertEqual(kv.lease, cluster.lease)
            self.assertEqual(json.loads(kv.value)["advertise"], f"http://{edge_id}.example:7180")
        self.assertEqual(set(self.a.service.cluster.membership.edges), {"edge-a", "edge-b"})

    def test_keepalive(self):
        """
        The lease outlives its TTL many times over while kept alive.
        """
        self.advance(30)
        self.assertIn("/iop/edges/edge-a", self.etcd.data)
        self.assertEqual(self.a.service.cluster.membership.session, OK)


class OwnershipTests(TwoEdges):
    def test_claim_at_registration(self):
        """
        A registration at A creates nodes/<id> under A's lease; the
        connection's generation is that key's revision.
        """
        node, _, _ = self.a.register("tok-1")
        self.assertTrue(node.of("node_ready_response")[0].ready)
        kv = self.owner_key("n1")
        self.assertEqual(json.loads(kv.value)["edge"], "edge-a")
        self.assertEqual(kv.lease, self.a.service.cluster.membership.lease)
        self.assertEqual(self.a.service.registry.owner("n1").generation, kv.mod_revision)

    def test_duplicate_across_edges(self):
        """
        The same node id at B while A owns it is refused with
        DUPLICATE_CONNECTION naming A; A's link is untouched.
        """
        first, _, _ = self.a.register("tok-1")
        second, _, _ = self.b.register("tok-1", ready=False)
        response = second.of("register_response")[0]
        self.assertFalse(response.accepted)
        self.assertEqual(response.code, messages.DUPLICATE_CONNECTION)
        self.assertIn("edge-a", response.reason)
        self.assertTrue(second.lost)
        self.assertFalse(first.lost)
        self.assertIsNone(self.b.service.registry.owner("n1"))
        self.assertEqual(json.loads(self.owner_key("n1").value)["edge"], "edge-a")

    def test_release_on_loss(self):
        """
        When A's link goes, the key goes, and the node may register at B
        under a higher generation.
        """
        _, pump, edge_protocol = self.a.register("tok-1")
        first_generation = self.a.service.registry.owner("n1").generation
        edge_protocol.transport.loseConnection()
        pump.flush()
        self.assertIsNone(self.owner_key("n1"))
        node, _, _ = self.b.register("tok-1")
        self.assertTrue(node.of("node_ready_response")[0].ready)
        self.assertGreater(self.b.service.registry.owner("n1").generation, first_generation)
        self.assertEqual(self.b.service.status()["nodes"][0]["edge"], "edge-b")

    def test_stale_release_is_fenced(self):
        """
        A release naming an old revision deletes nothing: once the key is
        another claim's, the stale owner cannot give it away.
        """
        self.b.register("tok-1")
        kv = self.owner_key("n1")
        cluster = self.a.service.cluster.membership
        cluster.claims["n1"] = kv.mod_revision - 1  # what a stale owner believes
        cluster.release("n1", kv.mod_revision - 1)
        self.assertEqual(self.owner_key("n1"), kv)

    def test_ready_needs_the_claim(self):
        """
        A ready from a link whose claim is no longer held is refused.
        """
        node, pump, _ = self.a.register("tok-1", ready=False)
        self.a.service.cluster.membership.claims.clear()
        node.wire.send(messages.ready_request(node_id="n1"))
        pump.flush()
        self.assertFalse(node.of("node_ready_response")[0].ready)
        self.assertFalse(self.a.service.status()["nodes"][0]["connected"])

    def test_repeated_ready_without_the_claim(self):
        """
        Only a first ready is refused for a claim no longer held: a
        repeated one of an active link (its claim gone, its links about to
        close) is acknowledged and changes nothing, so that link's loss
        still ends its work, returns its leases and takes the node out of
        service.
        """
        node, pump, edge_protocol = self.a.register("tok-1")
        recorder = Recorder()
        self.successResultOf(self.a.service.submit(group_run(), recorder.for_run))
        self.a.service.cluster.membership.claims.clear()
        node.wire.send(messages.ready_request(node_id="n1"))
        pump.flush()
        self.assertEqual([r.ready for r in node.of("node_ready_response")], [True, True])
        edge_protocol.transport.loseConnection()
        pump.flush()
        self.assertEqual(recorder.types(), ["error"])
        error = recorder.events[0].error
        assert error is not None
        self.assertEqual(error.code, NODE_DISCONNECTED)
        self.assertEqual(self.a.service.pool.active_leases(), [])
        self.assertFalse(self.a.service.status()["nodes"][0]["connected"])

    def test_lost_during_claim(self):
        """
        A link lost while its claim is in flight gives the claim back as
        soon as it is won.
        """
        from twisted.internet import defer

        cluster = self.a.service.cluster.membership
        real_create = cluster.etcd.create
        pending = []

        def slow_create(key, value, lease):
            d: defer.Deferred[Created] = defer.Deferred()
            pending.append((d, key, value, lease))
            return d

        cluster.etcd.create = slow_create
        node, pump, edge_protocol = self.a.register("tok-1", ready=False)
        self.assertEqual(node.of("register_response"), [])
        edge_protocol.transport.loseConnection()
        pump.flush()
        d, key, value, lease = pending[0]
        real_create(key, value, lease).chainDeferred(d)
        self.assertIsNone(self.owner_key("n1"))
        self.assertEqual(cluster.claims, {})


class SessionTests(TwoEdges):
    def test_outage_keeps_owned_nodes_refuses_new(self):
        """
        etcd stopped: A keeps serving the node it owns, refuses a new
        registration (retryable) and says so in its status; when etcd is
        back A takes registrations again and the first node is still its.
        """
        self.a.register("tok-1")
        self.etcd.stop()
        self.advance(3)
        cluster = self.a.service.cluster.membership
        self.assertEqual(cluster.session, LOST)
        status = self.a.service.status()
        self.assertFalse(status["cluster"]["accepting_registrations"])
        self.assertEqual(status["cluster"]["edges"][0]["session"], LOST)
        recorder = Recorder()
        self.successResultOf(self.a.service.submit(group_run(), recorder.for_run))
        self.a.flush()
        refused, _, _ = self.a.register("tok-2", ready=False)
        response = refused.of("register_response")[0]
        self.assertEqual(response.code, messages.DUPLICATE_CONNECTION)
        self.assertIn("etcd", response.reason)
        self.etcd.start()
        self.advance(3)
        self.assertEqual(cluster.session, OK)
        node, _, _ = self.a.register("tok-2")
        self.assertTrue(node.of("node_ready_response")[0].ready)
        self.assertEqual(json.loads(self.owner_key("n1").value)["edge"], "edge-a")

    def test_release_waits_for_etcd(self):
        """
        A node lost while etcd is down is released once etcd answers again.
        """
        _, pump, edge_protocol = self.a.register("tok-1")
        self.etcd.stop()
        edge_protocol.transport.loseConnection()
        pump.flush()
        self.etcd.start()
        self.advance(2)
        self.assertIsNone(self.owner_key("n1"))

    def test_expired_lease_voids_claims(self):
        """
        A cut off from etcd longer than its TTL: its lease expires, its
        key goes, B may take the node; when A hears that its lease is
        gone it closes its Node links and joins again with a new lease.
        """
        node, _, _ = self.a.register("tok-1")
        client = self.a.service.cluster.membership.etcd
        client.cut()
        self.advance(4)
        self.assertIsNone(self.owner_key("n1"))
        self.assertNotIn("/iop/edges/edge-a", self.etcd.data)
        client.heal()
        self.advance(2)
        self.assertTrue(node.lost)
        cluster = self.a.service.cluster.membership
        self.assertEqual(cluster.voids, 1)
        self.assertEqual(cluster.session, OK)
        self.assertIn("/iop/edges/edge-a", self.etcd.data)


class StatusTests(TwoEdges):
    def test_every_node_with_its_edge(self):
        """
        /v1/status on either Edge lists every configured node with the
        Edge that owns it, or none, and every Edge with its state.
        """
        self.a.register("tok-1")
        for harness in (self.a, self.b):
            status = harness.service.status()
            self.assertEqual({n["id"]: n["edge"] for n in status["nodes"]}, {"n1": "edge-a", "n2": None})
            edges = {e["id"]: e["state"] for e in status["cluster"]["edges"]}
            self.assertEqual(edges, {"edge-a": "up", "edge-b": "up"})
        self.assertTrue(self.a.service.status()["nodes"][0]["connected"])
        self.assertFalse(self.b.service.status()["nodes"][0]["connected"])

    def test_gone_edge(self):
        """
        An Edge whose lease expired shows as down.
        """
        self.a.service.cluster.membership.etcd.cut()
        self.advance(4)
        edges = {e["id"]: e["state"] for e in self.b.service.status()["cluster"]["edges"]}
        self.assertEqual(edges, {"edge-a": "down", "edge-b": "up"})

    def test_single_edge_status_unchanged(self):
        """
        Without cluster the snapshot has no cluster keys.
        """
        status = EdgeHarness().service.status()
        self.assertNotIn("cluster", status)
        self.assertNotIn("edge", status["nodes"][0])


class DrainTests(TwoEdges):
    def test_drain_gives_nodes_back_before_closing(self):
        """
        A draining Edge says so, then revokes its lease before it closes
        its Node links: by the time a Node sees its link close, its key
        is gone and B takes it at once.
        """
        self.a.register("tok-1")
        states = []
        self.b.service.cluster.membership.etcd.watch(
            "/iop/edges/", 0, lambda e: states.append(json.loads(e.kv.value or "{}"))
        )
        client = self.a.service.cluster.membership.etcd
        seen = []
        self.a.service.links.close_all = lambda reason: seen.append((self.owner_key("n1"), client.calls[-1]))
        self.a.service.stopService()
        self.a.flush()
        self.assertEqual(states[0]["state"], "draining")
        self.assertEqual(seen, [(None, "revoke")])
        self.assertNotIn("/iop/edges/edge-a", self.etcd.data)
        self.assertEqual(self.b.service.cluster.membership.edges.keys(), {"edge-b"})


class ForwardTests(TwoEdges):
    def test_no_room_here_goes_to_the_owner(self):
        """
        A request at B for a group whose providers are all owned by A is
        forwarded to A's advertise address once A has published its room.
        """
        self.a.register("tok-1")
        self.advance(1)
        failure = self.failureResultOf(self.b.service.submit(group_run(), Recorder().for_run), Forward)
        self.assertEqual(failure.value.edge_id, "edge-a")
        self.assertEqual(failure.value.url, "http://edge-a.example:7180")

    def test_owned_elsewhere_before_any_room_is_known(self):
        """
        A request at B for a group whose only node A owns goes to A as
        soon as B sees the ownership, before A has published any room
        (instead of failing at B, where nothing is live).
        """
        self.a.register("tok-1")
        self.assertEqual(self.b.service.cluster.membership.loads, {})
        failure = self.failureResultOf(self.b.service.submit(group_run(), Recorder().for_run), Forward)
        self.assertEqual(failure.value.edge_id, "edge-a")

    def test_owned_nowhere_stays_here(self):
        """
        With the group's node connected to no Edge, the request stays (and
        fails) here.
        """
        d = self.b.service.submit(group_run(), Recorder().for_run)
        self.assertEqual(self.failureResultOf(d).value.kind, "unavailable")

    def test_node_target(self):
        """
        Requests about a node (its commands, sessions) go to the Edge that
        owns it; one connected here, or nowhere, stays here.
        """
        self.a.register("tok-1")
        forward = self.b.service.cluster.node_target("n1")
        self.assertEqual((forward.edge_id, forward.url), ("edge-a", "http://edge-a.example:7180"))
        self.assertIsNone(self.a.service.cluster.node_target("n1"))
        self.assertIsNone(self.b.service.cluster.node_target("n2"))

    def test_local_room_stays_local(self):
        """
        A request at A, which has room, is placed at A.
        """
        self.a.register("tok-1")
        self.advance(1)
        recorder = Recorder()
        self.successResultOf(self.a.service.submit(group_run(), recorder.for_run))

    def test_forwarded_is_never_forwarded_again(self):
        """
        A request that was forwarded already is placed here whatever the
        other Edges have (here: nothing live, so 503).
        """
        self.a.register("tok-1")
        self.advance(1)
        d = self.b.service.submit(group_run(), Recorder().for_run, may_forward=False)
        self.assertEqual(self.failureResultOf(d).value.kind, "unavailable")

    def test_explicit_node_elsewhere(self):
        """
        A run for an explicit node connected to A, asked at B, goes to A.
        """
        self.a.register("tok-1")
        spec = RunSpec(messages=[{"role": "user", "content": "x"}], adapter="echo", node="n1")
        failure = self.failureResultOf(self.b.service.submit(spec, Recorder().for_run), Forward)
        self.assertEqual(failure.value.edge_id, "edge-a")

    def test_room_both_sides_prefers_local_then_most_room(self):
        """
        With n1 at A and n2 at B, a request at B uses B's room first; once
        B is full it goes to A, which has room.
        """
        self.a.register("tok-1")
        self.b.register("tok-2")
        self.advance(1)
        self.successResultOf(self.b.service.submit(group_run(), Recorder().for_run))
        self.advance(1)
        failure = self.failureResultOf(self.b.service.submit(group_run(), Recorder().for_run), Forward)
        self.assertEqual(failure.value.edge_id, "edge-a")


class ArrivalTests(TwoEdges):
    def test_forwarded_waits_for_a_registering_node(self):
        """
        Work forwarded to A (on ownership) while A's only node of the
        group is registered but not ready yet waits for its ready, then is
        placed; work asked at A itself is placed (and refused) at once, as
        ever.
        """
        node, pump, _ = self.a.register("tok-1", ready=False)
        d = self.a.service.submit(group_run(), Recorder().for_run, may_forward=False)
        self.assertNoResult(d)
        self.assertEqual(
            self.failureResultOf(self.a.service.submit(group_run(), Recorder().for_run)).value.kind, "unavailable"
        )
        node.connection.send(messages.ready_request("n1"))
        pump.flush()
        self.clock.advance(0)
        self.assertIsInstance(self.successResultOf(d), str)
        self.assertEqual(len(self.a.service.intake.arrivals), 0)

    def test_bounded_by_the_queue_timeout(self):
        """
        The wait lasts at most the group's queue timeout; a cancel ends it.
        """
        self.a.register("tok-1", ready=False)
        d = self.a.service.submit(group_run(), Recorder().for_run, may_forward=False)
        self.clock.advance(self.a.service.pool.group("grp").queue_timeout_sec)
        self.assertEqual(self.failureResultOf(d).value.kind, "unavailable")
        cancelled = self.a.service.submit(group_run(), Recorder().for_run, may_forward=False)
        cancelled.cancel()
        self.failureResultOf(cancelled)
        self.assertEqual(len(self.a.service.intake.arrivals), 0)

    def test_caller_leaving_after_the_arrival_leaves_the_queue(self):
        """
        Work that waited for its node's ready and then queued for room
        leaves the queue at once when its caller goes away (the arrival's
        Deferred has fired by then, chained to the pool's waiter).
        """
        node, pump, _ = self.a.register("tok-1", ready=False)
        self.a.service.submit(group_run(), Recorder().for_run, may_forward=False)
        request: Any = DummyRequest([b""])
        call = Call(self.a.service, request)
        call.submitting = self.a.service.submit(group_run(), Recorder().for_run, may_forward=False)
        node.connection.send(messages.ready_request("n1"))
        pump.flush()
        self.clock.advance(0)
        self.assertEqual(self.a.service.pool.waiting(), 1)
        request.processingFailed(Failure(ConnectionDone()))
        self.assertEqual(self.a.service.pool.waiting(), 0)
        self.failureResultOf(call.submitting, CancelledError)


class HeldElsewhereTests(TwoEdges):
    def lost_run(self, status="running", code=None):
        """
        A run on A's record whose node, n1, A does not hold.
        """
        record = self.a.service.runs.open("run-x", RUN, node="n1", caller=None, status=status, background=True)
        if code is not None:
            record.error = {"code": code, "message": "gone"}
        return record

    def test_read_where_its_node_went(self):
        """
        A run A lost its node for, while that node is at B, is read at B:
        a L{Forward} for a caller at A, C{not_found} for a read B forwarded.
        """
        self.lost_run()
        self.b.register("tok-1")
        failure = self.failureResultOf(self.a.service.history.get_run("run-x"), Forward)
        self.assertEqual(failure.value.edge_id, "edge-b")
        failure = self.failureResultOf(
            self.a.service.history.follow("run-x", 0, lambda seq, event: None, lambda: None), Forward
        )
        self.assertEqual(failure.value.edge_id, "edge-b")
        failure = self.failureResultOf(self.a.service.history.get_run("run-x", may_forward=False), ServiceError)
        self.assertEqual(failure.value.kind, "not_found")

    def test_ended_here_as_lost(self):
        """
        One A ended as node_disconnected (it gave up waiting) is read at B
        too; one that ended with its Node's own terminal is A's.
        """
        record = self.lost_run("error", NODE_DISCONNECTED)
        record.ended_at = self.clock.seconds()
        self.b.register("tok-1")
        forward = self.a.service.history.held_elsewhere("run-x")
        self.assertEqual(forward.edge_id if forward is not None else None, "edge-b")
        record.error = None
        record.status = "complete"
        self.assertIsNone(self.a.service.history.held_elsewhere("run-x"))

    def test_cancelled_where_its_node_went(self):
        """
        A background run waiting at A for n1, which went to B, is not
        cancelled at A (B took it on); while n1 is nowhere, it is.
        """
        spec = RunSpec(messages=[{"role": "user", "content": "x"}], adapter="echo", node="n1", background=True)
        _, pump, edge_protocol = self.a.register("tok-1")
        run_id = self.successResultOf(self.a.service.submit(spec, Recorder().for_run))
        edge_protocol.transport.loseConnection()
        pump.flush()
        _, pump, edge_protocol = self.b.register("tok-1")
        self.assertFalse(self.a.service.cancel(run_id))
        forward = self.a.service.history.held_elsewhere(run_id)
        self.assertEqual(forward.edge_id if forward is not None else None, "edge-b")
        edge_protocol.transport.loseConnection()
        pump.flush()
        self.assertTrue(self.a.service.cancel(run_id))

    def test_readers_let_go_when_the_node_moves(self):
        """
        A reader following at A a background run that waits for n1 is let
        go (its stream ends, no terminal) once n1 registers at B.
        """
        spec = RunSpec(messages=[{"role": "user", "content": "x"}], adapter="echo", node="n1", background=True)
        _, pump, edge_protocol = self.a.register("tok-1")
        run_id = self.successResultOf(self.a.service.submit(spec, Recorder().for_run))
        ended: list[bool] = []
        self.successResultOf(self.a.service.follow(run_id, 0, lambda seq, event: None, lambda: ended.append(True)))
        edge_protocol.transport.loseConnection()
        pump.flush()
        self.assertEqual(ended, [])
        self.b.register("tok-1")
        self.assertEqual(ended, [True])
        record = self.a.service.runs.get(run_id)
        self.assertEqual((record.status, record.followers) if record is not None else None, ("running", []))

    def test_native_runs_outlive_their_edge(self):
        """
        In a cluster a native run is sent as one its Node keeps across a
        lost link (the wire's background), though not a background run
        here.
        """
        self.assertTrue(self.a.service.cluster.keeps_runs)
        node, pump, _ = self.a.register("tok-1")
        spec = RunSpec(messages=[{"role": "user", "content": "x"}], adapter="echo", node="n1", outlives_edge=True)
        self.successResultOf(self.a.service.submit(spec, Recorder().for_run))
        pump.flush()
        [request] = node.of("run_request")
        self.assertTrue(request.background)
        record = self.a.service.runs.get(request.run_id)
        self.assertFalse(record.background if record is not None else True)

    def test_node_nowhere(self):
        """
        While its node is connected to no Edge, the run is read here.
        """
        self.lost_run()
        self.assertIsNone(self.a.service.history.held_elsewhere("run-x"))


class ConfigTests(SynchronousTestCase):
    def parse(self, data):
        return parse(Section(data, "", "edge.yaml"))

    def test_parsed(self):
        """
        The cluster section and listen.peer are read with their defaults.
        """
        config = self.parse(cluster_yaml("edge-a"))
        self.assertEqual(config.cluster.edge_id, "edge-a")
        self.assertEqual(config.cluster.prefix, "/iop/")
        self.assertEqual(config.listen_peer, "tcp:0")
        self.assertNotIn(SECRET, repr(config.cluster))

    def test_none_without_cluster(self):
        """
        Without cluster there is none, and listen.peer alone is refused.
        """
        self.assertIsNone(self.parse(copy.deepcopy(EDGE_YAML)).cluster)
        data: dict[str, Any] = copy.deepcopy(EDGE_YAML)
        data["listen"]["peer"] = "tcp:0"
        self.assertRaisesRegex(ConfigError, "listen.peer", self.parse, data)

    def test_errors_name_the_key(self):
        """
        Each mistake names its key.
        """
        cases = [
            ("secret", None, "cluster.secret: required"),
            ("secret", "short", "cluster.secret: must be"),
            ("edge_id", "no spaces", "cluster.edge_id"),
            ("etcd", [], "cluster.etcd"),
            ("etcd", ["127.0.0.1:2379"], r"cluster.etcd\[0\]"),
            ("lease_ttl_sec", 1, "cluster.lease_ttl_sec"),
            ("advertise", "tcp:7180", "cluster.advertise"),
        ]
        for key, value, message in cases:
            data = cluster_yaml("edge-a")
            if value is None:
                del data["cluster"][key]
            else:
                data["cluster"][key] = value
            self.assertRaisesRegex(ConfigError, message, self.parse, data)
        data = cluster_yaml("edge-a")
        del data["listen"]["peer"]
        self.assertRaisesRegex(ConfigError, "listen.peer: required", self.parse, data)
