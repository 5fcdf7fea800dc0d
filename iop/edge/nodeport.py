"""
The Edge's Node port: the factory of Node connections, and what a
connection may cost before its registration is accepted.

A stranger who opens connections to the Node port gets, per connection, a
small frame limit (C{limits.preauth_frame_bytes}: a larger length prefix
closes the connection before its body is read) and a deadline
(C{register_timeout_sec}: a connection whose registration is not accepted
by then is closed, whatever it sends); and all strangers together get at
most C{limits.max_unregistered_connections} such connections at once
(beyond it a new connection is closed at once). Once a registration is
accepted, the connection has the full frame limit and no deadline. See
docs/wire.md, "Before registration".
"""

from twisted.internet.protocol import Factory, Protocol

from iop.edge.connection import EdgeNodeConnection
from iop.edge.throttle import LogThrottle
from iop.protocols.wire import Heartbeat, WireProtocol


class _Refused(Protocol):
    """
    A connection over the cap: aborted as soon as it exists (before any
    TLS handshake or read).
    """

    def connectionMade(self):
        self.transport.abortConnection()


class NodePortFactory(Factory):
    """
    @param links: the Edge's L{iop.edge.links.NodeLinks}.
    @param config: a callable returning the running
        L{iop.edge.config.EdgeConfig} (heartbeat, deadline and limits are
        read from it for each new connection).
    @ivar unregistered: the connections without an accepted registration.
    """

    def __init__(self, links, config, clock):
        self.links = links
        self.config = config
        self.clock = clock
        self.unregistered = set()
        self.refusals = LogThrottle(
            clock,
            "node port: {count} connection(s) closed at once so far: {cap} unregistered connections are open"
            " (limits.max_unregistered_connections)",
        )

    def buildProtocol(self, addr):
        config = self.config()
        limits = config.limits
        if len(self.unregistered) >= limits.max_unregistered_connections:
            self.refusals.note(cap=limits.max_unregistered_connections)
            return _Refused()
        connection = EdgeNodeConnection(
            self.links,
            port=self,
            register_timeout=config.register_timeout_sec,
            check_identity=config.node_tls is not None,
        )
        heartbeat = Heartbeat(config.heartbeat_interval, config.heartbeat_timeout)
        wire = WireProtocol(connection, self.clock, heartbeat, frame_limit=limits.preauth_frame_bytes)
        wire.factory = self
        self.unregistered.add(connection)
        return wire

    def settled(self, connection):
        """
        C{connection} is no longer a stranger's: its registration was
        accepted, or it is gone.
        """
        self.unregistered.discard(connection)
