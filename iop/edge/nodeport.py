"""
The Edge's Node port: the factory of Node connections, and what a
connection may cost before its registration is accepted.

A stranger who opens connections to the Node port gets, per connection, a
small frame limit (C{limits.preauth_frame_bytes}: a larger length prefix
closes the connection before its body is read) and a deadline
(C{register_timeout_sec}: a connection whose registration is not accepted
by then is closed, whatever it sends). Once a registration is accepted,
the connection has the full frame limit and no deadline.

Connections without an accepted registration go through the doors
(L{iop.edge.doors}): one source address has at most
C{limits.max_unregistered_per_address} of them being read at once, its
others wait unread in its line; all addresses together have at most
C{limits.max_unregistered_connections} inside or in a line, and beyond
that newcomers wait unread in the hall (at most L{HALL_FACTOR} times as
many) instead of being reset, so a herd of Nodes redialling at once after
an Edge restart gets in in order. A waiting connection is closed at its
registration deadline, counted from its arrival; once read, it has the
whole deadline for its registration. See docs/wire.md, "Before
registration".
"""

from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, cast
from typing import Protocol as Shape

from twisted.internet.interfaces import IAddress, IDelayedCall, IReactorTime
from twisted.internet.protocol import Factory, Protocol, connectionDone
from twisted.python.failure import Failure

from iop.edge.config import EdgeConfig
from iop.edge.connection import WAITED_OUT, EdgeNodeConnection
from iop.edge.doors import EVICTED, FULL, LINE_FULL, Doors, Ticket
from iop.edge.throttle import LogThrottle
from iop.edge.tlsdoors import Refused
from iop.protocols.wire import Heartbeat, WireProtocol
from iop.tlserrors import tls_failure

if TYPE_CHECKING:
    from iop.edge.links import NodeLinks

#: How many connections may wait in the hall, as a multiple of
#: C{limits.max_unregistered_connections}.
HALL_FACTOR = 4

#: The doors' reasons as the Node port names them (the C{reason} label of
#: C{iop_edge_refusals_total}).
REASONS = {
    FULL: "max_unregistered_connections",
    LINE_FULL: "max_unregistered_per_address",
    EVICTED: "node_port_line_evicted",
}


class _Socket(Shape):
    """
    What the Node port asks of an accepted connection's transport (TCP or
    TLS over TCP): to stop and start reading it, and to abort it.
    """

    def pauseProducing(self) -> None: ...

    def resumeProducing(self) -> None: ...

    def abortConnection(self) -> None: ...


def _socket(protocol: Protocol) -> _Socket:
    assert protocol.transport is not None
    return cast(_Socket, protocol.transport)


class _DoorWire(WireProtocol):
    """
    A Node connection with its place at the doors: one that waits (in its
    address's line or the hall) is not read, pinged or heard from until it
    goes in, and is closed if its registration deadline comes first.
    """

    ticket: Ticket
    _wait: IDelayedCall | None = None

    def __init__(self, port: "NodePortFactory", connection: EdgeNodeConnection, heartbeat: Heartbeat) -> None:
        super().__init__(connection, port.clock, heartbeat, frame_limit=port.config().limits.preauth_frame_bytes)
        self.port = port
        self.factory = port
        self.connection = connection

    def connectionMade(self) -> None:
        if self.ticket.inside:
            super().connectionMade()
            return
        _socket(self).pauseProducing()
        timeout = self.connection.register_timeout
        if timeout is not None:
            self._wait = self.clock.callLater(timeout, self._waited_out)

    def go_in(self) -> None:
        """
        Its wait is over: read it from now on.
        """
        if self._wait is not None and self._wait.active():
            self._wait.cancel()
        self._wait = None
        if self.transport is None:
            return
        _socket(self).resumeProducing()
        super().connectionMade()

    def put_out(self) -> None:
        if self.transport is not None:
            _socket(self).abortConnection()

    def _waited_out(self) -> None:
        self._wait = None
        self.port.note_refused(WAITED_OUT)
        self.put_out()

    def note_drop(self, reason: str, kind: str) -> None:
        if self.connection.link is not None:
            super().note_drop(reason, kind)
        else:
            # A stranger's: counted, and logged at a bounded rate.
            self.port.note_refused(kind, f"{self.ticket.host or '?'}: {reason}")

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        if self._wait is not None and self._wait.active():
            self._wait.cancel()
        self._wait = None
        tls = tls_failure(reason)
        if tls is not None and self.connection.link is None:
            # (Refused at the handshake: a certificate missing, untrusted
            # or expired; the Node is told no more than OpenSSL's alert.)
            self.port.tls_failures.note(peer=self.ticket.host or "?", reason=tls)
        super().connectionLost(reason)


class NodePortFactory(Factory):
    """
    @param links: the Edge's L{iop.edge.links.NodeLinks}.
    @param config: a callable returning the running
        L{iop.edge.config.EdgeConfig} (heartbeat, deadline and limits are
        read from it for each new connection).
    @ivar unregistered: the connections without an accepted registration
        (inside, waiting in a line or in the hall), with their places.
    @ivar refused: connections refused or closed before registering, by
        reason (see L{note_refused}).
    @ivar refuse_with_protocol: the listener's endpoint wraps each
        connection (C{ssl:}): a refused one gets a L{Refused} protocol,
        not none (L{iop.edge.tlsdoors}).
    """

    refuse_with_protocol = False

    def __init__(self, links: "NodeLinks", config: Callable[[], EdgeConfig], clock: IReactorTime) -> None:
        self.links = links
        self.config = config
        self.clock = clock
        self.unregistered: dict[EdgeNodeConnection, Ticket] = {}
        self.refused: Counter[str] = Counter()
        self.doors = Doors(0, 0, self._refused_at_doors)
        self.refusals = LogThrottle(
            clock,
            "node port: {count} connection(s) refused or closed before registering so far; the last: {reason}"
            " (limits.max_unregistered_connections, limits.max_unregistered_per_address, register_timeout_sec)",
        )
        self.tls_failures = LogThrottle(
            clock, "node port: {count} TLS handshake(s) failed so far (node_tls); the last, from {peer}: {reason}"
        )

    def buildProtocol(self, addr: IAddress | None) -> Protocol | None:
        config = self.config()
        limits = config.limits
        total = limits.max_unregistered_connections
        self.doors.set_limits(limits.max_unregistered_per_address, total, line=total, hall=HALL_FACTOR * total)
        connection = EdgeNodeConnection(
            self.links,
            port=self,
            register_timeout=config.register_timeout_sec,
            check_identity=config.node_tls is not None,
        )
        heartbeat = Heartbeat(config.heartbeat_interval, config.heartbeat_timeout)
        wire = _DoorWire(self, connection, heartbeat)
        ticket = self.doors.arrive(getattr(addr, "host", None), wire.go_in, wire.put_out)
        if ticket is None:
            # No protocol: the port closes the socket at once, before any
            # TLS handshake or read, and holds no descriptor for it.
            return Refused() if self.refuse_with_protocol else None
        wire.ticket = ticket
        self.unregistered[connection] = ticket
        return wire

    def settled(self, connection: EdgeNodeConnection) -> None:
        """
        C{connection} is no longer a stranger's: its registration was
        accepted, or it is gone.
        """
        ticket = self.unregistered.pop(connection, None)
        if ticket is not None:
            self.doors.leave(ticket)

    def _refused_at_doors(self, reason: str) -> None:
        self.note_refused(REASONS[reason])

    def note_refused(self, reason: str, detail: str | None = None) -> None:
        """
        Count (and log, at a bounded rate) a connection refused or closed
        before it registered, by C{reason} (a short label: L{REASONS},
        L{WAITED_OUT}, a C{RejectCode} in lower case, or a kind of
        L{WireProtocol.drop}); C{detail} is what the log line says of it.
        """
        self.refused[reason] += 1
        self.refusals.note(reason=detail or reason)
