"""
The Node port's limits before registration (issue 12, findings 2 and 4):
a small frame limit checked on the length prefix, a registration deadline
that pings do not extend, and a cap on connections without an accepted
registration. All in memory, on the Edge's own factory.
"""

import copy
import struct

from twisted.logger import capturedLogs
from twisted.test import iosim
from twisted.trial.unittest import SynchronousTestCase

from iop.edge.limits import PREAUTH_FRAME_BYTES
from iop.edge.nodeport import _Refused
from iop.protocols import messages
from iop.protocols.wire import WIRE_VERSION
from iop.testing.edge import EDGE_YAML, EdgeHarness, ScriptedNode


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
        self.assertEqual(edge.service.node_port.unregistered, set())

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
        self.assertEqual(edge.service.node_port.unregistered, set())
        self.assertIsNone(connection._deadline)


class CapTests(SynchronousTestCase):
    def connect_raw(self, edge):
        """
        A new connection straight from the factory. @return: the protocol.
        """
        protocol = edge.service.node_port.buildProtocol(None)
        transport = iosim.FakeTransport(protocol, isServer=True)
        protocol.makeConnection(transport)
        return protocol, transport

    def test_cap_on_unregistered_connections(self):
        """
        Beyond C{limits.max_unregistered_connections} strangers at once, a
        new connection is aborted at once; registering or leaving frees a
        place. One log line says so, not one per refusal.
        """
        edge = harness(max_unregistered_connections=2)
        first, _, _ = edge.connect()
        edge.connect()
        with capturedLogs() as events:
            refused = [self.connect_raw(edge) for _ in range(5)]
        for protocol, transport in refused:
            self.assertIsInstance(protocol, _Refused)
            self.assertTrue(transport.disconnecting)
        self.assertEqual(len([e for e in events if "max_unregistered_connections" in e["log_format"]]), 1)
        first.wire.send(messages.register_request(token="tok-1", wire_version=WIRE_VERSION))
        edge.flush()
        self.assertEqual(len(edge.service.node_port.unregistered), 1)
        protocol, _ = self.connect_raw(edge)
        self.assertNotIsInstance(protocol, _Refused)

    def test_lost_stranger_frees_its_place(self):
        """
        A stranger that goes away no longer counts.
        """
        edge = harness(max_unregistered_connections=1)
        node, pump, _ = edge.connect()
        node.wire.transport.loseConnection()
        pump.flush()
        self.assertEqual(edge.service.node_port.unregistered, set())
        node2, _, _ = edge.connect(ScriptedNode())
        self.assertFalse(node2.lost)
