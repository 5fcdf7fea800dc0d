"""
The Edge's HTTP site: a C{twisted.web} L{Site} that knows its open
connections, so that a draining Edge can close them once their last
response is written (flushed, not cut) instead of leaving that to the
reactor's shutdown, which may drop bytes still buffered; and that holds
every connection to the HTTP limits (L{iop.edge.http.limits}), refusing
connections beyond C{limits.max_http_connections} at once.
"""

from twisted.internet import defer
from twisted.web.server import Site

from iop.edge.http.limits import LimitedChannel, Refused
from iop.edge.limits import Limits
from iop.edge.throttle import LogThrottle


class _TrackedChannel(LimitedChannel):
    def connectionMade(self):
        super().connectionMade()
        self.site.channels.add(self)

    def connectionLost(self, reason):
        super().connectionLost(reason)
        self.site.channels.discard(self)
        if not self.site.channels:
            self.site.all_closed()


class EdgeSite(Site):
    # HTTP/1.1 only (no HTTP/2 negotiation), which is what the Edge serves.
    protocol = _TrackedChannel  # type: ignore[assignment]

    def __init__(self, resource, limits=None, **kwargs):
        super().__init__(resource, **kwargs)
        self.displayTracebacks = False
        self.limits = limits if limits is not None else Limits()
        self.channels = set()
        self.closing = []
        self.refusals = LogThrottle(
            self.reactor,
            "HTTP: {count} connection(s) closed at once so far: {cap} are open (limits.max_http_connections)",
        )
        self.slow_peers = LogThrottle(
            self.reactor,
            "HTTP: {count} slow connection(s) closed so far; the last: {what} not complete in {seconds:g}s ({key})",
        )

    def buildProtocol(self, addr):
        if len(self.channels) >= self.limits.max_http_connections:
            self.refusals.note(cap=self.limits.max_http_connections)
            return Refused()
        return super().buildProtocol(addr)

    def close_connections(self, clock, timeout):
        """
        Close every open connection once what it was sent is flushed;
        abort the ones still open after C{timeout} seconds.

        @return: a Deferred firing when all are closed.
        """
        if not self.channels:
            return defer.succeed(None)
        d = defer.Deferred()
        self.closing.append(d)
        for channel in list(self.channels):
            channel.transport.loseConnection()

        def abort(result, timeout):
            for channel in list(self.channels):
                channel.transport.abortConnection()

        return d.addTimeout(timeout, clock, onTimeoutCancel=abort)

    def all_closed(self):
        waiting, self.closing = self.closing, []
        for d in waiting:
            if not d.called:
                d.callback(None)
