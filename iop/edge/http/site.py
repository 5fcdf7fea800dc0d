"""
The Edge's HTTP site: a C{twisted.web} L{Site} that knows its open
connections, so that a draining Edge can close them once their last
response is written (flushed, not cut) instead of leaving that to the
reactor's shutdown, which may drop bytes still buffered; and that holds
every connection to the HTTP limits (L{iop.edge.http.limits}): at most
C{limits.max_http_connections} at once, and per source address at most
C{limits.max_http_connections_per_address} being read, the others of
that address waiting unread in its line (L{iop.edge.doors}).
"""

from collections import Counter
from typing import Any, cast

from twisted.internet import defer
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IAddress, IPushProducer, IReactorTime
from twisted.internet.protocol import Protocol, connectionDone
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web import http
from twisted.web.resource import IResource
from twisted.web.server import Site

from iop.edge.doors import FULL, WAITED_OUT, Doors, Ticket
from iop.edge.http.common import cut_off
from iop.edge.http.limits import LimitedChannel
from iop.edge.http.request import EdgeRequest
from iop.edge.limits import Limits
from iop.edge.throttle import LogThrottle
from iop.edge.tlsdoors import Refused


class _TrackedChannel(LimitedChannel):
    """
    A connection the site keeps track of, with its place at the doors
    (C{ticket}): one that waits in its address's line is not read (its
    transport is paused) until it goes in.
    """

    site: "EdgeSite"
    ticket: Ticket | None = None

    def connectionMade(self) -> None:
        super().connectionMade()
        self.site.channels.add(self)
        if self.ticket is not None and not self.ticket.inside:
            self._reading().pauseProducing()

    def _reading(self) -> IPushProducer:
        """
        The connection as the producer of what this channel reads (a TCP
        or TLS transport is one).
        """
        return cast(IPushProducer, self.transport)

    def go_in(self) -> None:
        """
        Its wait is over: read it (its header deadline runs on).
        """
        self._reading().resumeProducing()

    def put_out(self) -> None:
        cut_off(self.transport)

    def _too_slow(self, what: str, seconds: float) -> None:
        if self.ticket is not None and not self.ticket.inside:
            self._deadline = None
            self.site.doors.leave(self.ticket)
            self.site.note_refused(WAITED_OUT)
            cut_off(self.transport)
            return
        self.site.refused["header_timeout_sec" if what == "headers" else "body_timeout_sec"] += 1
        super()._too_slow(what, seconds)

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        super().connectionLost(reason)
        if self.ticket is not None:
            self.site.doors.leave(self.ticket)
        self.site.channels.discard(self)
        if not self.site.channels:
            self.site.all_closed()


class EdgeSite(Site):
    # HTTP/1.1 only (no HTTP/2 negotiation), which is what the Edge serves.
    protocol = _TrackedChannel  # type: ignore[assignment]
    requestFactory = EdgeRequest

    access = Logger(namespace="iop.edge.access")

    #: The listener's endpoint wraps each connection (C{ssl:}): a refused
    #: one gets a L{Refused} protocol, not none (L{iop.edge.tlsdoors}).
    refuse_with_protocol = False

    def __init__(
        self,
        resource: IResource,
        limits: Limits | None = None,
        access_log: bool = True,
        per_address: bool = True,
        **kwargs: Any,
    ) -> None:
        """
        @param per_address: whether C{limits.max_http_connections_per_address}
            applies (not on the port other Edges of a cluster forward to:
            all of an Edge's forwarded requests come from one address).
        """
        # A POST body is the API's JSON: twisted.web's HTML form parsing
        # would read its Content-Type as an email header every time.
        super().__init__(resource, parsePOSTFormSubmission=False, **kwargs)
        self.access_log = access_log
        self.displayTracebacks = False
        self.limits = limits if limits is not None else Limits()
        self.channels: set[_TrackedChannel] = set()
        self.closing: list[Deferred[None]] = []
        #: Connections refused or closed before being served, by reason
        #: (C{iop_edge_refusals_total}).
        self.refused: Counter[str] = Counter()
        self.doors = Doors(
            self.limits.max_http_connections_per_address if per_address else 0,
            self.limits.max_http_connections,
            self.note_refused,
        )
        self.refusals = LogThrottle(
            self.reactor,
            "HTTP: {count} connection(s) closed at once so far: {cap} are open (limits.max_http_connections)",
        )
        self.address_refusals = LogThrottle(
            self.reactor,
            "HTTP: {count} connection(s) refused or put out so far for an address over"
            " limits.max_http_connections_per_address ({cap}); the last: {reason}",
        )
        self.slow_peers = LogThrottle(
            self.reactor,
            "HTTP: {count} slow connection(s) closed so far; the last: {what} not complete in {seconds:g}s ({key})",
        )

    def log(self, request: http.Request) -> None:
        """
        One structured line per request when C{access_log} is on: method,
        path, status, duration and what the request did (model, node,
        provider, tokens); nothing otherwise.
        """
        if not self.access_log:
            return
        arrived = getattr(request, "arrived", None)
        duration = self.reactor.seconds() - arrived if arrived is not None else 0.0
        notes = getattr(request, "notes", {})
        self.access.info(
            "{method} {path} {status} {duration_ms:.0f}ms{details}",
            method=request.method.decode("ascii", "replace"),
            path=request.path.decode("utf-8", "replace")[:200],
            status=request.code,
            duration_ms=duration * 1000,
            details="".join(f" {k}={v}" for k, v in notes.items()),
            **notes,
        )

    def note_refused(self, reason: str) -> None:
        """
        Count (and log, at a bounded rate) a connection refused or closed
        before it was served, by C{reason}.
        """
        self.refused[reason] += 1
        if reason == FULL:
            self.refusals.note(cap=self.limits.max_http_connections)
        else:
            self.address_refusals.note(cap=self.doors.per_address, reason=reason)

    def buildProtocol(self, addr: IAddress | None) -> Protocol | None:  # type: ignore[override]
        # (twisted types a site's protocols as its HTTP/2-negotiating
        # wrapper; the Edge's are its own channels.) A connection refused
        # at the doors gets no protocol: the listening port closes its
        # socket at once, inside its accept loop, so that a flood of them
        # never holds file descriptors until the next turn (an aborted
        # transport closes only then, and one accept loop may take
        # hundreds).
        channel = cast(_TrackedChannel, super().buildProtocol(addr))
        channel.ticket = self.doors.arrive(getattr(addr, "host", None), channel.go_in, channel.put_out)
        if channel.ticket is None:
            return Refused() if self.refuse_with_protocol else None
        return channel

    def close_connections(self, clock: IReactorTime, timeout: float) -> Deferred[None]:
        """
        Close every open connection once what it was sent is flushed;
        abort the ones still open after C{timeout} seconds.

        @return: a Deferred firing when all are closed.
        """
        if not self.channels:
            return defer.succeed(None)
        d: Deferred[None] = Deferred()
        self.closing.append(d)
        for channel in list(self.channels):
            # The channel's own close, not its transport's: a TLS transport
            # does not close while the channel is still registered as its
            # producer, and an idle keep-alive caller would be left waiting
            # for the abort.
            channel.loseConnection()

        def abort(result: object, timeout: float) -> None:
            for channel in list(self.channels):
                cut_off(channel.transport)

        return d.addTimeout(timeout, clock, onTimeoutCancel=abort)

    def all_closed(self) -> None:
        waiting, self.closing = self.closing, []
        for d in waiting:
            if not d.called:
                d.callback(None)
