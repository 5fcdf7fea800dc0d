"""
Requests proxied to another Edge (L{iop.edge.cluster.forward}): once a
peer leaves the cluster (its membership key gone), a request it took and
never answered is given up on with 503 C{forward_failed}, and an answer
it was streaming is cut off (the caller's connection closed without the
answer's end) unless it ends within a grace; nothing is kept of either.
"""

import json
from io import BytesIO
from typing import Any

from treq.testing import StubTreq
from twisted.internet import defer
from twisted.internet.defer import Deferred
from twisted.internet.error import ConnectionLost
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.logger import capturedLogs, formatEvent
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.client import ResponseDone, ResponseFailed, ResponseNeverReceived
from twisted.web.http import PotentialDataLoss, _DataLoss
from twisted.web.http_headers import Headers
from twisted.web.iweb import IAgent, IBodyProducer, IResponse
from twisted.web.server import Request
from twisted.web.test.requesthelper import DummyChannel, DummyRequest
from zope.interface import implementer

from iop.edge.cluster.forward import LEFT_GRACE_SEC, Forwarder
from iop.edge.cluster.test.support import SECRET, Answer, ClusterCase
from iop.edge.seam import Forward
from iop.edge.timing import Timing

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
    A caller's request, its body read, that takes a push producer, on a
    connection that can be cut (C{self.channel.transport.disconnected}).
    """

    producer: Any = None
    #: (twisted.web's flag of a caller who hung up, which the forwarder reads.)
    _disconnected = False

    def __init__(self) -> None:
        super().__init__([b"v1", b"chat", b"completions"])
        self.method = b"POST"
        self.uri = b"/v1/chat/completions"
        self.content = BytesIO(b"{}")
        channel: Any = DummyChannel()
        channel.transport = StringTransport()
        self.channel = channel

    def registerProducer(self, producer: Any, streaming: bool) -> None:
        self.producer = producer

    def unregisterProducer(self) -> None:
        self.producer = None


class ForwarderTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.peers = SilentPeer()
        self.clock = Clock()
        self.forwarder = Forwarder(SECRET, self.clock, self.peers)

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
        self.assertEqual(set(self.forwarder.relays), {"edge-c"})

    def test_streaming_answer_cut_when_the_peer_goes(self) -> None:
        """
        An answer streaming from a peer that left the cluster and that does
        not end within LEFT_GRACE_SEC is cut: the peer's connection is
        closed, the caller's aborted without the answer's end (never
        finished), with one line logged saying why; nothing is kept of it,
        and what comes after (the peer's bytes and end, the caller's
        connection lost, the peer gone again) changes nothing. A stream
        from another peer goes on.
        """
        request = self.proxy("edge-b")
        other = self.proxy("edge-c")
        response = Answer([b"data: first\n\n"], ends=False, content_type=b"text/event-stream")
        self.peers.asked[0][1].callback(response)
        self.peers.asked[1][1].callback(Answer([b"data: other\n\n"], ends=False))
        self.assertEqual(set(self.forwarder.relays), {"edge-b", "edge-c"})
        with capturedLogs() as events:
            self.forwarder.peer_gone("edge-b")
            self.forwarder.peer_gone("edge-b")  # (told twice: one grace)
            self.clock.advance(LEFT_GRACE_SEC - 0.1)
            self.assertFalse(request.channel.transport.disconnected)
            self.assertEqual(set(self.forwarder.relays), {"edge-b", "edge-c"})
            self.clock.advance(0.1)
        lines = [formatEvent(event) for event in events]
        self.assertEqual(len(lines), 1, lines)
        self.assertIn("Edge edge-b cut off: it left the cluster", lines[0])
        self.assertEqual(response.transport.producerState, "stopped")
        self.assertTrue(request.channel.transport.disconnected)
        self.assertIsNone(request.producer)
        self.assertEqual((request.responseCode, request.finished), (200, 0))
        self.assertEqual(set(self.forwarder.relays), {"edge-c"})
        response.protocol.dataReceived(b"data: late\n\n")
        # (A body read to its connection's close would call this its end.)
        response.protocol.connectionLost(Failure(PotentialDataLoss()))
        request.processingFailed(Failure(ConnectionLost()))
        self.forwarder.peer_gone("edge-b")
        self.assertEqual(request.written, [b"data: first\n\n"])
        self.assertEqual(request.finished, 0)
        self.assertEqual((other.finished, other.written), (0, [b"data: other\n\n"]))
        self.assertFalse(other.channel.transport.disconnected)

    def test_forward_marked_for_server_timing(self) -> None:
        """
        The forward is marked on the request's timing: what follows is the
        serving Edge's time (C{forward}), not this one's.
        """
        request = Caller()
        request.timing = Timing(arrived=0.0)  # type: ignore[attr-defined]
        self.clock.advance(2)
        self.forwarder.proxy(request, Forward("edge-b", "http://edge-b.example", "test"))  # type: ignore[arg-type]
        self.assertEqual(request.timing.forwarded, 2.0)  # type: ignore[attr-defined]

    def test_answer_that_ends_within_the_grace_is_whole(self) -> None:
        """
        A peer that left cleanly (a drain leaves once its answers are
        written) still delivers what it wrote: an answer that ends within
        LEFT_GRACE_SEC of the peer's going reaches the caller whole and
        finished, and no cut is left pending.
        """
        request = self.proxy("edge-b")
        response = Answer([b"data: first\n\n"], ends=False, content_type=b"text/event-stream")
        self.peers.asked[0][1].callback(response)
        self.forwarder.peer_gone("edge-b")
        self.clock.advance(LEFT_GRACE_SEC / 2)
        response.protocol.dataReceived(b"data: [DONE]\n\n")
        response.protocol.connectionLost(Failure(ResponseDone()))
        self.assertEqual(request.written, [b"data: first\n\n", b"data: [DONE]\n\n"])
        self.assertEqual(request.finished, 1)
        self.assertFalse(request.channel.transport.disconnected)
        self.assertEqual((self.forwarder.relays, self.clock.getDelayedCalls()), ({}, []))

    def test_answered_or_failed_kept_no_more(self) -> None:
        """
        A request whose peer failed to answer is not kept, nor one whose
        answer ended, nor one whose caller went away mid-answer.
        """
        self.proxy("edge-b")
        self.peers.asked[0][1].errback(ConnectionRefusedError("refused"))
        self.assertEqual(self.forwarder.relays, {})
        answered = self.proxy("edge-b")
        self.peers.asked[1][1].callback(Answer([b"{}"], ends=True))
        self.assertEqual((answered.finished, self.forwarder.relays), (1, {}))
        left = self.proxy("edge-b")
        response = Answer([b"data: first\n\n"], ends=False)
        self.peers.asked[2][1].callback(response)
        left.processingFailed(Failure(ConnectionLost()))
        self.assertEqual(response.transport.producerState, "stopped")
        self.assertEqual(self.forwarder.relays, {})
        response.protocol.connectionLost(Failure(ResponseFailed([Failure(ConnectionLost())])))
        self.assertEqual((left.finished, left.channel.transport.disconnected), (0, False))
        self.forwarder.peer_gone("edge-b")
        self.assertEqual(left.finished, 0)

    def test_peer_died_before_answering(self) -> None:
        """
        A peer whose connection is lost before it answered is a 503
        forward_failed whose message says why in words, not in the reprs
        of twisted's failures.
        """
        request = self.proxy("edge-b")
        self.peers.asked[0][1].errback(ResponseNeverReceived([Failure(ConnectionLost())]))
        self.assertEqual(request.responseCode, 503)
        error = json.loads(b"".join(request.written))["error"]
        self.assertEqual(error["code"], "forward_failed")
        self.assertNotIn("<", error["message"])
        self.assertIn("Connection to the other side was lost", error["message"])

    def test_caller_gone_before_the_forward(self) -> None:
        """
        A request whose caller hung up before it was proxied (while this
        Edge asked the others which one holds a run; twisted.web closed
        its body then) is not sent: nothing is asked of the peer, nothing
        kept, and no error raised.
        """
        request = Request(DummyChannel())
        request.method = b"POST"
        request.uri = b"/v1/runs/run-1/cancel"
        request.content = BytesIO(b"")
        request.connectionLost(Failure(ConnectionLost()))
        d = self.forwarder.proxy(request, Forward("edge-b", "http://edge-b.example", "test"))  # type: ignore[arg-type]
        self.successResultOf(d)
        self.assertEqual(self.peers.asked, [])
        self.assertEqual(self.forwarder.relays, {})
        self.assertEqual(request.finished, 0)


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

    def test_stream_cut_off_when_its_lease_expires(self) -> None:
        """
        A stream forwarded from A to B, whose connection then stays up and
        says nothing, is cut at A's caller once B's lease has expired and
        LEFT_GRACE_SEC has passed: the caller has the bytes relayed and then a truncated body (its last
        chunk never came), not an end.
        """
        self.b.register("tok-1")
        self.advance(1)
        peers = SilentPeer()
        forwarder = self.cluster(self.a).forwarder
        forwarder.agent = peers
        http: Any = StubTreq(self.a.site.resource)
        body = {"model": "grp", "messages": [{"role": "user", "content": "x"}], "stream": True}
        d = http.request("POST", BASE + "/v1/chat/completions", data=json.dumps(body).encode())
        http.flush()
        answer = Answer([b"data: first\n\n"], ends=False, content_type=b"text/event-stream")
        peers.asked[0][1].callback(answer)
        http.flush()
        response = self.successResultOf(d)
        self.assertEqual(response.code, 200)
        chunks: list[bytes] = []
        collected = response.collect(chunks.append)
        http.flush()
        self.assertEqual(chunks, [b"data: first\n\n"])
        self.client(self.b).cut()
        self.advance(2)
        http.flush()
        self.assertNoResult(collected)
        self.advance(2)
        http.flush()
        self.assertEqual(self.states_seen(self.a)["edge-b"], "down")
        self.assertNoResult(collected)  # (the grace a clean leave needs)
        self.advance(LEFT_GRACE_SEC)
        http.flush()
        failure = self.failureResultOf(collected, ResponseFailed)
        # The chunked decoder missed the last chunk: the caller can tell.
        self.assertTrue([reason for reason in failure.value.reasons if reason.check(_DataLoss)])
        self.assertEqual(chunks, [b"data: first\n\n"])
        self.assertEqual(answer.transport.producerState, "stopped")
        self.assertEqual(forwarder.relays, {})
