"""
The Edge's HTTP site: a C{twisted.web} L{Site} that knows its open
connections, so that a draining Edge can close them once their last
response is written (flushed, not cut) instead of leaving that to the
reactor's shutdown, which may drop bytes still buffered.
"""

from twisted.internet import defer
from twisted.web.http import HTTPChannel
from twisted.web.server import Site


class _TrackedChannel(HTTPChannel):
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

    def __init__(self, resource, **kwargs):
        super().__init__(resource, **kwargs)
        self.displayTracebacks = False
        self.channels = set()
        self.closing = []

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
