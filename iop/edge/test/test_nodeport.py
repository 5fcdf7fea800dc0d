"""
The Node port's limits before registration (issue 12, findings 2 and 4):
a small frame limit checked on the length prefix, a registration deadline
that pings do not extend, and a cap on connections without an accepted
registration. All in memory, on the Edge's own factory.
"""

import copy
import struct

from OpenSSL import SSL
from twisted.internet.address import IPv4Address
from twisted.internet.error import ConnectionDone
from twisted.internet.testing import StringTransport
from twisted.logger import capturedLogs, formatEvent
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase

from iop.edge.limits import PREAUTH_FRAME_BYTES
from iop.protocols import messages
from iop.protocols.wire import WIRE_VERSION
from iop.testing.edge import EDGE_YAML, EdgeHarness, ScriptedNode

STRANGER, NODE = "192.0.2.66", "198.51.100.7"


def harness(**limits):
    data = copy.deepcopy(EDGE_YAML)
    data["limits"] = limits
    data["register_timeout_sec"] = 10
    return EdgeHarness(data)


class PreauthFrameTests(SynchronousTestCase):
    def test_oversize_prefix_before_registration(self):
        """
        Before registration, a length prefix over
        C{limits.preauth_frame_bytes} closes the connection as soon as its
        four bytes arrive: no body is read or kept.
        """
        edge = harness()
        node, pump, edge_protocol = edge.connect()
        node.wire.transport.write(struct.pack("!I", PREAUTH_FRAME_BYTES + 1))
        pump.flush()
        self.assertIn("exceeds the 65536-byte limit", edge_protocol.close_reason)
        self.assertTrue(node.lost)
        self.assertEqual(edge_protocol._buffered, 0)
        self.assertEqual(edge.service.node_port.unregistered, {})

    def test_frame_at_the_limit_is_read(self):
        """
        A frame of exactly the pre-registration limit is read (here it is
        junk, so it closes the connection as undecodable, not as too big).
        """
        edge = harness()
        node, pump, edge_protocol = edge.connect()
        node.wire.transport.write(struct.pack("!I", PREAUTH_FRAME_BYTES) + b"\xff" * PREAUTH_FRAME_BYTES)
        pump.flush()
        self.assertIn("undecodable", edge_protocol.close_reason)

    def test_full_limit_after_registration(self):
        """
        Once its registration is accepted, a connection may send frames
        above the pre-registration limit.
        """
        edge = harness()
        node, pump, edge_protocol = edge.register()
        node.wire.send(messages.run_event(run_id="nothing", seq=1, type="delta", text="x" * (PREAUTH_FRAME_BYTES * 2)))
        pump.flush()
        self.assertIsNone(edge_protocol.close_reason)
        self.assertFalse(node.lost)

    def test_configured_limit(self):
        """
        C{limits.preauth_frame_bytes} sets the limit.
        """
        edge = harness(preauth_frame_bytes=2048)
        node, pump, edge_protocol = edge.connect()
        node.wire.transport.write(struct.pack("!I", 2049))
        pump.flush()
        self.assertIn("exceeds the 2048-byte limit", edge_protocol.close_reason)


class DeadlineTests(SynchronousTestCase):
    def test_pings_do_not_extend_the_deadline(self):
        """
        A connection that pings but never registers is closed at
        C{register_timeout_sec}, with a reason naming the key.
        """
        edge = harness()
        node, pump, edge_protocol = edge.connect()
        edge.advance(9.5, step=0.5)
        self.assertFalse(node.lost)
        edge.advance(1, step=0.5)
        self.assertTrue(node.lost)
        self.assertIn("register_timeout_sec", edge_protocol.close_reason)

    def test_no_deadline_once_registered(self):
        """
        A registered connection (even one that is not ready yet) has no
        registration deadline.
        """
        edge = harness()
        node, pump, edge_protocol = edge.register(ready=False)
        edge.advance(30)
        self.assertFalse(node.lost)

    def test_refused_registration_keeps_the_deadline(self):
        """
        A connection whose registration was refused stays a stranger until
        it is gone: it still counts, and its deadline still runs (should its
        peer never read the refusal and let the close complete).
        """
        edge = harness()
        node, pump, edge_protocol = edge.connect()
        data = messages.Envelope(register_request=messages.register_request("wrong", WIRE_VERSION)).SerializeToString()
        edge_protocol.dataReceived(struct.pack("!I", len(data)) + data)
        connection = edge_protocol.receiver
        self.assertEqual(connection.state, "refused")
        self.assertTrue(connection._deadline.active())
        self.assertIn(connection, edge.service.node_port.unregistered)
        pump.flush()
        self.assertEqual(node.of("register_response")[0].code, messages.UNKNOWN_TOKEN)
        self.assertEqual(edge.service.node_port.unregistered, {})
        self.assertIsNone(connection._deadline)


def kinds_heard(node):
    """
    Record the kind of every frame C{node}'s wire reads (pongs included,
    which the wire answers itself).
    """
    heard = []
    wire = node.connection
    read = wire.stringReceived

    def record(data):
        heard.append(messages.Envelope.FromString(data).WhichOneof("body"))
        read(data)

    wire.stringReceived = record
    return heard


def raw(edge_protocol, message):
    data = messages.Envelope(**{message.DESCRIPTOR.name.lower(): message}).SerializeToString()
    edge_protocol.dataReceived(struct.pack("!I", len(data)) + data)


class StrangerBudgetTests(SynchronousTestCase):
    """
    Before its registration is accepted a connection may send only a
    bounded number of frames, and none of its pings is answered: a
    stranger cannot make the Edge buffer pongs it never reads.
    """

    def test_pings_before_registration_are_not_answered(self):
        edge = harness()
        node, pump, edge_protocol = edge.connect()
        heard = kinds_heard(node)
        node.connection.send(messages.ping(1))
        pump.flush()
        self.assertNotIn("pong", heard)
        self.assertFalse(node.lost)

    def test_pings_after_registration_are_answered(self):
        edge = harness()
        node, pump, edge_protocol = edge.register()
        heard = kinds_heard(node)
        node.connection.send(messages.ping(1))
        pump.flush()
        self.assertIn("pong", heard)

    def test_a_ping_flood_closes_the_connection(self):
        """
        Past its budget (4 frames plus one a second of
        C{register_timeout_sec}) a stranger's connection is closed, and
        counted, not logged line by line.
        """
        edge = harness()
        node, pump, edge_protocol = edge.connect()
        with capturedLogs() as events:
            for seq in range(14):
                raw(edge_protocol, messages.ping(seq))
            self.assertFalse(node.lost)
            raw(edge_protocol, messages.ping(99))
            pump.flush()
        self.assertTrue(node.lost)
        self.assertEqual(edge.service.node_port.refused["too_many_frames"], 1)
        self.assertFalse([e for e in events if "closing connection" in formatEvent(e)])

    def test_the_budget_allows_a_slow_registration(self):
        """
        A Node that pings through nearly the whole deadline (at its
        default 2 s) is still accepted when its registration is answered.
        """
        edge = harness()
        node, pump, edge_protocol = edge.connect()
        edge.advance(9.5, step=0.5)
        node.connection.send(messages.register_request("tok-1", WIRE_VERSION))
        pump.flush()
        self.assertTrue(node.of("register_response")[0].accepted)


class StrangerLogTests(SynchronousTestCase):
    """
    A stranger's refusal or close is counted by reason and logged at a
    bounded rate (one line per interval), however many there are.
    """

    def test_unknown_tokens_are_counted_and_throttled(self):
        edge = harness()
        with capturedLogs() as events:
            for _ in range(5):
                node, pump, _ = edge.connect()
                node.connection.send(messages.register_request("wrong", WIRE_VERSION))
                pump.flush()
        self.assertEqual(edge.service.node_port.refused["unknown_token"], 5)
        lines = [formatEvent(e) for e in events if e["log_level"].name in ("warn", "error")]
        self.assertEqual(len(lines), 1, lines)
        self.assertIn("1 connection(s) refused", lines[0])

    def test_deadline_is_counted(self):
        edge = harness()
        with capturedLogs() as events:
            for _ in range(3):
                edge.connect()
            edge.advance(11)
        self.assertEqual(edge.service.node_port.refused["register_timeout_sec"], 3)
        self.assertFalse([e for e in events if "closing connection" in formatEvent(e)])

    def test_a_registered_nodes_drop_is_still_logged(self):
        edge = harness()
        node, pump, edge_protocol = edge.register()
        with capturedLogs() as events:
            edge_protocol.dataReceived(struct.pack("!I", 3) + b"\xff\xff\xff")
        self.assertTrue([e for e in events if "closing connection" in formatEvent(e)])
        self.assertEqual(sum(edge.service.node_port.refused.values()), 0)


class CapTests(SynchronousTestCase):
    """
    The doors of the Node port: per source address, in total, and the
    hall beyond the total where a herd waits unread instead of being reset.
    """

    def connect_raw(self, edge, host=None):
        """
        A new connection straight from the factory, from C{host}.
        @return: the protocol and its transport.
        """
        address = IPv4Address("TCP", host, 40000) if host is not None else None
        protocol = edge.service.node_port.buildProtocol(address)
        if protocol is None:
            return None, None  # refused at the doors: the port closes it
        transport = StringTransport(peerAddress=address)
        protocol.makeConnection(transport)
        return protocol, transport

    def register(self, edge, protocol, token="tok-1"):
        data = messages.Envelope(register_request=messages.register_request(token, WIRE_VERSION)).SerializeToString()
        protocol.dataReceived(struct.pack("!I", len(data)) + data)

    def test_beyond_the_cap_waits_in_the_hall(self):
        """
        Beyond C{limits.max_unregistered_connections} strangers at once, a
        new connection waits unread in the hall (up to four times the cap)
        instead of being reset; beyond the hall it is aborted at once, with
        one log line for many. A registration frees a place, and the
        oldest of the hall goes in: read from then on.
        """
        edge = harness(max_unregistered_connections=2)
        first, _ = self.connect_raw(edge)
        self.connect_raw(edge)
        hall = [self.connect_raw(edge) for _ in range(8)]
        self.assertEqual([t.producerState for _, t in hall], ["paused"] * 8)
        self.assertEqual(edge.service.node_port.doors.in_hall, 8)
        with capturedLogs() as events:
            refused = [self.connect_raw(edge) for _ in range(5)]
        self.assertEqual(refused, [(None, None)] * 5)
        self.assertEqual(len([e for e in events if "max_unregistered_connections" in e["log_format"]]), 1)
        self.assertEqual(edge.service.node_port.refused["max_unregistered_connections"], 5)
        self.register(edge, first)
        self.assertEqual(len(edge.service.node_port.unregistered), 9)
        self.assertEqual(hall[0][1].producerState, "producing")
        self.assertEqual(hall[1][1].producerState, "paused")
        self.register(edge, hall[0][0], token="tok-2")
        self.assertEqual(hall[0][0].receiver.state, "pending")

    def test_failed_tls_handshake_is_logged(self):
        """
        A connection that closes at its TLS handshake (a client certificate
        missing, untrusted or expired) is logged with its peer and
        OpenSSL's reason in words, one line for many; a registered one's
        loss is not such a line.
        """
        edge = harness()
        refused = Failure(SSL.Error([("SSL routines", "", "certificate verify failed")]))
        with capturedLogs() as events:
            for _ in range(3):
                protocol, _ = self.connect_raw(edge, STRANGER)
                protocol.connectionLost(refused)
        lines = [formatEvent(e) for e in events if "TLS handshake" in e["log_format"]]
        self.assertEqual(
            lines,
            [
                "node port: 1 TLS handshake(s) failed so far (node_tls); the last, from 192.0.2.66: certificate verify failed"
            ],
        )
        self.assertEqual(edge.service.node_port.tls_failures.count, 3)

    def test_waiting_until_the_registration_deadline(self):
        """
        A connection that waits in the hall is closed at its registration
        deadline if no place came free by then; one that goes in gets its
        whole deadline from then on.
        """
        edge = harness(max_unregistered_connections=1)
        first, _ = self.connect_raw(edge)
        _, waiting = self.connect_raw(edge)
        edge.clock.advance(9)
        third, late = self.connect_raw(edge)
        first.transport.loseConnection()
        first.connectionLost(Failure(ConnectionDone()))
        self.assertEqual(waiting.producerState, "producing")
        edge.clock.advance(1)
        self.assertFalse(waiting.disconnected)
        self.assertTrue(late.producerState == "paused" and not late.disconnected)
        edge.clock.advance(9)
        self.assertTrue(late.disconnected)
        # The one that waited it out, and the one let in at 9 s that never
        # registered in its own 10 s.
        self.assertTrue(waiting.disconnected)
        self.assertEqual(edge.service.node_port.refused["register_timeout_sec"], 2)

    def test_an_address_over_its_cap_waits_in_its_line(self):
        """
        One address's unregistered connections beyond
        C{limits.max_unregistered_per_address} wait unread in its line;
        another address's connection is read at once.
        """
        edge = harness(max_unregistered_per_address=2)
        stranger = [self.connect_raw(edge, STRANGER) for _ in range(5)]
        self.assertEqual([t.producerState for _, t in stranger], ["producing"] * 2 + ["paused"] * 3)
        _, node = self.connect_raw(edge, NODE)
        self.assertEqual(node.producerState, "producing")

    def test_real_node_gets_in_while_a_stranger_fills_every_place(self):
        """
        A stranger whose connections fill every place (inside, its line,
        and the hall) cannot keep a Node of another address out: the Node
        takes the place of the stranger's oldest waiting connection.
        """
        edge = harness(max_unregistered_connections=4, max_unregistered_per_address=2)
        stranger = [self.connect_raw(edge, STRANGER) for _ in range(4 + 16)]
        self.assertEqual(edge.service.node_port.doors.in_hall, 16)
        protocol, node = self.connect_raw(edge, NODE)
        self.assertIsNotNone(protocol)
        self.assertEqual(node.producerState, "producing")
        self.assertTrue(stranger[2][1].disconnected)
        self.assertEqual(edge.service.node_port.refused["node_port_line_evicted"], 1)
        self.register(edge, protocol)
        self.assertEqual(protocol.receiver.state, "pending")

    def test_off_per_address(self):
        """
        C{limits.max_unregistered_per_address: 0} lets one address have as
        many as the total cap allows (Nodes behind one proxy).
        """
        edge = harness(max_unregistered_per_address=0)
        stranger = [self.connect_raw(edge, STRANGER) for _ in range(40)]
        self.assertEqual({t.producerState for _, t in stranger}, {"producing"})

    def test_lost_stranger_frees_its_place(self):
        """
        A stranger that goes away no longer counts.
        """
        edge = harness(max_unregistered_connections=1)
        node, pump, _ = edge.connect()
        node.wire.transport.loseConnection()
        pump.flush()
        self.assertEqual(edge.service.node_port.unregistered, {})
        node2, _, _ = edge.connect(ScriptedNode())
        self.assertFalse(node2.lost)
