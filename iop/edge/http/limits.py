"""
What one HTTP connection may cost the Edge (C{limits:} in C{edge.yaml};
README, "Security").

L{LimitedChannel} is the Edge's C{HTTPChannel} with three deadlines and a
body cap that twisted.web does not have (its idle timeout restarts on
every byte, so a peer trickling one header line every few seconds stays
forever):

  - C{header_timeout_sec}: a request's headers must be complete this long
    after the connection opened, or after the previous response ended
    (so an idle keep-alive connection is closed then too, and so is a
    closing one whose peer has not read the answer by then);
  - C{body_timeout_sec}: its body must be complete this long after its
    headers;
  - C{max_body_bytes}: a C{Content-Length} above it is answered 413 and the
    connection closed before any of the body is read; a chunked body is cut
    the same way once it passes the limit.

While a request is being answered (a stream may last long) no deadline
runs. L{EdgeSite} adds C{max_http_connections}: beyond it, a new connection
is closed at once.
"""

import json
from functools import partial
from typing import Protocol as Structure

from twisted.internet.interfaces import IDelayedCall
from twisted.internet.protocol import connectionDone
from twisted.python.failure import Failure
from twisted.web.http import HTTPChannel, Request

from iop.edge.http.common import cut_off, error_body
from iop.edge.http.validate import HTTPError
from iop.edge.limits import Limits
from iop.edge.throttle import LogThrottle


class LimitedSite(Structure):
    """
    What a L{LimitedChannel} needs of its site (L{iop.edge.http.site.EdgeSite}).
    """

    limits: Limits
    slow_peers: LogThrottle


class LimitedChannel(HTTPChannel):
    """
    An C{HTTPChannel} under the site's L{iop.edge.limits.Limits}
    (C{self.site.limits}); slow peers are counted in
    C{self.site.slow_peers}.
    """

    site: LimitedSite
    _deadline: IDelayedCall | None = None
    _refused_body = False
    _body_bytes = 0

    def connectionMade(self) -> None:
        super().connectionMade()
        self._expect("headers", self.site.limits.header_timeout_sec)

    def _expect(self, what: str, seconds: float) -> None:
        self._disarm()
        self._deadline = self.callLater(seconds, partial(self._too_slow, what, seconds))

    def _disarm(self) -> None:
        if self._deadline is not None and self._deadline.active():
            self._deadline.cancel()
        self._deadline = None

    def _too_slow(self, what: str, seconds: float) -> None:
        self._deadline = None
        key = "header_timeout_sec" if what == "headers" else "body_timeout_sec"
        self.site.slow_peers.note(what=what, seconds=seconds, key=key)
        cut_off(self.transport)

    def allHeadersReceived(self) -> None:
        limit = self.site.limits.max_body_bytes
        if self.length is not None and self.length > limit:
            self._refuse_body(f"request body of {self.length} bytes exceeds {limit} bytes (limits.max_body_bytes)")
            return
        super().allHeadersReceived()
        self._body_bytes = 0
        self._expect("body", self.site.limits.body_timeout_sec)

    def rawDataReceived(self, data: bytes) -> None:
        if self._refused_body:
            return
        if not self._handlingRequest and self.length is None:
            # A chunked body: count it as it comes.
            self._body_bytes += len(data)
            limit = self.site.limits.max_body_bytes
            if self._body_bytes > limit:
                self._refuse_body(f"request body exceeds {limit} bytes (limits.max_body_bytes)")
                return
        super().rawDataReceived(data)
        if self._handlingRequest and self._waitingForTransport:
            self._bound_pipelined()

    def _bound_pipelined(self) -> None:
        """
        While a request is answered, twisted.web keeps what the peer sends
        next for later and stops reading past a small bound, but not when
        the transport has paused the channel (the peer reads nothing of
        the answer): then it kept everything, as fast as the peer sent it.
        Stop reading past the same bound then too; reading resumes when
        the answer is done and the transport takes writes again.
        """
        if sum(map(len, self._dataBuffer)) > self._optimisticEagerReadSize:
            self._networkProducer.pauseProducing()

    def allContentReceived(self) -> None:
        self._disarm()
        super().allContentReceived()

    def requestDone(self, request: Request) -> None:
        # Armed first: a pipelined request handled within requestDone moves
        # on to its own deadline or to none. A closing connection gets it
        # too: its close waits for the answer to be read, and a peer that
        # never reads it would hold the connection and its bytes.
        self._expect("headers", self.site.limits.header_timeout_sec)
        super().requestDone(request)

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self._disarm()
        super().connectionLost(reason)

    def _refuse_body(self, message: str) -> None:
        """
        Answer 413 without reading the body, and close. The close waits
        for the answer to leave (and on TLS for the peer's own close), so
        the header deadline runs again from here, as after any answer: a
        peer that never reads it does not hold the connection for ever.
        """
        self._refused_body = True
        self._expect("headers", self.site.limits.header_timeout_sec)
        error = HTTPError("too_large", message)
        data = json.dumps(error_body(error.kind, error.message, error.code)).encode()
        transport = self.transport
        assert transport is not None  # (a channel receiving bytes is connected)
        transport.write(
            b"HTTP/1.1 413 Content Too Large\r\n"
            b"content-type: application/json\r\n"
            b"content-length: %d\r\n"
            b"connection: close\r\n\r\n" % len(data) + data
        )
        # (The channel's close: a TLS transport does not close while the
        # channel is registered as its producer.)
        self.loseConnection()
