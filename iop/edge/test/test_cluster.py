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

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from iop.config import ConfigError, Section
from iop.edge.cluster.etcd import Created
from iop.edge.cluster.membership import LOST, OK
from iop.edge.config import parse
from iop.edge.seam import Forward
from iop.edge.spec import RunSpec
from iop.protocols import messages
from iop.testing.edge import EDGE_YAML, EdgeHarness, Recorder
from iop.testing.etcd import MemoryEtcd

SECRET = "a-cluster-secret-of-some-length"


def cluster_yaml(edge_id, ttl=3):
    data: dict[str, Any] = copy.deepcopy(EDGE_YAML)
    data["listen"]["peer"] = "tcp:0"
    data["cluster"] = {
        "etcd": ["http://127.0.0.1:2379"],
        "edge_id": edge_id,
        "advertise": f"http://{edge_id}.example:7180",
        "lease_ttl_sec": ttl,
        "secret": SECRET,
    }
    return data


def group_run(model="grp"):
    return RunSpec(messages=[{"role": "user", "content": "hello world"}], model=model)


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
