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
the small pre-registration frame limit its L{iop.edge.nodeport} gave it,
a budget of frames (L{preauth_frames}; its pings are not answered) and a
deadline (C{register_timeout_sec}) after which it is closed however much
it pings. Acceptance lifts all three. Its refusal, or its close, is
counted and logged at a bounded rate by the port, not line by line.
"""

import math
from typing import Any, Protocol

from google.protobuf.message import Message
from twisted.internet.interfaces import IDelayedCall
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

from iop.edge.links import NodeLinks
from iop.edge.nodetls import mismatch
from iop.edge.registry import NodeLink
from iop.protocols import messages
from iop.protocols.wire import MAX_FRAME_BYTES, IWireReceiver, ProtocolViolation, WireProtocol, peer_wire_version


class _Port(Protocol):
    """
    What a connection tells the port that counts unregistered ones.
    """

    def settled(self, connection: "EdgeNodeConnection") -> None: ...

    def note_refused(self, reason: str, detail: str | None = None) -> None: ...


#: A connection closed at its registration deadline (the C{reason} label
#: of C{iop_edge_refusals_total}).
WAITED_OUT = "register_timeout_sec"


def preauth_frames(register_timeout: float | None) -> int | None:
    """
    How many frames a connection may send before its registration is
    accepted: its C{RegisterRequest}, and pings (a Node pings every 2 s
    until it is given its heartbeat) through the whole deadline, at one a
    second, with room to spare. C{None} (no deadline): no budget.
    """
    if register_timeout is None:
        return None
    return 4 + math.ceil(register_timeout)


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

    @ivar wire: the L{WireProtocol} it came on (from L{wire_connected}).
    @ivar link: its L{NodeLink} once it registered (C{None} before, and
        once refused).
    """

    log = Logger()
    wire: WireProtocol

    def __init__(
        self,
        links: NodeLinks,
        port: _Port | None = None,
        register_timeout: float | None = None,
        check_identity: bool = False,
    ) -> None:
        self.links = links
        self.port = port
        self.register_timeout = register_timeout
        self.check_identity = check_identity
        self.link: NodeLink | None = None
        self.state = "new"
        self._deadline: IDelayedCall | None = None

    def wire_connected(self, wire: WireProtocol) -> None:
        self.wire = wire
        wire.limit_frames(preauth_frames(self.register_timeout))
        if self.register_timeout is not None:
            self._deadline = wire.clock.callLater(self.register_timeout, self._not_registered)

    def _not_registered(self) -> None:
        self._deadline = None
        self.wire.drop(f"no accepted registration within {self.register_timeout:g}s (register_timeout_sec)", WAITED_OUT)

    def _settled(self) -> None:
        if self._deadline is not None and self._deadline.active():
            self._deadline.cancel()
        self._deadline = None
        if self.port is not None:
            self.port.settled(self)

    def message_received(self, kind: str, message: Message) -> None:
        if kind == "register_request":
            self._register(message)
        elif kind == "node_ready_request":
            self._ready(message)
        elif kind == "run_reconcile" and self.state == "pending":
            # Before the ready (wire version 4): the background runs the
            # Node kept from a lost link.
            self.links.reconciled(self._registered(), message)
        elif kind in _READY_MESSAGES and self.state == "ready":
            self._result(kind, message)
        else:
            raise ProtocolViolation(f"{kind} is not accepted in state {self.state}")

    def _register(self, message: messages.RegisterRequest) -> None:
        if self.state != "new":
            raise ProtocolViolation("already registered on this connection")
        wrong_certificate = self._certificate_mismatch(message.token)
        if wrong_certificate is not None:
            self.link, response = self.links.refuse_credentials(message.token, wrong_certificate)
        else:
            self.link, response = self.links.register(message.token, peer_wire_version(message), self.wire)
        # In an Edge cluster the answer waits for the node's etcd claim.
        self.state = "claiming"
        response.addCallback(self._answer)
        response.addErrback(lambda f: self.log.failure("registration failed", f))

    def _answer(self, response: messages.RegisterResponse | None) -> None:
        if self.state == "gone" or response is None:
            return
        if not response.accepted:
            self.link = None
        self.wire.send(response)
        if self.link is None:
            # Still a stranger until it is gone: the deadline stays.
            self.state = "refused"
            if self.port is not None:
                self.port.note_refused(messages.reject_code_name(response.code).lower(), response.reason)
            self.wire.close(response.reason)
        else:
            self.state = "pending"
            self.wire.set_frame_limit(MAX_FRAME_BYTES)
            self.wire.limit_frames(None)
            self._settled()

    def _certificate_mismatch(self, token: str) -> str | None:
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

    def _ready(self, message: messages.NodeReadyRequest) -> None:
        if self.state not in ("pending", "ready"):
            raise ProtocolViolation(f"ready before registration (state {self.state})")
        link = self._registered()
        response, first = self.links.ready(link, message.node_id)
        self.wire.send(response)
        if response.ready:
            self.state = "ready"
        if first:
            self.links.activate(link)

    def _registered(self) -> NodeLink:
        """
        The link of this connection, in the states only an accepted
        registration reaches (C{pending}, C{ready}).
        """
        if self.link is None:
            raise ProtocolViolation(f"no registration in state {self.state}")
        return self.link

    def _result(self, kind: str, message: Any) -> None:
        link = self._registered()
        if kind == "run_event":
            self.links.run_event(link, message)
        elif kind == "provider_tunnel_frame":
            self.links.tunnel_frame(link, message)
        elif kind == "node_draining":
            self.links.node_draining(link, message)
        else:
            self.links.answered(link, message.request_id, message)

    def wire_lost(self, reason: Failure) -> None:
        self.state = "gone"
        self._settled()
        if self.link is not None:
            why = self.wire.close_reason or reason.getErrorMessage()
            self.links.lost(self.link, why)
