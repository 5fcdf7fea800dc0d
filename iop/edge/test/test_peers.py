"""
Reads asked of the other Edges (L{iop.edge.cluster.peers}): which Edges
are asked, what they are sent (the caller's credentials and the cluster's
secret, nothing of the caller's hop) and which answers come back.
"""

import json
from typing import Any

from treq.testing import RequestTraversalAgent
from twisted.internet import defer
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.http_headers import Headers
from twisted.web.iweb import IAgent, IBodyProducer, IResponse
from twisted.web.resource import Resource
from twisted.web.server import Request
from twisted.web.test.requesthelper import DummyRequest
from zope.interface import implementer

from iop.edge.cluster.forward import PEER_HEADER
from iop.edge.cluster.peers import PeerReader, readable_peers
from iop.edge.http.request import EdgeRequest
from iop.edge.seam import Forward

SECRET = "a-cluster-secret-of-some-length"


class Peers(Resource):
    """
    Every peer at once: it answers by the host asked (C{answers}), and
    notes the headers of each request.
    """

    isLeaf = True

    def __init__(self, answers: dict[bytes, tuple[int, Any]]) -> None:
        super().__init__()
        self.answers = answers
        self.seen: list[tuple[bytes, bytes, Headers]] = []

    def render_GET(self, request: Request) -> bytes:
        host = request.getHeader(b"host") or b""
        self.seen.append((host, request.uri, request.requestHeaders))
        code, body = self.answers[host]
        request.setResponseCode(code)
        return json.dumps(body).encode()


@implementer(IAgent)
class DownAgent:
    """
    An agent in front of another that cannot connect to C{down}.
    """

    def __init__(self, agent: RequestTraversalAgent, down: bytes) -> None:
        self.agent = agent
        self.down = down

    def request(
        self, method: bytes, uri: bytes, headers: Headers | None = None, bodyProducer: IBodyProducer | None = None
    ) -> "Deferred[IResponse]":
        if self.down in uri:
            return defer.fail(ConnectionRefusedError("refused"))
        return self.agent.request(method, uri, headers, bodyProducer)


class View:
    edge_id = "edge-a"

    def __init__(self, edges: dict[str, dict[str, Any]]) -> None:
        self.edges = edges
        self.loads: dict[str, dict[str, Any]] = {}

    def owner(self, node_id: str) -> str | None:
        return None


def caller_request() -> EdgeRequest:
    request: Any = DummyRequest([b"v1", b"runs", b"run-x"])
    request.requestHeaders.setRawHeaders(b"authorization", [b"Bearer caller-key"])
    request.requestHeaders.setRawHeaders(b"host", [b"edge-a.example"])
    request.requestHeaders.setRawHeaders(PEER_HEADER, [b"not-to-be-passed-on"])
    edge_request: EdgeRequest = request
    return edge_request


class PeerReaderTests(SynchronousTestCase):
    def test_asked_as_the_caller(self) -> None:
        """
        Every Edge asked answers; one that cannot be reached is left out.
        Each is sent the caller's credentials and the cluster's secret,
        never the caller's host nor a secret the caller sent.
        """
        peers = Peers({b"b.example": (200, {"id": "run-x"}), b"c.example": (404, {"error": {}})})
        traversal = RequestTraversalAgent(peers)
        reader = PeerReader(SECRET, DownAgent(traversal, b"d.example"), Clock())
        asked = [
            Forward("edge-b", "http://b.example", "test"),
            Forward("edge-c", "http://c.example", "test"),
            Forward("edge-d", "http://d.example", "test"),
        ]
        d = reader.ask(asked, caller_request(), b"/v1/runs/run-x")
        traversal.flush()
        answers = self.successResultOf(d)
        self.assertEqual(
            [(a.forward.edge_id, a.code, a.body) for a in answers],
            [("edge-b", 200, {"id": "run-x"}), ("edge-c", 404, {"error": {}})],
        )
        for host, uri, headers in peers.seen:
            self.assertEqual(uri, b"/v1/runs/run-x")
            self.assertEqual(headers.getRawHeaders(b"authorization"), [b"Bearer caller-key"])
            self.assertEqual(headers.getRawHeaders(PEER_HEADER), [SECRET.encode()])
            self.assertEqual(headers.getRawHeaders(b"host"), [host])

    def test_readable_peers(self) -> None:
        """
        The Edges asked: every other one that is up or draining (it still
        holds its runs), in the order of their ids; never this one.
        """
        view = View(
            {
                "edge-a": {"advertise": "http://a", "state": "up"},
                "edge-c": {"advertise": "http://c", "state": "draining"},
                "edge-b": {"advertise": "http://b", "state": "up"},
                "edge-d": {"state": "up"},
            }
        )
        self.assertEqual(
            [(f.edge_id, f.url) for f in readable_peers(view)], [("edge-b", "http://b"), ("edge-c", "http://c")]
        )
