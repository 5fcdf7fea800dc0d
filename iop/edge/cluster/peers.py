"""
Reads asked of every other Edge of the cluster (L{ICluster.ask_peers}):
what a caller's C{GET} of run history answers at each of them.

A run lives in the memory of the Edge that served it and in the store of
its Node, which only the Edge it is connected to can ask; a caller may be
at any Edge. So an Edge that does not hold a run asks the others, on
their peer listeners (the cluster's secret, the request marked forwarded:
each answers from what it holds and asks nobody else), with the caller's
own credentials: each Edge applies the caller key's isolation as it
would to the caller itself.
"""

import json
from typing import Any

from twisted.internet import defer
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.internet.protocol import Protocol
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.client import ResponseDone
from twisted.web.http_headers import Headers
from twisted.web.iweb import IAgent, IResponse

from iop.edge.cluster.etcd import body_producer
from iop.edge.cluster.forward import PEER_HEADER
from iop.edge.cluster.load import ClusterView
from iop.edge.http.request import EdgeRequest
from iop.edge.seam import Forward, PeerAnswer
from iop.httpclient import BytesBody
from iop.httpheaders import header_pairs, relay_headers

#: How long one Edge may take to answer a read, its whole body read (it
#: may ask its Nodes' stores, each within its own command timeout).
ASK_TIMEOUT_SEC = 10.0

#: Request headers not passed on: the caller's hop to this Edge, and what
#: describes a body (a read sends none).
_DROP = ("host", "content-length", "content-type", "transfer-encoding", PEER_HEADER.decode())

#: The states of an Edge that still holds runs to read.
_READABLE = ("up", "draining")


def readable_peers(membership: ClusterView) -> list[Forward]:
    """
    Every other Edge that is up or draining (a draining Edge still holds
    its runs), in the order of their ids.
    """
    peers = []
    for edge_id in sorted(membership.edges):
        info = membership.edges[edge_id]
        url = info.get("advertise")
        if edge_id != membership.edge_id and url and info.get("state", "up") in _READABLE:
            peers.append(Forward(edge_id, url, "a read of the whole cluster"))
    return peers


class PeerReader:
    """
    Asks other Edges' peer listeners for reads.

    @param secret: C{cluster.secret}, presented to every peer.
    @param agent: the C{IAgent} that connects to them.
    @param reactor: for the timeout.
    """

    log = Logger()

    def __init__(self, secret: str, agent: IAgent, reactor: IReactorTime) -> None:
        self.secret = secret.encode("utf-8")
        self.agent = agent
        self.reactor = reactor

    def ask(self, peers: list[Forward], request: EdgeRequest, path: bytes) -> "Deferred[list[PeerAnswer]]":
        """
        C{GET path} at each of C{peers} at once, as the caller of
        C{request}. @return: a Deferred firing with the answers that came,
        in the order of C{peers}.
        """
        headers = Headers()
        for name, value in relay_headers(header_pairs(request.requestHeaders), _DROP):
            headers.addRawHeader(name, value)
        headers.addRawHeader(PEER_HEADER, self.secret)
        asks = [self._ask(peer, headers, path) for peer in peers]

        def answered(results: list[tuple[bool, Any]]) -> list[PeerAnswer]:
            return [answer for ok, answer in results if ok and answer is not None]

        return defer.DeferredList(asks, consumeErrors=True).addCallback(answered)

    def _ask(self, peer: Forward, headers: Headers, path: bytes) -> "Deferred[PeerAnswer | None]":
        def respond(response: IResponse) -> "Deferred[PeerAnswer]":
            body = _Body()
            response.deliverBody(body)
            return body.done.addCallback(lambda data: PeerAnswer(peer, response.code, _json(data)))

        def failed(failure: Failure) -> None:
            self.log.info(
                "Edge {edge} did not answer {path}: {why}",
                edge=peer.edge_id,
                path=path.decode("latin-1"),
                why=failure.getErrorMessage() or type(failure.value).__name__,
            )
            return None

        d = self.agent.request(b"GET", peer.url.encode("utf-8") + path, headers, BytesBody(b""))
        answer = d.addCallback(respond)
        # On the whole answer: a peer that sends its headers and then
        # stalls its body is left out too (cancelling the chain cancels
        # the body's read, which closes its connection).
        answer.addTimeout(ASK_TIMEOUT_SEC, self.reactor)
        return answer.addErrback(failed)


class _Body(Protocol):
    """
    An answer's body, read whole into C{done}. Cancelling C{done} (the
    ask's timeout) closes the connection (C{readBody} cannot: the client's
    body transport does not abort).
    """

    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        self.done: Deferred[bytes] = Deferred(self._cancel)

    def _cancel(self, done: "Deferred[bytes]") -> None:
        if self.transport is not None:
            body_producer(self).stopProducing()

    def dataReceived(self, data: bytes) -> None:
        self.chunks.append(data)

    def connectionLost(self, reason: Failure | None = None) -> None:
        if self.done.called:
            return
        if reason is None or reason.check(ResponseDone):
            self.done.callback(b"".join(self.chunks))
        else:
            self.done.errback(reason)


def _json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except ValueError:
        return None
