"""
The Edge's end of one Node connection: an L{IWireReceiver} that turns wire
messages into L{iop.edge.links.NodeLinks} calls, enforcing what each
connection state may send.

States: C{new} (only C{RegisterRequest}), C{pending} (registered; only
C{NodeReadyRequest}, after a C{RunReconcile} from a Node of version 4),
C{ready} (results of work: run events, tunnel frames, command and cancel
answers, the Node's draining notice; a repeated ready is acknowledged). Anything else closes the connection as a protocol
violation.

Until its registration is accepted a connection is a stranger's: it has
the small pre-registration frame limit its L{iop.edge.nodeport} gave it
and a deadline (C{register_timeout_sec}) after which it is closed however
much it pings. Acceptance lifts both.
"""

from twisted.internet.defer import Deferred
from twisted.logger import Logger
from zope.interface import implementer

from iop.edge.nodetls import mismatch
from iop.protocols.wire import MAX_FRAME_BYTES, IWireReceiver, ProtocolViolation, peer_wire_version

_READY_MESSAGES = {"run_event", "provider_tunnel_frame", "node_command_response", "cancel_response", "node_draining"}


@implementer(IWireReceiver)
class EdgeNodeConnection:
    """
    @param port: the L{iop.edge.nodeport.NodePortFactory} counting
        unregistered connections (told when this one settles), if any.
    @param register_timeout: seconds until an unregistered connection is
        closed (C{None}: no deadline).
    @param check_identity: the Node port requires client certificates
        (C{node_tls}): a registration is refused unless the certificate
        names the token's node (L{iop.edge.nodetls}).
    """

    log = Logger()

    def __init__(self, links, port=None, register_timeout=None, check_identity=False):
        self.links = links
        self.port = port
        self.register_timeout = register_timeout
        self.check_identity = check_identity
        self.wire = None
        self.link = None
        self.state = "new"
        self._deadline = None

    def wire_connected(self, wire):
        self.wire = wire
        if self.register_timeout is not None:
            self._deadline = wire.clock.callLater(self.register_timeout, self._not_registered)

    def _not_registered(self):
        self._deadline = None
        self.wire.drop(f"no accepted registration within {self.register_timeout:g}s (register_timeout_sec)")

    def _settled(self):
        if self._deadline is not None and self._deadline.active():
            self._deadline.cancel()
        self._deadline = None
        if self.port is not None:
            self.port.settled(self)

    def message_received(self, kind, message):
        if kind == "register_request":
            self._register(message)
        elif kind == "node_ready_request":
            self._ready(message)
        elif kind == "run_reconcile" and self.state == "pending":
            # Before the ready (wire version 4): the background runs the
            # Node kept from a lost link.
            self.links.reconciled(self.link, message)
        elif kind in _READY_MESSAGES and self.state == "ready":
            self._result(kind, message)
        else:
            raise ProtocolViolation(f"{kind} is not accepted in state {self.state}")

    def _register(self, message):
        if self.state != "new":
            raise ProtocolViolation("already registered on this connection")
        wrong_certificate = self._certificate_mismatch(message.token)
        if wrong_certificate is not None:
            self.link, response = self.links.refuse_credentials(message.token, wrong_certificate)
        else:
            self.link, response = self.links.register(message.token, peer_wire_version(message), self.wire)
        if isinstance(response, Deferred):
            # An Edge cluster: the answer waits for the node's etcd claim.
            self.state = "claiming"
            response.addCallback(self._answer)
            response.addErrback(lambda f: self.log.failure("registration failed", f))
            return
        self._answer(response)

    def _answer(self, response):
        if self.state == "gone" or response is None:
            return
        if not response.accepted:
            self.link = None
        self.wire.send(response)
        if self.link is None:
            # Still a stranger until it is gone: the deadline stays.
            self.state = "refused"
            self.wire.transport.loseConnection()
        else:
            self.state = "pending"
            self.wire.set_frame_limit(MAX_FRAME_BYTES)
            self._settled()

    def _certificate_mismatch(self, token):
        """
        With C{node_tls}: why this connection's client certificate does not
        belong to the node C{token} names (C{None} if it does, or if the
        token names no node: that refusal is the registry's).
        """
        if not self.check_identity:
            return None
        node = self.links.registry.find_node(token)
        if node is None:
            return None
        return mismatch(self.wire.transport, node.id)

    def _ready(self, message):
        if self.state not in ("pending", "ready"):
            raise ProtocolViolation(f"ready before registration (state {self.state})")
        response, first = self.links.ready(self.link, message.node_id)
        self.wire.send(response)
        if response.ready:
            self.state = "ready"
        if first:
            self.links.activate(self.link)

    def _result(self, kind, message):
        if kind == "run_event":
            self.links.run_event(self.link, message)
        elif kind == "provider_tunnel_frame":
            self.links.tunnel_frame(self.link, message)
        elif kind == "node_draining":
            self.links.node_draining(self.link, message)
        else:
            self.links.answered(self.link, message.request_id, message)

    def wire_lost(self, reason):
        self.state = "gone"
        self._settled()
        if self.link is not None:
            why = self.wire.close_reason or reason.getErrorMessage()
            self.links.lost(self.link, why)
