"""
A request that another Edge of the cluster should serve
(L{iop.edge.cluster.load.Forward}), proxied to that Edge's peer listener
(C{listen.peer}) and its answer streamed back to the caller unchanged.

The peer listener is the owning Edge's own HTTP API behind
L{PeerGate}: it takes only requests carrying the cluster's secret in
L{PEER_HEADER}, and places them there and nowhere else (a forwarded
request is never forwarded again). The owner admits the work with its
own leases and queue; the proxy relays status, headers (minus hop-by-hop
ones) and body bytes as they come, with backpressure (the peer
connection is the producer of the caller's response), so a tunnel's bytes
stay byte-identical and a stream's events keep their order. A caller who
goes away aborts the peer connection, which cancels the work at the
owner as for any caller.

The answer has no deadline of its own (a request may wait in the owner's
queue, a non-streamed answer comes whole at its end, a stream may last
long): a peer that took the request and then says nothing is noticed by
the cluster instead. Once its membership key is gone (its lease expired:
it stopped keeping it alive; or it left), L{Forwarder.peer_gone} ends
every relay from that peer: one still waiting for its answer fails with
503 C{forward_failed} at once; one whose answer is streaming is given
L{LEFT_GRACE_SEC} to end, then has the peer's connection closed and the
caller's cut off mid-answer (a chunked answer without its last chunk), so
a stream whose peer went silent does not hold its caller forever, and the
caller can tell it was cut. The grace is for a peer that left cleanly: a
draining Edge leaves once every answer is written, not once a slow
caller has read it, and flushes its connections for a while after. A
peer whose lease ended closes every Node link once etcd tells it so (its
Nodes register again, maybe elsewhere), which ends its streams anyway; a
native run's caller resumes with C{Last-Event-ID} at any Edge.

This is a surface's helper (it speaks HTTP); the service only decides
that a request goes elsewhere.
"""

import hmac
from collections.abc import Callable

from twisted.internet import defer
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.internet.protocol import Protocol
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.client import ResponseDone
from twisted.web.http import PotentialDataLoss
from twisted.web.http_headers import Headers
from twisted.web.iweb import IAgent, IResponse
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET

from iop.edge.cluster.etcd import body_producer
from iop.edge.cluster.load import Forward
from iop.edge.errors import ServiceError
from iop.edge.http.common import answered_or_gone, cut_off, relay_response_headers, release_producer, write_error
from iop.edge.http.request import EdgeRequest
from iop.edge.http.validate import HTTPError
from iop.httpclient import BytesBody, LeanConnectionPool, lean_agent
from iop.httpheaders import header_pairs, relay_headers

#: The header that carries the cluster's secret on a forwarded request.
PEER_HEADER = b"x-iop-peer-secret"

#: Request headers the proxy does not pass on: they describe the caller's
#: hop to this Edge (the body is sent whole, its length recomputed).
_DROP_REQUEST = ("host", "content-length", PEER_HEADER.decode())

#: How long connecting to the owning Edge may take. The answer itself has
#: no deadline here: the request may wait in the owner's queue, which
#: answers its own queue timeout; one the owner never answers ends when
#: the owner leaves the cluster (L{Forwarder.peer_gone}).
CONNECT_TIMEOUT_SEC = 10.0

#: How long an answer streaming from a peer that left the cluster may
#: still take to end before it is cut off. A peer that drains leaves once
#: its answers are written and then flushes its connections for 5 s
#: (C{iop.edge.drain.FLUSH_TIMEOUT_SEC}) before it closes them: what it
#: wrote within that reaches the caller whole.
LEFT_GRACE_SEC = 10.0


class PeerGate(Resource):
    """
    The root of C{listen.peer}: a request without the cluster's secret is
    a 401; one with it is marked forwarded (placed here only, its key's
    limits already held at the Edge that forwarded it) and routed as on
    the HTTP port.
    """

    isLeaf = True
    log = Logger()

    def __init__(self, root: Resource, secret: str) -> None:
        super().__init__()
        self.root = root
        self.secret = secret.encode("utf-8")

    def render(self, request: EdgeRequest) -> bytes | int:
        presented = request.getHeader(PEER_HEADER) or b""
        if not hmac.compare_digest(presented, self.secret):
            write_error(request, HTTPError("unauthorized", "not a peer of this Edge cluster", code="not_a_peer"))
            return NOT_DONE_YET
        # The secret is for this hop only: it must never travel on (a
        # tunnel passes the caller's headers to the provider).
        request.requestHeaders.removeHeader(PEER_HEADER)
        request.iop_forwarded = True
        return self.root.render(request)


class Forwarder:
    """
    Proxies requests to other Edges' peer listeners.

    @param secret: C{cluster.secret}.
    @param agent: an C{IAgent}; by default one with a persistent pool.

    @ivar relays: C{{edge_id: relays}}, the requests forwarded to each Edge
        whose relay has not ended: waiting for its answer or streaming it.
    """

    log = Logger()

    def __init__(self, secret: str, reactor: IReactorTime, agent: IAgent | None = None) -> None:
        self.secret = secret.encode("utf-8")
        self.reactor = reactor
        if agent is None:
            agent = lean_agent(reactor, LeanConnectionPool(reactor, persistent=True), CONNECT_TIMEOUT_SEC)
        self.agent = agent
        self.relays: dict[str, set[_Relay]] = {}

    def proxy(self, request: EdgeRequest, forward: Forward) -> Deferred[None]:
        """
        Send C{request} (a C{twisted.web} request whose body was read) to
        C{forward.url} and relay the answer.
        """
        if answered_or_gone(request):
            # Its caller hung up while this Edge looked for where to send
            # it (a run's holder is asked of every Edge first): nobody
            # would read the answer, and twisted.web closed its body.
            self.log.debug(
                "not forwarding {uri} to Edge {edge}: its caller went away", uri=request.uri, edge=forward.edge_id
            )
            return defer.succeed(None)
        assert request.content is not None  # (its body was read)
        request.content.seek(0)
        body = request.content.read()
        headers = Headers()
        for name, value in relay_headers(header_pairs(request.requestHeaders), _DROP_REQUEST):
            headers.addRawHeader(name, value)
        headers.addRawHeader(PEER_HEADER, self.secret)
        url = forward.url.encode("utf-8") + request.uri
        self.log.debug("forwarding {uri} to Edge {edge}", uri=request.uri, edge=forward.edge_id)
        relay = _Relay(request, forward, self._forget, self.reactor)
        timing = getattr(request, "timing", None)
        if timing is not None:
            timing.forwarded = self.reactor.seconds()
        self.relays.setdefault(forward.edge_id, set()).add(relay)
        d = self.agent.request(request.method, url, headers, BytesBody(body))
        relay.pending = d
        request.notifyFinish().addErrback(relay.caller_gone)
        return d.addCallbacks(relay.respond, relay.failed)

    def _forget(self, relay: "_Relay") -> None:
        """
        C{relay} ended (each does once, on whichever path): nothing is kept
        for it.
        """
        edge_id = relay.forward.edge_id
        relays = self.relays.get(edge_id)
        if relays is not None:
            relays.discard(relay)
            if not relays:
                del self.relays[edge_id]

    def peer_gone(self, edge_id: str) -> None:
        """
        Edge C{edge_id} left the cluster (its membership key is gone):
        every relay from it ends. One still waiting for its answer fails
        with 503 C{forward_failed}; one streaming it is cut off unless it
        ends within L{LEFT_GRACE_SEC}.
        """
        for relay in list(self.relays.get(edge_id, ())):
            relay.peer_gone()


class _Relay(Protocol):
    """
    One forwarded answer on its way back: status and headers, then the
    body as it comes.

    @ivar over: whether the relay ended (the caller went, the answer ended
        or failed, or the peer left): nothing more goes to the caller, and
        the L{Forwarder} was told (once: C{forget(relay)}).
    """

    log = Logger()

    def __init__(
        self, request: EdgeRequest, forward: Forward, forget: Callable[["_Relay"], object], clock: IReactorTime
    ) -> None:
        self.request = request
        self.forward = forward
        self.forget = forget
        self.clock = clock
        self.pending: Deferred[IResponse] | None = None
        self.over = False
        self.why: str | None = None
        self.cut_timer: IDelayedCall | None = None

    def _end(self) -> bool:
        """
        End the relay, once. @return: whether it was still going (the
        caller is then this path's to answer or cut).
        """
        if self.over:
            return False
        self.over = True
        if self.cut_timer is not None and self.cut_timer.active():
            self.cut_timer.cancel()
        self.forget(self)
        return True

    def caller_gone(self, failure: Failure) -> None:
        if not self._end():
            return
        if self.pending is not None and not self.pending.called:
            self.pending.cancel()
        elif self.transport is not None:
            body_producer(self).stopProducing()

    def peer_gone(self) -> None:
        """
        The peer left the cluster. Still waiting for its answer: give up
        on it (503). Its answer streaming: let it end within
        L{LEFT_GRACE_SEC}, else L{cut}.
        """
        if self.pending is not None and not self.pending.called:
            self.why = "it left the cluster (its etcd lease ended) before it answered"
            self.pending.cancel()
            return
        if not self.over and self.cut_timer is None:
            self.cut_timer = self.clock.callLater(LEFT_GRACE_SEC, self.cut)

    def cut(self) -> None:
        """
        The answer of a peer that left did not end in time: close the
        peer's connection and cut the caller's, with no end of the answer
        written (a chunked one lacks its last chunk), so the caller sees it
        truncated: nothing else would end it if the peer's connection
        stays up, silent.
        """
        if not self._end():
            return
        self.log.warn(
            "forwarded answer from Edge {edge} cut off: it left the cluster (its etcd lease ended)"
            " and the answer did not end within {grace:.0f} s",
            edge=self.forward.edge_id,
            grace=LEFT_GRACE_SEC,
        )
        release_producer(self.request)
        if self.transport is not None:
            body_producer(self).stopProducing()
        if not self.request.finished:
            cut_off(self.request.channel.transport)

    def respond(self, response: IResponse) -> None:
        self.pending = None
        if self.over:
            response.deliverBody(_Discard())
            return
        request = self.request
        request.setResponseCode(response.code, response.phrase)
        relay_response_headers(request, header_pairs(response.headers))
        response.deliverBody(self)

    def connectionMade(self) -> None:
        if self.over:
            body_producer(self).stopProducing()
            return
        # The peer's connection is the producer of the caller's response:
        # a caller that does not read pauses the owner's stream.
        self.request.registerProducer(body_producer(self), True)

    def dataReceived(self, data: bytes) -> None:
        if not self.over:
            self.request.write(data)

    def connectionLost(self, reason: Failure | None = None) -> None:
        if not self._end() or self.request.finished:
            return
        release_producer(self.request)
        if reason is None or reason.check(ResponseDone, PotentialDataLoss):
            self.request.finish()
        else:
            # Cut mid-answer: the only honest signal left is a cut here too.
            self.log.info(
                "forwarded answer from Edge {edge} cut off: {why}",
                edge=self.forward.edge_id,
                why=reason.getErrorMessage(),
            )
            cut_off(self.request.channel.transport)

    def failed(self, failure: Failure) -> None:
        self.pending = None
        if not self._end() or self.request.finished:
            return None
        why = self.why or _reason(failure)
        self.log.warn("forwarding to Edge {edge} failed: {why}", edge=self.forward.edge_id, why=why)
        write_error(
            self.request,
            ServiceError(
                "unavailable",
                f"Edge {self.forward.edge_id}, which has room for this request, did not answer: {why}",
                code="forward_failed",
            ),
        )
        return None


def _reason(failure: Failure) -> str:
    """
    Why a request to a peer failed, in words for the caller: twisted's
    client wraps a lost connection in an exception whose message is the
    repr of the failures it carries (C{ResponseNeverReceived}), which
    would show the caller Python objects; their own messages are said.
    """
    reasons = getattr(failure.value, "reasons", None)
    if reasons:
        return "; ".join(_reason(reason) for reason in reasons)
    return failure.getErrorMessage() or type(failure.value).__name__


class _Discard(Protocol):
    def connectionMade(self) -> None:
        body_producer(self).stopProducing()
