"""
The Edge <-> Node connection: length-prefixed protobuf envelopes.

L{WireProtocol} is deliberately thin. It frames, decodes and encodes
L{Envelope}s, keeps the connection alive with heartbeats, and hands every
other message to an L{IWireReceiver}. It knows nothing of registries, runs
or leases; the Edge and the Node each plug their own receiver in.

Bad input (a frame that does not parse, an envelope with no message, an
oversize frame, a receiver that raises L{ProtocolViolation}) closes this one
connection with a logged reason and affects nothing else.

Frames are reassembled in linear time (L{iop.protocols.framing}); the
receive limit can start small and be raised once the peer is known
(L{WireProtocol.set_frame_limit}): docs/wire.md, "Before registration".
"""

from collections.abc import Callable
from dataclasses import dataclass

from google.protobuf.message import DecodeError, Message
from twisted.internet.interfaces import IAddress, IDelayedCall, IReactorTime, ITCPTransport
from twisted.internet.protocol import Factory, connectionDone
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import Interface

from iop.protocols import messages
from iop.protocols.framing import LinearInt32StringReceiver

# 16 MiB per frame. Twisted's default (99,999 bytes) is far too small for a
# chat request with a long context; anything larger is split by the sender
# (tunnel bodies) or refused before it is sent.
MAX_FRAME_BYTES = 16 * 1024 * 1024

# Tunnel body chunks stay well below the frame limit so that a large
# response is relayed as several frames and never starves heartbeats.
TUNNEL_CHUNK_BYTES = 256 * 1024

#: The first wire version that knows draining (C{EdgeDraining},
#: C{NodeDraining}).
DRAINING_WIRE_VERSION = 2
#: The first wire version with per-stream flow control.
FLOW_CONTROL_WIRE_VERSION = 3
#: The credit window of one stream (docs/wire.md, "Flow control"): the
#: most body or delta bytes a Node sends beyond what the Edge's caller has
#: taken. Two tunnel chunks, so a stream keeps moving while the caller reads.
STREAM_WINDOW_BYTES = 2 * TUNNEL_CHUNK_BYTES

#: After a local stall, how long a silent peer is given once the reactor
#: reads again before it is declared dead.
STALL_GRACE_SEC = 1.0

#: The first wire version whose Nodes keep background runs across a lost
#: link and reconcile them (C{RunReconcile}, C{RunResume}).
RECONCILE_WIRE_VERSION = 4

#: The wire-protocol version this code speaks. Version 2 added draining
#: (C{EdgeDraining}, C{NodeDraining}) and the version fields themselves;
#: version 3 per-stream flow control (C{window_bytes}, C{WindowUpdate});
#: version 4 background runs that survive a lost link (C{RunReconcile},
#: C{RunResume}).
WIRE_VERSION = 4
#: The oldest version an Edge still serves. A Node that sends no version
#: predates versioning and is version 1. The rule (docs/wire.md): the Edge
#: serves every version from L{OLDEST_WIRE_VERSION} to L{WIRE_VERSION} and
#: never sends a message newer than the Node's version; anything else is
#: refused with C{INCOMPATIBLE_VERSION}.
OLDEST_WIRE_VERSION = 1


def peer_wire_version(message: messages.RegisterRequest | messages.RegisterResponse) -> int:
    """
    The version the peer declares in its C{RegisterRequest} (read by the
    Edge) or C{RegisterResponse} (read by the Node); an absent field is 1.
    """
    version: int = message.wire_version or 1
    return version


_FIELD_BY_TYPE: dict[str, str] = {
    field.message_type.full_name: field.name for field in messages.Envelope.DESCRIPTOR.oneofs_by_name["body"].fields
}


class FrameTooLarge(ValueError):
    """
    A message would not fit in one frame; nothing was sent.
    """


class ProtocolViolation(Exception):
    """
    Raised by a receiver for a message that is not acceptable in the
    connection's current state; the connection is closed with this reason.
    """


def envelope(message: Message) -> messages.Envelope:
    """
    Wrap one wire message in an L{messages.Envelope}.

    @raise KeyError: if C{message} is not one of the envelope's messages.
    """
    env = messages.Envelope()
    getattr(env, _FIELD_BY_TYPE[message.DESCRIPTOR.full_name]).CopyFrom(message)
    return env


#: Kinds of L{WireProtocol.drop} reasons.
PROTOCOL_ERROR = "protocol_error"
FRAME_TOO_LARGE = "frame_too_large"
TOO_MANY_FRAMES = "too_many_frames"
SILENT = "heartbeat_timeout"


@dataclass(frozen=True)
class Heartbeat:
    """
    How often to ping, and how long a silent peer is tolerated.

    Any frame from the peer counts as a sign of life, so a busy stream never
    needs the pings; they matter on an idle link.
    """

    interval: float = 2.0
    timeout: float = 5.0


class IWireReceiver(Interface):
    """
    The session logic on one end of a wire connection.
    """

    def wire_connected(wire: "WireProtocol") -> None:
        """
        The connection is up; C{wire} is the L{WireProtocol} to send on.
        """

    def message_received(kind: str, message: Message) -> None:
        """
        One decoded message arrived. C{kind} is the envelope field name
        (C{"run_event"}, ...). Heartbeat messages are never delivered.

        @raise ProtocolViolation: to close the connection.
        """

    def wire_lost(reason: Failure) -> None:
        """
        The connection is gone (closed, aborted, or heartbeat timeout).
        """


class WireProtocol(LinearInt32StringReceiver):
    """
    One Edge <-> Node connection.

    Silence detection costs one clock read per frame: each frame notes when
    it arrived, and a single timer, due C{heartbeat.timeout} after the last
    frame it knows of, looks again when it fires. A timer that fires much
    later than due means this side's reactor was stalled (a burst of work,
    a pause): the peer's bytes may be waiting unread in the socket, so the
    peer gets one more short look (L{STALL_GRACE_SEC}) after the reactor
    has read again, instead of being declared dead for this side's delay.

    A peer not yet trusted (a Node port connection before its registration
    is accepted) can be held to a frame budget (L{limit_frames}): its pings
    are then not answered, only counted with its other frames, so it cannot
    make this side buffer answers it never reads, nor keep it parsing for
    free (this side's own pings keep the peer's silence detection content).

    @ivar receiver: the L{IWireReceiver} given every non-heartbeat message.
    @ivar close_reason: why this side closed the connection, if it did.
    @ivar frame_budget: how many more frames the peer may send (C{None}:
        no budget, pings answered).
    @ivar MAX_LENGTH: the largest frame accepted from the peer now (see
        L{set_frame_limit}); what this side sends may always be up to
        L{MAX_FRAME_BYTES}.
    """

    MAX_LENGTH = MAX_FRAME_BYTES
    log = Logger()
    #: A TCP connection, or TLS over one: it can be aborted.
    transport: ITCPTransport

    def __init__(
        self,
        receiver: IWireReceiver,
        clock: IReactorTime,
        heartbeat: Heartbeat = Heartbeat(),
        frame_limit: int = MAX_FRAME_BYTES,
    ) -> None:
        self.MAX_LENGTH = frame_limit
        self.receiver = receiver
        self.clock = clock
        self.heartbeat = heartbeat
        self.close_reason: str | None = None
        self.frame_budget: int | None = None
        self._pinger: LoopingCall | None = None
        self._ping_seq = 0
        self._last_heard = clock.seconds()
        self._due = self._last_heard
        self._silence: IDelayedCall | None = None

    # -- connection lifecycle ----------------------------------------------

    def connectionMade(self) -> None:
        # Small frames must not wait for Nagle's algorithm (~40 ms each).
        setNoDelay = getattr(self.transport, "setTcpNoDelay", None)
        if setNoDelay is not None:
            try:
                setNoDelay(True)
            except OSError:
                pass
        self.set_heartbeat(self.heartbeat)
        self.receiver.wire_connected(self)

    def set_heartbeat(self, heartbeat: Heartbeat) -> None:
        """
        (Re)start pinging and silence detection with new timings.
        """
        self.heartbeat = heartbeat
        if self._pinger is not None and self._pinger.running:
            self._pinger.stop()
        self._pinger = LoopingCall(self._ping)
        self._pinger.clock = self.clock
        self._pinger.start(heartbeat.interval, now=False)
        self._watch(self._last_heard + heartbeat.timeout)

    def set_frame_limit(self, limit: int) -> None:
        """
        Accept frames of up to C{limit} bytes from now on (checked on each
        length prefix as it arrives).
        """
        self.MAX_LENGTH = limit

    def limit_frames(self, budget: int | None) -> None:
        """
        Read at most C{budget} more frames from the peer, answering none of
        its pings; one more closes the connection. C{None} lifts the budget.
        """
        self.frame_budget = budget

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self.discarding = True
        if self._silence is not None and self._silence.active():
            self._silence.cancel()
        self._silence = None
        if self._pinger is not None and self._pinger.running:
            self._pinger.stop()
        self.receiver.wire_lost(reason)

    def _watch(self, due: float) -> None:
        """
        Look for silence at time C{due}.
        """
        if self._silence is not None and self._silence.active():
            self._silence.cancel()
        self._due = due
        self._silence = self.clock.callLater(max(due - self.clock.seconds(), 0), self._look)

    def _look(self) -> None:
        self._silence = None
        now = self.clock.seconds()
        timeout = self.heartbeat.timeout
        if now - self._last_heard < timeout:
            self._watch(self._last_heard + timeout)
        elif now - self._due > self.heartbeat.interval:
            # Fired long after it was due: this side was not reading.
            self._watch(now + STALL_GRACE_SEC)
        else:
            self.drop(f"heartbeat timeout: nothing received for {timeout:g}s", SILENT)

    def close(self, reason: str) -> None:
        """
        End this connection in order: what was sent is flushed first. For
        planned ends (a drain), not errors.
        """
        if self.close_reason is None:
            self.close_reason = reason
        self.transport.loseConnection()

    def drop(self, reason: str, kind: str = PROTOCOL_ERROR) -> None:
        """
        Close this connection at once, logging why.

        @param kind: what sort of reason it is (L{PROTOCOL_ERROR},
            L{FRAME_TOO_LARGE}, L{TOO_MANY_FRAMES}, L{SILENT}, or the
            caller's own), for L{note_drop}.
        """
        self.discarding = True
        if self.close_reason is None:
            self.close_reason = reason
            self.note_drop(reason, kind)
        self.transport.abortConnection()

    def note_drop(self, reason: str, kind: str) -> None:
        """
        Report a drop: a warning naming the peer. (The Edge's Node port
        counts a stranger's instead, logging them at a bounded rate.)
        """
        self.log.warn("closing connection to {peer}: {reason}", peer=self._peer(), reason=reason)

    def _peer(self) -> str:
        try:
            return str(self.transport.getPeer())
        except Exception:
            return "?"

    # -- receiving -----------------------------------------------------------

    def lengthLimitExceeded(self, length: int) -> None:
        self.drop(f"frame of {length} bytes exceeds the {self.MAX_LENGTH}-byte limit", FRAME_TOO_LARGE)

    def dataReceived(self, data: bytes) -> None:
        # Any bytes are a sign of life, a frame still arriving included.
        self._last_heard = self.clock.seconds()
        super().dataReceived(data)

    def stringReceived(self, data: bytes) -> None:
        if self.frame_budget is not None:
            if self.frame_budget <= 0:
                self.drop("more frames than a peer may send before it is trusted", TOO_MANY_FRAMES)
                return
            self.frame_budget -= 1
        env = messages.Envelope()
        try:
            env.ParseFromString(data)
        except DecodeError as e:
            self.drop(f"undecodable frame ({len(data)} bytes): {e}")
            return
        kind = env.WhichOneof("body")
        if kind is None:
            self.drop("frame carries no message")
            return
        message = getattr(env, kind)
        if kind == "ping":
            if self.frame_budget is None:
                self.send(messages.pong(message.seq))
            return
        if kind == "pong":
            return
        try:
            self.receiver.message_received(kind, message)
        except ProtocolViolation as e:
            self.drop(f"protocol violation on {kind}: {e}")
        except Exception:
            self.log.failure("receiver failed on {kind}", kind=kind)
            self.drop(f"internal error handling {kind}")

    # -- sending ---------------------------------------------------------------

    def send(self, message: Message) -> None:
        """
        Send one wire message (or an C{Envelope} already holding it, as
        L{messages.tunnel_body} builds one).

        @raise FrameTooLarge: if it does not fit in one frame (Twisted's
            C{sendString} does not check this).
        """
        wrapped = message if isinstance(message, messages.Envelope) else envelope(message)
        data = wrapped.SerializeToString()
        if len(data) > MAX_FRAME_BYTES:
            raise FrameTooLarge(f"{message.DESCRIPTOR.name} of {len(data)} bytes exceeds {MAX_FRAME_BYTES}")
        self.sendString(data)

    def _ping(self) -> None:
        self._ping_seq += 1
        self.send(messages.ping(self._ping_seq))


def chunks(data: bytes, size: int = TUNNEL_CHUNK_BYTES) -> list[bytes]:
    """
    Split C{data} into pieces of at most C{size} bytes (at least one piece).
    """
    if not data:
        return [data]
    return [data[i : i + size] for i in range(0, len(data), size)]


class WireFactory(Factory):
    """
    Builds a L{WireProtocol} per connection, each with a fresh receiver from
    C{make_receiver()}. Used for the Edge's listener and the Node's dialer.
    """

    def __init__(
        self,
        make_receiver: Callable[[], IWireReceiver],
        clock: IReactorTime,
        heartbeat: Heartbeat = Heartbeat(),
        frame_limit: int = MAX_FRAME_BYTES,
    ) -> None:
        self.make_receiver = make_receiver
        self.clock = clock
        self.heartbeat = heartbeat
        self.frame_limit = frame_limit

    def buildProtocol(self, addr: IAddress | None) -> WireProtocol:
        protocol = WireProtocol(self.make_receiver(), self.clock, self.heartbeat, self.frame_limit)
        protocol.factory = self
        return protocol
