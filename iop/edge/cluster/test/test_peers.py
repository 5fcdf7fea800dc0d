"""
Reads asked of the other Edges (L{iop.edge.cluster.peers}): each Edge
asked has L{ASK_TIMEOUT_SEC} for its whole answer, body included.
"""

from typing import Any

from twisted.internet import defer
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.client import ResponseDone
from twisted.web.http_headers import Headers
from twisted.web.iweb import IAgent, IBodyProducer, IResponse
from twisted.web.test.requesthelper import DummyRequest
from zope.interface import implementer

from iop.edge.cluster.peers import ASK_TIMEOUT_SEC, PeerReader
from iop.edge.cluster.test.support import SECRET, Answer
from iop.edge.seam import Forward


@implementer(IAgent)
class Peers:
    """
    Every peer: the answer of each host, or none (C{None}: it never
    answers, not even its headers).
    """

    def __init__(self, answers: dict[bytes, Answer | None]) -> None:
        self.answers = answers

    def request(
        self, method: bytes, uri: bytes, headers: Headers | None = None, bodyProducer: IBodyProducer | None = None
    ) -> "Deferred[IResponse]":
        for host, answer in self.answers.items():
            if host in uri:
                return Deferred() if answer is None else defer.succeed(answer)
        raise AssertionError(uri)


class AskTimeoutTests(SynchronousTestCase):
    def ask(self, peers: Peers) -> tuple[Clock, "Deferred[Any]"]:
        clock = Clock()
        reader = PeerReader(SECRET, peers, clock)
        request: Any = DummyRequest([b"v1", b"runs", b"run-x"])
        asked = [Forward(edge, f"http://{edge}.example", "test") for edge in ("edge-b", "edge-c", "edge-d")]
        return clock, reader.ask(asked, request, b"/v1/runs/run-x")

    def test_stalled_body_left_out(self) -> None:
        """
        A peer that sends its headers and then stalls its body is left out
        after ASK_TIMEOUT_SEC, its connection closed, like one that sends
        nothing; the others' answers come.
        """
        stalled = Answer([b'{"id": '], ends=False)
        peers = Peers({b"edge-b": Answer([b'{"id": ', b'"run-x"}'], ends=True), b"edge-c": stalled, b"edge-d": None})
        clock, d = self.ask(peers)
        self.assertNoResult(d)
        clock.advance(ASK_TIMEOUT_SEC)
        answers = self.successResultOf(d)
        self.assertEqual([(a.forward.edge_id, a.code, a.body) for a in answers], [("edge-b", 200, {"id": "run-x"})])
        self.assertEqual(stalled.transport.producerState, "stopped")

    def test_slow_body_within_the_timeout(self) -> None:
        """
        A body that ends within ASK_TIMEOUT_SEC is read.
        """
        slow = Answer([b'{"id": '], ends=False)
        clock, d = self.ask(Peers({b"edge-b": None, b"edge-c": slow, b"edge-d": None}))
        clock.advance(ASK_TIMEOUT_SEC / 2)
        slow.protocol.dataReceived(b'"run-x"}')
        slow.protocol.connectionLost(Failure(ResponseDone()))
        clock.advance(ASK_TIMEOUT_SEC / 2)
        answers = self.successResultOf(d)
        self.assertEqual([(a.forward.edge_id, a.body) for a in answers], [("edge-c", {"id": "run-x"})])
