"""
The etcd v3 JSON-gateway client (L{iop.edge.cluster.etcd.EtcdClient})
against an in-memory gateway (treq's request-traversal agent): what it
sends, how it reads the answers, moving on to the next endpoint, and the
watch stream's lines. The real server is exercised by
tests/test_e2e_cluster.py.
"""

import base64
import json

from treq.testing import StubTreq
from twisted.internet import defer
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.resource import Resource

from iop.edge.cluster.etcd import EtcdClient, EtcdUnavailable, WatchEvent, _Watch, prefix_end


def b64(text):
    return base64.b64encode(text.encode()).decode()


class Gateway(Resource):
    """
    Answers each path with the next canned answer; records what came.
    """

    isLeaf = True

    def __init__(self):
        super().__init__()
        self.answers = {}
        self.seen = []
        self.down_hosts = set()

    def render_POST(self, request):
        host = request.getHeader(b"host").decode()
        self.seen.append((host, request.path.decode(), json.loads(request.content.read())))
        if host in self.down_hosts:
            request.setResponseCode(503)
            return b"unavailable"
        return json.dumps(self.answers[request.path.decode()]).encode()


class ClientTests(SynchronousTestCase):
    def setUp(self):
        self.gateway = Gateway()
        self.agent = StubTreq(self.gateway)
        self.client = EtcdClient(["http://a:2379", "http://b:2379"], Clock(), http=self.agent)

    def call(self, d):
        for _ in range(10):
            self.agent.flush()
        return self.successResultOf(d)

    def test_grant_and_keepalive(self):
        """
        Leases are strings on the wire; a keep-alive answer without TTL
        means the lease is gone (0).
        """
        self.gateway.answers["/v3/lease/grant"] = {"ID": "7587899237575891718", "TTL": "3"}
        self.assertEqual(self.call(self.client.grant(3)), 7587899237575891718)
        self.assertEqual(self.gateway.seen[-1][2], {"TTL": "3"})
        self.gateway.answers["/v3/lease/keepalive"] = {"result": {"ID": "1", "TTL": "3"}}
        self.assertEqual(self.call(self.client.keepalive(1)), 3)
        self.gateway.answers["/v3/lease/keepalive"] = {"result": {"ID": "1"}}
        self.assertEqual(self.call(self.client.keepalive(1)), 0)

    def test_create(self):
        """
        C{create} is a transaction on C{create_revision == 0}; a failed
        one reports the key as it is.
        """
        self.gateway.answers["/v3/kv/txn"] = {"header": {"revision": "9"}, "succeeded": True}
        created = self.call(self.client.create("/iop/nodes/n1", b'{"edge": "a"}', 5))
        self.assertEqual((created.created, created.revision), (True, 9))
        body = self.gateway.seen[-1][2]
        self.assertEqual(
            body["compare"],
            [{"key": b64("/iop/nodes/n1"), "target": "CREATE", "result": "EQUAL", "create_revision": "0"}],
        )
        self.assertEqual(body["success"][0]["request_put"]["lease"], "5")
        kv = {
            "key": b64("/iop/nodes/n1"),
            "value": b64('{"edge": "b"}'),
            "create_revision": "4",
            "mod_revision": "6",
            "lease": "8",
        }
        self.gateway.answers["/v3/kv/txn"] = {
            "header": {"revision": "9"},
            "responses": [{"response_range": {"kvs": [kv]}}],
        }
        taken = self.call(self.client.create("/iop/nodes/n1", b"{}", 5))
        self.assertFalse(taken.created)
        self.assertEqual(
            (taken.existing.value, taken.existing.mod_revision, taken.existing.lease), (b'{"edge": "b"}', 6, 8)
        )

    def test_delete_if_is_fenced(self):
        """
        C{delete_if} compares the key's C{mod_revision}.
        """
        self.gateway.answers["/v3/kv/txn"] = {"header": {"revision": "10"}}
        self.assertFalse(self.call(self.client.delete_if("/iop/nodes/n1", 6)))
        self.assertEqual(self.gateway.seen[-1][2]["compare"][0]["mod_revision"], "6")

    def test_range_prefix(self):
        """
        A prefix range asks up to the prefix's end and decodes every key.
        """
        kv = {"key": b64("/iop/edges/a"), "value": b64("{}"), "create_revision": "2", "mod_revision": "3"}
        self.gateway.answers["/v3/kv/range"] = {"header": {"revision": "12"}, "kvs": [kv]}
        revision, kvs = self.call(self.client.range("/iop/", prefix=True))
        self.assertEqual((revision, kvs[0].key, kvs[0].lease), (12, "/iop/edges/a", 0))
        self.assertEqual(self.gateway.seen[-1][2]["range_end"], b64("/iop0"))

    def test_next_endpoint(self):
        """
        An endpoint answering 5xx is passed over for the next, which is
        used from then on; with none answering, L{EtcdUnavailable}.
        """
        self.gateway.down_hosts.add("a:2379")
        self.gateway.answers["/v3/kv/put"] = {"header": {"revision": "3"}}
        self.assertEqual(self.call(self.client.put("k", b"v")), 3)
        self.assertEqual([host for host, _, _ in self.gateway.seen], ["a:2379", "b:2379"])
        self.call(self.client.put("k", b"v"))
        self.assertEqual(self.gateway.seen[-1][0], "b:2379")
        self.gateway.down_hosts.add("b:2379")
        d = self.client.put("k", b"v")
        for _ in range(10):
            self.agent.flush()
        self.failureResultOf(d, EtcdUnavailable)


class Hung:
    """
    A treq client whose every request hangs (an endpoint that takes the
    connection and never answers).
    """

    def __init__(self):
        self.posts = 0

    def post(self, url, **kwargs):
        self.posts += 1
        return Deferred()


class CancelTests(SynchronousTestCase):
    def test_cancelled_call_tries_no_other_endpoint(self):
        """
        A call cancelled by its caller (a leave's own deadline) ends then,
        cancelled: it does not go on to the next endpoints.
        """
        clock = Clock()
        http = Hung()
        client = EtcdClient(["http://a:2379", "http://b:2379", "http://c:2379"], clock, http=http)
        d = client.revoke(7)
        d.addTimeout(3, clock)
        clock.advance(3)
        self.failureResultOf(d, defer.TimeoutError)
        self.assertEqual(http.posts, 2)
        clock.advance(10)
        self.assertEqual(http.posts, 2)


class WatchTests(SynchronousTestCase):
    def test_lines(self):
        """
        The watch body is one JSON object per line, in pieces of any
        size; puts and deletes come out in order; a cancelled watch ends
        it with an error.
        """
        events: list[WatchEvent] = []
        watch = _Watch(events.append)
        put = {"kv": {"key": b64("/p/a"), "value": b64("1"), "mod_revision": "5"}}
        delete = {"type": "DELETE", "kv": {"key": b64("/p/a"), "mod_revision": "6"}}
        data = (
            json.dumps({"result": {"created": True}}) + "\n" + json.dumps({"result": {"events": [put, delete]}}) + "\n"
        ).encode()
        for i in range(len(data)):
            watch.dataReceived(data[i : i + 1])
        self.assertEqual(
            [(e.type, e.kv.key, e.kv.mod_revision) for e in events], [("put", "/p/a", 5), ("delete", "/p/a", 6)]
        )
        watch.dataReceived(json.dumps({"result": {"canceled": True, "cancel_reason": "compacted"}}).encode() + b"\n")
        self.assertIn("compacted", str(self.failureResultOf(watch.done, EtcdUnavailable).value))

    def test_prefix_end(self):
        """
        The end of a prefix range is the prefix with its last byte + 1.
        """
        self.assertEqual(prefix_end("/iop/"), b"/iop0")
        self.assertEqual(prefix_end("ab"), b"ac")
