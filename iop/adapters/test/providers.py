"""
Scripted provider endpoints on real loopback sockets, for adapter tests.

Real sockets rather than in-memory transports because what the tests must
prove is about connections: that a cancelled run closes the provider
connection, and that a tunnel relays the bytes the server wrote. Each
server waits, at cleanup, until every connection it accepted is closed, so
no test leaves the reactor dirty.
"""

import json
from typing import cast

from twisted.internet import defer, reactor
from twisted.internet.address import IPv4Address
from twisted.internet.interfaces import IListeningPort
from twisted.internet.protocol import ServerFactory, connectionDone
from twisted.internet.task import deferLater
from twisted.python.failure import Failure
from twisted.web.http import HTTPChannel
from twisted.web.resource import IResource, Resource
from twisted.web.server import NOT_DONE_YET, Request, Site

from iop.run import RunEventData


class _Channel(HTTPChannel):
    site: "_Site"

    def connectionMade(self) -> None:
        super().connectionMade()
        self.lost: defer.Deferred[None] = defer.Deferred()
        self.site.channels.append(self)

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        super().connectionLost(reason)
        self.lost.callback(None)


class _Site(Site):
    """
    A site that keeps every connection it accepted (C{channels}), so that
    cleanup can wait for them to close.
    """

    # (twisted types a site's protocols as its HTTP/2-negotiating wrapper.)
    protocol = _Channel  # type: ignore[assignment]
    noisy = False

    def __init__(self, resource: IResource) -> None:
        super().__init__(resource)
        self.channels: list[_Channel] = []


def _port_number(port: IListeningPort) -> int:
    return cast(IPv4Address, port.getHost()).port


class Script(Resource):
    """
    Answers every request with C{status}, C{headers} and the byte strings
    in C{chunks}, each written separately. With C{hold}, the response is
    left open after the chunks (to test cancellation and deadlines);
    C{headers_only} holds before writing anything, so not even the headers
    are sent; with C{cut}, the connection is closed after the chunks
    without ending the response (a body cut short). A held response can
    be written on with L{write}.

    @ivar requests: C{(method, path, headers, body)} of each request.
    @ivar arrived: fires with the request when one arrives.
    @ivar closed_early: fires with the request when its connection closed
        before the response finished.
    """

    isLeaf = True

    def __init__(self, status=200, headers=(), chunks=(), hold=False, headers_only=False, cut=False):
        super().__init__()
        self.status = status
        self.headers = list(headers)
        self.chunks = list(chunks)
        self.hold = hold or headers_only
        self.headers_only = headers_only
        self.cut = cut
        self.held: Request | None = None
        self.requests: list[tuple[str, str, dict[str, list[str]], bytes]] = []
        self.arrived: defer.Deferred[Request] = defer.Deferred()
        self.closed_early: defer.Deferred[Request] = defer.Deferred()

    def render(self, request):
        body = request.content.read()
        self.requests.append(
            (
                request.method.decode(),
                request.uri.decode(),
                {k.decode().lower(): [v.decode() for v in vs] for k, vs in request.requestHeaders.getAllRawHeaders()},
                body,
            )
        )
        request.setResponseCode(self.status)
        for name, value in self.headers:
            request.responseHeaders.addRawHeader(name, value)
        if not self.headers_only:
            for chunk in self.chunks:
                request.write(chunk)
        if not self.arrived.called:
            self.arrived.callback(request)
        if self.hold or self.cut:
            request.notifyFinish().addErrback(lambda _: self.closed_early.callback(request))
        if self.cut:
            # Unlike abortConnection, what was written goes out first.
            request.channel.transport.loseConnection()
            return NOT_DONE_YET
        if self.hold:
            self.held = request
            return NOT_DONE_YET
        request.finish()
        return NOT_DONE_YET

    def write(self, *chunks: bytes) -> None:
        """
        Write more of the held response (its headers first, if they were
        held too).
        """
        assert self.held is not None, "the response is held"
        for chunk in chunks:
            self.held.write(chunk)

    def json_body(self, index=-1):
        return json.loads(self.requests[index][3])


class Sequence(Resource):
    """
    The n-th request gets the n-th resource (the last one for all later
    requests): a provider that fails, then recovers.
    """

    isLeaf = True

    def __init__(self, *resources):
        super().__init__()
        self.resources = resources
        self.count = 0

    def render(self, request):
        resource = self.resources[min(self.count, len(self.resources) - 1)]
        self.count += 1
        return resource.render(request)


class Routes(Resource):
    """
    A tree of L{Script}s by path, e.g. C{Routes({"/v1/models": Script()})}.
    """

    def __init__(self, routes):
        super().__init__()
        self.routes = routes

    def getChild(self, name, request):
        return self.routes.get(request.path.decode(), Script(status=404, chunks=[b'{"error": "no route"}']))


def serve(testcase, resource):
    """
    Listen on 127.0.0.1:0 with C{resource}; return the base URL
    C{http://127.0.0.1:PORT}. At cleanup, stop listening and wait for all
    accepted connections to close.
    """
    site = _Site(resource)
    # (a Site is a ServerFactory of twisted's HTTP channel type, which
    # listenTCP's type does not accept.)
    port = reactor.listenTCP(0, site, interface="127.0.0.1")  # type: ignore[arg-type]

    @defer.inlineCallbacks
    def close():
        yield port.stopListening()
        for channel in site.channels:
            if channel.transport is not None and not channel.lost.called:
                channel.transport.loseConnection()
            yield channel.lost

    testcase.addCleanup(close)
    return f"http://127.0.0.1:{_port_number(port)}"


def closed_port(testcase):
    """
    A loopback URL where nothing listens: connections are refused.
    """
    port = reactor.listenTCP(0, ServerFactory(), interface="127.0.0.1")
    number = _port_number(port)
    port.stopListening()
    return f"http://127.0.0.1:{number}"


def moment() -> "defer.Deferred[None]":
    """
    A short real wait: for bytes on their way over the loopback socket, or
    for the chunk that fired a test's waiter to be handled to its end
    before the test moves a clock.
    """
    return deferLater(reactor, 0.05, lambda: None)


def sse(*chunks, done=True):
    """
    An OpenAI SSE body, one C{data:} event per chunk dict.
    """
    events = [b"data: " + json.dumps(chunk).encode() + b"\n\n" for chunk in chunks]
    if done:
        events.append(b"data: [DONE]\n\n")
    return events


def chunk(content=None, reasoning=None, reasoning_key="reasoning_content", finish=None, usage=None, model="m"):
    """
    One C{chat.completion.chunk} dict.
    """
    delta = {}
    if reasoning is not None:
        delta[reasoning_key] = reasoning
    if content is not None:
        delta["content"] = content
    choices = (
        []
        if usage is not None and content is None and reasoning is None and finish is None
        else [{"index": 0, "delta": delta, "finish_reason": finish}]
    )
    data = {"id": "chatcmpl-test", "object": "chat.completion.chunk", "created": 0, "model": model, "choices": choices}
    if usage is not None:
        data["usage"] = usage
    return data


class Events:
    """
    An C{emit} callable that records events and can wait for one type.
    """

    def __init__(self) -> None:
        self.events: list[RunEventData] = []
        self._waiting: dict[str, defer.Deferred[RunEventData]] = {}

    def __call__(self, event: RunEventData) -> None:
        self.events.append(event)
        waiter = self._waiting.pop(event.type, None)
        if waiter is not None:
            waiter.callback(event)

    def first(self, type: str) -> "defer.Deferred[RunEventData]":
        """
        A Deferred firing with the first event of C{type} from now on.
        """
        d: defer.Deferred[RunEventData] = defer.Deferred()
        self._waiting[type] = d
        return d

    def types(self) -> list[str]:
        return [e.type for e in self.events]

    def text(self, type: str = "delta") -> str:
        return "".join(e.text for e in self.events if e.type == type)
