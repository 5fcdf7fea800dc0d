"""
The Edge's HTTP request: twisted.web's, with what the surfaces note on it
as they handle it (route parameters, the caller's key, whether it came
from another Edge of the cluster, what the access log and the refusal
metrics say about it).

The surfaces are typed against L{EdgeRequest}. They also work on a plain
C{twisted.web.server.Request} (the site of treq's C{StubTreq} in tests),
which carries the same attributes once they are set; what a surface may
read before anything set it is read with C{getattr} and a default.
"""

from collections.abc import Callable
from typing import Any, Protocol, cast

from twisted.internet.interfaces import IReactorTime
from twisted.web.server import Request, Site

from iop.edge.keys import KeySpec
from iop.edge.timing import Timing, server_timing


class _OnSite(Protocol):
    """
    A channel a L{Site} built (twisted.web gives it its C{site}).
    """

    site: Site


class EdgeRequest(Request):
    """
    twisted.web's request, for an API whose bodies are JSON (its site,
    L{iop.edge.http.site.EdgeSite}, never parses a POST body as an HTML
    form), that notes when it arrived and what it did (C{notes}: model,
    node, provider, tokens) for the access log.

    @ivar path_params: the route's parameters (L{iop.edge.http.root.Router}).
    @ivar caller_key: the key the request was admitted with, or C{None}
        when the caller API is open.
    @ivar sees_all: whether it may see every key's runs (an admin key, or
        an open caller API).
    @ivar key_hold: what ends its count against its key's
        C{max_concurrent}, while it holds one.
    @ivar raw_body: the body bytes as the caller sent them.
    @ivar iop_forwarded: whether another Edge of the cluster forwarded it
        (L{iop.edge.cluster.forward.PeerGate}).
    @ivar refused: the error code of work the Edge refused, for the access
        log and C{iop_edge_refusals_total}.
    @ivar timing: where its time went (L{iop.edge.timing.Timing}), sent as
        its C{Server-Timing} header with the answer's headers.
    @ivar gateway_seconds: the gateway's own time by then, for
        C{iop_edge_gateway_seconds} (C{None} until the headers are sent).
    @ivar traceparent: the trace context of its span, when tracing is on
        (L{iop.edge.tracing}).
    @ivar waiting: a stream told its place in the queue whose work has not
        started: what it writes is the queue's word, not the answer's
        first byte (C{iop_edge_http_ttfb_seconds}).
    """

    path_params: dict[str, str]
    caller_key: KeySpec | None
    sees_all: bool
    key_hold: Callable[[], None] | None
    raw_body: bytes
    iop_forwarded: bool
    refused: str
    traceparent: str

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.arrived: float | None = None
        self.notes: dict[str, object] = {}
        self.timing = Timing()
        self.gateway_seconds: float | None = None
        self.waiting = False

    def requestReceived(self, command: bytes, path: bytes, version: bytes) -> None:
        self.arrived = self.timing.arrived = self._clock().seconds()
        super().requestReceived(command, path, version)

    def _clock(self) -> IReactorTime:
        return cast(IReactorTime, cast(_OnSite, self.channel).site.reactor)

    def write(self, data: bytes) -> None:
        if not self.startedWriting:
            self._time_headers()
        super().write(data)

    def _time_headers(self) -> None:
        """
        The headers are about to go out: say where the time went, after
        any C{Server-Timing} already there (a provider's own, relayed by a
        tunnel, or the owning Edge's on an answer forwarded from it).
        """
        if self.channel is None:
            return
        now = self._clock().seconds()
        self.responseHeaders.addRawHeader(b"server-timing", server_timing(self.timing.parts(now)))
        self.gateway_seconds = self.timing.gateway_seconds(now)


#: The methods named as themselves in metrics and spans; any other a
#: stranger sends is C{_OTHER} (OpenTelemetry's word), so that it cannot
#: make a new series of a metric.
KNOWN_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


def method_label(request: Request) -> str:
    """
    C{request}'s method as a metric label or span attribute.
    """
    method = request.method.decode("ascii", "replace")
    return method if method in KNOWN_METHODS else "_OTHER"
