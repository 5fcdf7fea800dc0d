"""
Requests proxied to another Edge (L{iop.edge.cluster.forward}): a peer
that took a request and never answers it is given up on once it leaves
the cluster (its membership key gone), with 503 C{forward_failed}; an
answer already streaming is left to go on.
"""

import json
from io import BytesIO
from typing import Any

from treq.testing import StubTreq
from twisted.internet import defer
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.http_headers import Headers
from twisted.web.iweb import IAgent, IBodyProducer, IResponse
from twisted.web.test.requesthelper import DummyRequest
from zope.interface import implementer

from iop.edge.cluster.forward import Forwarder
from iop.edge.cluster.test.support import SECRET, Answer, ClusterCase
from iop.edge.seam import Forward

BASE = "http://edge.example"


@implementer(IAgent)
class SilentPeer:
    """
    Peers that take every request and answer none (a frozen host, a
    half-open connection), or answer with C{response}.
    """

    def __init__(self) -> None:
        self.asked: list[tuple[bytes, Deferred[IResponse]]] = []

    def request(
        self, method: bytes, uri: bytes, headers: Headers | None = None, bodyProducer: IBodyProducer | None = None
    ) -> "Deferred[IResponse]":
        d: Deferred[IResponse] = Deferred()
        self.asked.append((uri, d))
        return d


class Caller(DummyRequest):
    """
    A caller's request, its body read, that takes a push producer.
    """

    producer: Any = None

    def __init__(self) -> None:
        super().__init__([b"v1", b"chat", b"completions"])
        self.method = b"POST"
        self.uri = b"/v1/chat/completions"
        self.content = BytesIO(b"{}")

    def registerProducer(self, producer: Any, streaming: bool) -> None:
        self.producer = producer

    def unregisterProducer(self) -> None:
        self.producer = None


class ForwarderTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.peers = SilentPeer()
        self.forwarder = Forwarder(SECRET, Clock(), self.peers)

    def proxy(self, edge_id: str = "edge-b") -> Caller:
        request = Caller()
        self.forwarder.proxy(request, Forward(edge_id, f"http://{edge_id}.example", "test"))  # type: ignore[arg-type]
        return request

    def test_waiting_fails_when_the_peer_goes(self) -> None:
        """
        A request waiting for the answer of a peer that left the cluster
        fails with 503 forward_failed, saying why; one waiting for another
        peer waits on.
        """
        request = self.proxy("edge-b")
        other = self.proxy("edge-c")
        self.forwarder.peer_gone("edge-b")
        self.assertEqual(request.responseCode, 503)
        self.assertEqual(request.finished, 1)
        error = json.loads(b"".join(request.written))["error"]
        self.assertEqual(error["code"], "forward_failed")
        self.assertIn("left the cluster", error["message"])
        self.assertTrue(self.peers.asked[0][1].called)
        self.assertFalse(self.peers.asked[1][1].called)
        self.assertEqual(other.finished, 0)
        self.assertEqual(set(self.forwarder.waiting), {"edge-c"})

    def test_streaming_answer_goes_on(self) -> None:
        """
        An answer already relaying is not cut when its peer leaves the
        cluster (its bytes show the peer serves); nothing is kept for it.
        """
        request = self.proxy("edge-b")
        response = Answer([b"data: first\n\n"], ends=False, content_type=b"text/event-stream")
        self.peers.asked[0][1].callback(response)
        self.assertEqual(self.forwarder.waiting, {})
        self.forwarder.peer_gone("edge-b")
        self.assertEqual((request.responseCode, request.finished), (200, 0))
        self.assertEqual(request.written, [b"data: first\n\n"])
        self.assertEqual(response.transport.producerState, "producing")

    def test_answered_or_failed_kept_no_more(self) -> None:
        """
        A request whose peer failed to answer is not kept either.
        """
        self.proxy("edge-b")
        self.peers.asked[0][1].errback(ConnectionRefusedError("refused"))
        self.assertEqual(self.forwarder.waiting, {})


class PeerLeavesTests(ClusterCase):
    def test_never_answered_until_its_lease_expires(self) -> None:
        """
        A request forwarded from A to B, which took it and never answers,
        is answered 503 forward_failed at A once B's lease has expired.
        """
        self.b.register("tok-1")
        self.advance(1)
        peers = SilentPeer()
        self.cluster(self.a).forwarder.agent = peers
        http: Any = StubTreq(self.a.site.resource)
        body = {"model": "grp", "messages": [{"role": "user", "content": "x"}]}
        d = http.request("POST", BASE + "/v1/chat/completions", data=json.dumps(body).encode())
        http.flush()
        self.assertEqual(len(peers.asked), 1)
        self.client(self.b).cut()
        self.advance(2)
        http.flush()
        self.assertNoResult(d)
        self.advance(2)
        http.flush()
        self.assertEqual(self.states_seen(self.a)["edge-b"], "down")
        response = self.successResultOf(d)
        self.assertEqual(response.code, 503)
        answer = self.successResultOf(defer.ensureDeferred(response.json()))
        self.assertEqual(answer["error"]["code"], "forward_failed")
