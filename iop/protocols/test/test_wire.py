"""
Tests for L{iop.protocols.wire}: framing, dispatch, size checks,
heartbeats and the handling of bad input.
"""

import struct

from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.logger import capturedLogs
from twisted.test import iosim
from twisted.trial.unittest import SynchronousTestCase
from zope.interface import implementer
from zope.interface.verify import verifyObject

from iop.protocols import messages
from iop.protocols.wire import (
    MAX_FRAME_BYTES,
    FrameTooLarge,
    Heartbeat,
    IWireReceiver,
    ProtocolViolation,
    WireFactory,
    WireProtocol,
    chunks,
    envelope,
)


@implementer(IWireReceiver)
class RecordingReceiver:
    def __init__(self, violate_on=None):
        self.wire = None
        self.messages = []
        self.lost = []
        self.violate_on = violate_on

    def wire_connected(self, wire):
        self.wire = wire

    def message_received(self, kind, message):
        if kind == self.violate_on:
            raise ProtocolViolation("not now")
        self.messages.append((kind, message))

    def wire_lost(self, reason):
        self.lost.append(reason)


class AbortableTransport(StringTransport):
    def __init__(self):
        super().__init__()
        self.aborted = False
        self.nodelay = None

    def abortConnection(self):
        self.aborted = True
        self.loseConnection()

    def setTcpNoDelay(self, enabled):
        self.nodelay = enabled


def frame(message):
    data = envelope(message).SerializeToString()
    return struct.pack("!I", len(data)) + data


#: Heartbeat is a frozen dataclass: one shared default is safe.
DEFAULT_HEARTBEAT = Heartbeat()


def connect(receiver=None, heartbeat=DEFAULT_HEARTBEAT):
    receiver = receiver or RecordingReceiver()
    clock = Clock()
    protocol = WireProtocol(receiver, clock, heartbeat)
    transport = AbortableTransport()
    protocol.makeConnection(transport)
    return protocol, receiver, transport, clock


class FramingTests(SynchronousTestCase):
    def test_receiver_interface(self):
        """
        The test receiver provides the interface the protocol relies on.
        """
        self.assertTrue(verifyObject(IWireReceiver, RecordingReceiver()))

    def test_round_trip_byte_at_a_time(self):
        """
        A frame fed one byte at a time is decoded into one message of the
        right kind, with its fields intact.
        """
        protocol, receiver, transport, clock = connect()
        data = frame(messages.RunEvent(run_id="r1", type="delta", text="héllo ", seq=3))
        for i in range(len(data)):
            protocol.dataReceived(data[i : i + 1])
        self.assertEqual(len(receiver.messages), 1)
        kind, message = receiver.messages[0]
        self.assertEqual(kind, "run_event")
        self.assertEqual((message.run_id, message.type, message.text, message.seq), ("r1", "delta", "héllo ", 3))

    def test_two_frames_in_one_read(self):
        """
        Two frames arriving together are delivered in order.
        """
        protocol, receiver, _, _ = connect()
        protocol.dataReceived(
            frame(messages.NodeReadyRequest(node_id="a")) + frame(messages.NodeReadyRequest(node_id="b"))
        )
        self.assertEqual([m.node_id for _, m in receiver.messages], ["a", "b"])

    def test_send_frames_envelope(self):
        """
        C{send} writes a 4-byte big-endian length and an Envelope carrying
        exactly the given message.
        """
        protocol, _, transport, _ = connect()
        protocol.send(messages.RegisterRequest(token="t"))
        data = transport.value()
        (length,) = struct.unpack("!I", data[:4])
        self.assertEqual(length, len(data) - 4)
        env = messages.Envelope.FromString(data[4:])
        self.assertEqual(env.WhichOneof("body"), "register_request")
        self.assertEqual(env.register_request.token, "t")

    def test_tcp_no_delay(self):
        """
        The connection turns Nagle's algorithm off.
        """
        _, _, transport, _ = connect()
        self.assertIs(transport.nodelay, True)

    def test_max_length_explicit(self):
        """
        The frame limit is set explicitly, far above Twisted's default.
        """
        self.assertEqual(WireProtocol.MAX_LENGTH, MAX_FRAME_BYTES)
        self.assertGreater(MAX_FRAME_BYTES, 99999)

    def test_oversize_send_refused(self):
        """
        A message larger than a frame is refused before anything is sent.
        """
        protocol, _, transport, _ = connect()
        transport.clear()
        big = messages.ProviderTunnelRequest(tunnel_id="t", body=b"x" * (MAX_FRAME_BYTES + 1))
        self.assertRaises(FrameTooLarge, protocol.send, big)
        self.assertEqual(transport.value(), b"")

    def test_chunks(self):
        """
        C{chunks} splits into pieces under the limit that join back exactly,
        and yields one empty piece for empty data.
        """
        data = bytes(range(256)) * 10
        pieces = chunks(data, 1000)
        self.assertEqual(b"".join(pieces), data)
        self.assertTrue(all(len(p) <= 1000 for p in pieces))
        self.assertEqual(chunks(b""), [b""])


class BadInputTests(SynchronousTestCase):
    def assert_dropped(self, transport, receiver, text):
        self.assertTrue(transport.aborted)
        self.assertEqual(receiver.messages, [])

    def test_oversize_frame(self):
        """
        A frame header announcing more than the limit closes the connection
        with a logged reason, without waiting for the body.
        """
        protocol, receiver, transport, _ = connect()
        with capturedLogs() as events:
            protocol.dataReceived(struct.pack("!I", MAX_FRAME_BYTES + 1))
        self.assert_dropped(transport, receiver, "exceeds")
        self.assertIn("exceeds", protocol.close_reason)
        self.assertTrue(any("closing connection" in e.get("log_format", "") for e in events))

    def test_garbage_frame(self):
        """
        A frame that is not a protobuf Envelope closes the connection.
        """
        protocol, receiver, transport, _ = connect()
        garbage = b"\xff\xff\xff\xff\x0f"
        protocol.dataReceived(struct.pack("!I", len(garbage)) + garbage)
        self.assert_dropped(transport, receiver, "undecodable")
        self.assertIn("undecodable", protocol.close_reason)

    def test_empty_envelope(self):
        """
        An Envelope with no message closes the connection.
        """
        protocol, receiver, transport, _ = connect()
        protocol.dataReceived(struct.pack("!I", 0))
        self.assertIn("no message", protocol.close_reason)
        self.assertTrue(transport.aborted)

    def test_protocol_violation(self):
        """
        A receiver refusing a message closes the connection, naming the
        message kind.
        """
        protocol, receiver, transport, _ = connect(RecordingReceiver(violate_on="run_event"))
        protocol.dataReceived(frame(messages.RunEvent(run_id="r")))
        self.assertTrue(transport.aborted)
        self.assertIn("run_event", protocol.close_reason)

    def test_only_this_connection(self):
        """
        Garbage on one connection leaves another connection of the same
        factory working.
        """
        factory = WireFactory(RecordingReceiver, Clock())
        good, bad = factory.buildProtocol(None), factory.buildProtocol(None)
        good_transport, bad_transport = AbortableTransport(), AbortableTransport()
        good.makeConnection(good_transport)
        bad.makeConnection(bad_transport)
        bad.dataReceived(struct.pack("!I", 3) + b"\xff\xff\xff")
        good.dataReceived(frame(messages.NodeReadyRequest(node_id="n")))
        self.assertTrue(bad_transport.aborted)
        self.assertFalse(good_transport.aborted)
        receiver = good.receiver
        assert isinstance(receiver, RecordingReceiver)
        self.assertEqual(len(receiver.messages), 1)


class HeartbeatTests(SynchronousTestCase):
    def test_pings_every_interval(self):
        """
        An idle connection sends a Ping every interval.
        """
        protocol, _, transport, clock = connect(heartbeat=Heartbeat(2, 5))
        transport.clear()
        clock.advance(2)
        env = messages.Envelope.FromString(transport.value()[4:])
        self.assertEqual(env.WhichOneof("body"), "ping")

    def test_pong_answers_ping(self):
        """
        A Ping is answered with a Pong of the same sequence number and is
        not handed to the receiver.
        """
        protocol, receiver, transport, _ = connect()
        transport.clear()
        protocol.dataReceived(frame(messages.Ping(seq=7)))
        env = messages.Envelope.FromString(transport.value()[4:])
        self.assertEqual(env.pong.seq, 7)
        self.assertEqual(receiver.messages, [])

    def test_silence_drops(self):
        """
        Nothing received for the timeout drops the connection; traffic
        before that keeps it open.
        """
        protocol, receiver, transport, clock = connect(heartbeat=Heartbeat(2, 5))
        clock.advance(4.9)
        protocol.dataReceived(frame(messages.Pong(seq=1)))
        clock.advance(4.9)
        self.assertFalse(transport.aborted)
        clock.advance(0.2)
        self.assertTrue(transport.aborted)
        self.assertIn("heartbeat timeout", protocol.close_reason)

    def test_local_stall_is_not_peer_silence(self):
        """
        When this side's reactor stalls (the clock jumps past the timeout in
        one step) while the peer's bytes wait unread, the peer is not
        declared dead: it gets a short look once the reactor reads again,
        and its waiting bytes keep it alive. A peer really silent after the
        stall is dropped after that look.
        """
        protocol, receiver, transport, clock = connect(heartbeat=Heartbeat(2, 5))
        clock.advance(12)
        self.assertFalse(transport.aborted)
        protocol.dataReceived(frame(messages.Pong(seq=1)))
        clock.advance(1)
        self.assertFalse(transport.aborted)
        clock.advance(3.5)
        self.assertFalse(transport.aborted)
        clock.advance(12)
        clock.advance(1)
        self.assertTrue(transport.aborted)
        self.assertIn("heartbeat timeout", protocol.close_reason)

    def test_partial_frame_is_a_sign_of_life(self):
        """
        Bytes of a large frame still arriving count as the peer talking.
        """
        protocol, receiver, transport, clock = connect(heartbeat=Heartbeat(2, 5))
        data = frame(messages.Pong(seq=1))
        for byte in data[:-1]:
            clock.advance(1)
            protocol.dataReceived(bytes([byte]))
        self.assertFalse(transport.aborted)

    def test_both_ends_stay_up_while_talking(self):
        """
        Two wired-up ends answering each other's pings stay connected for a
        long time; when one side stops reading, the other drops it.
        """
        clock = Clock()
        server = WireProtocol(RecordingReceiver(), clock, Heartbeat(2, 5))
        client = WireProtocol(RecordingReceiver(), clock, Heartbeat(2, 5))
        server_transport = iosim.FakeTransport(server, isServer=True)
        client_transport = iosim.FakeTransport(client, isServer=False)
        pump = iosim.connect(server, server_transport, client, client_transport, greet=False, clock=clock)
        for _ in range(30):
            clock.advance(1)
            pump.flush()
        self.assertFalse(server_transport.disconnecting)
        self.assertFalse(client_transport.disconnecting)
        # Freeze the link: nothing flows any more.
        for _ in range(6):
            clock.advance(1)
        self.assertIn("heartbeat timeout", server.close_reason)
        self.assertIn("heartbeat timeout", client.close_reason)

    def test_timers_stop_on_loss(self):
        """
        After the connection is lost no heartbeat timer remains.
        """
        protocol, receiver, transport, clock = connect()
        protocol.connectionLost(None)
        self.assertEqual(clock.getDelayedCalls(), [])
        self.assertEqual(len(receiver.lost), 1)
