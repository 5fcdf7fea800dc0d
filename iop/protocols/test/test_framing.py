"""
Tests for L{iop.protocols.framing}: the same frames as
C{Int32StringReceiver}, reassembled in linear time, with a length limit
checked on each prefix before its body is kept.
"""

import struct
import time

from twisted.internet.testing import StringTransport
from twisted.protocols.basic import Int32StringReceiver
from twisted.trial.unittest import SynchronousTestCase

from iop.protocols.framing import LinearInt32StringReceiver


class Recorder(LinearInt32StringReceiver):
    MAX_LENGTH = 1000

    def __init__(self):
        self.strings = []
        self.exceeded = []
        self.on_string = None

    def stringReceived(self, data):
        self.strings.append(data)
        if self.on_string is not None:
            self.on_string(data)

    def lengthLimitExceeded(self, length):
        self.exceeded.append(length)


def framed(*strings):
    return b"".join(struct.pack("!I", len(s)) + s for s in strings)


def receiver():
    protocol = Recorder()
    protocol.makeConnection(StringTransport())
    return protocol


class FramingTests(SynchronousTestCase):
    def test_same_frames_as_twisted(self):
        """
        Frames written by Twisted's own C{Int32StringReceiver} are read
        back whole and in order.
        """
        sender = Int32StringReceiver()
        transport = StringTransport()
        sender.makeConnection(transport)
        for s in (b"", b"a", b"x" * 999):
            sender.sendString(s)
        protocol = receiver()
        protocol.dataReceived(transport.value())
        self.assertEqual(protocol.strings, [b"", b"a", b"x" * 999])

    def test_byte_at_a_time(self):
        """
        Frames fed one byte at a time arrive whole, in order, each exactly
        when its last byte does.
        """
        protocol = receiver()
        data = framed(b"one", b"", b"three")
        delivered = []
        for i in range(len(data)):
            protocol.dataReceived(data[i : i + 1])
            delivered.append(len(protocol.strings))
        self.assertEqual(protocol.strings, [b"one", b"", b"three"])
        self.assertEqual(delivered.index(1), 6)
        self.assertEqual(delivered.index(2), 10)
        self.assertEqual(protocol._buffered, 0)

    def test_many_frames_in_one_read(self):
        """
        Many frames in one read are all delivered, and a trailing partial
        frame waits for the rest.
        """
        protocol = receiver()
        data = framed(*[b"%d" % i for i in range(500)]) + framed(b"tail")
        protocol.dataReceived(data[:-2])
        self.assertEqual(len(protocol.strings), 500)
        protocol.dataReceived(data[-2:])
        self.assertEqual(protocol.strings[-1], b"tail")

    def test_oversize_prefix_refused_before_its_body(self):
        """
        A length prefix over the limit is refused as soon as its 4 bytes
        are in (even split across reads); nothing after it is kept or
        delivered.
        """
        protocol = receiver()
        data = framed(b"ok") + struct.pack("!I", 5000)
        protocol.dataReceived(data[:-2])
        self.assertEqual(protocol.exceeded, [])
        protocol.dataReceived(data[-2:])
        self.assertEqual(protocol.exceeded, [5000])
        protocol.dataReceived(b"x" * 10_000 + framed(b"late"))
        self.assertEqual(protocol.strings, [b"ok"])
        self.assertEqual(protocol._buffered, 0)

    def test_limit_change_applies_to_the_next_prefix(self):
        """
        A limit raised while a frame is handled applies to the next frame,
        even one already in the same read.
        """
        protocol = receiver()

        def raise_limit(data):
            protocol.MAX_LENGTH = 10_000

        protocol.on_string = raise_limit
        protocol.dataReceived(framed(b"hello", b"y" * 5000))
        self.assertEqual(protocol.exceeded, [])
        self.assertEqual(len(protocol.strings), 2)

    def test_pause_and_resume(self):
        """
        Pausing in the middle of a read stops delivery; resuming delivers
        what was kept.
        """
        protocol = receiver()
        protocol.on_string = lambda data: protocol.pauseProducing()
        protocol.dataReceived(framed(b"a", b"b", b"c"))
        self.assertEqual(protocol.strings, [b"a"])
        protocol.on_string = None
        protocol.resumeProducing()
        self.assertEqual(protocol.strings, [b"a", b"b", b"c"])

    def test_discarding(self):
        """
        Once C{discarding} is set (the connection is being dropped), frames
        still in the read are not delivered.
        """
        protocol = receiver()

        def stop(data):
            protocol.discarding = True

        protocol.on_string = stop
        protocol.dataReceived(framed(b"a", b"b"))
        self.assertEqual(protocol.strings, [b"a"])

    def test_linear_reassembly(self):
        """
        A 16 MiB frame in 1 KiB reads (16,384 reads) is reassembled in well
        under a second: Twisted's C{buffer + data} on every read would copy
        some 128 GB.
        """
        protocol = receiver()
        protocol.MAX_LENGTH = 16 * 1024 * 1024
        body = b"z" * protocol.MAX_LENGTH
        data = memoryview(framed(body))
        started = time.process_time()
        for i in range(0, len(data), 1024):
            protocol.dataReceived(bytes(data[i : i + 1024]))
        elapsed = time.process_time() - started
        self.assertEqual(len(protocol.strings), 1)
        self.assertEqual(len(protocol.strings[0]), len(body))
        self.assertLess(elapsed, 1.0)
