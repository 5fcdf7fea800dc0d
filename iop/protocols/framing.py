"""
Length-prefixed framing with a reassembly cost linear in the frame size.

The frames on the wire are exactly C{Int32StringReceiver}'s: a 4-byte
big-endian length, then that many bytes. Only the receiving side differs.
Twisted's C{IntNStringReceiver.dataReceived} builds C{buffer + data} on
every read, so a frame that arrives in many reads is copied again on each:
a 15 MiB frame in 64 KiB reads costs some 1.7 GB of copying (seconds of
blocked reactor, issue 12 finding 2). L{LinearInt32StringReceiver} keeps
the reads of an incomplete frame in a list and joins them once, when the
frame is complete.

Its C{MAX_LENGTH} may be an instance attribute that changes while the
connection lives (a small limit before a peer authenticates): every length
prefix is checked against the limit in force when its 4 bytes are in,
before any of its body is read or kept.
"""

from struct import pack, unpack_from

from twisted.internet.interfaces import ITransport
from twisted.protocols.basic import Int32StringReceiver, StringTooLongError

_PREFIX = 4


class LinearInt32StringReceiver(Int32StringReceiver):
    """
    C{Int32StringReceiver} with linear reassembly (see the module).

    It also restates, with their types, the three methods of Twisted's
    (unannotated) class that a subclass calls or overrides: the frame
    format is the same.

    @ivar discarding: set to stop delivering frames (the connection is
        being dropped): whatever else arrives is thrown away.
    @ivar transport: what the frames go over, set once connected.
    """

    transport: ITransport

    discarding = False
    #: The reads not yet delivered. This class-level empty list is never
    #: appended to: the first read replaces it with the instance's own.
    _chunks: list[bytes] = []
    _buffered = 0
    #: How many buffered bytes the next step needs (a prefix, or a whole
    #: frame whose length is known); reads that leave the buffer short of
    #: it are only appended.
    _need = _PREFIX

    def dataReceived(self, data: bytes) -> None:
        if self.discarding:
            return
        if data:
            if self._chunks:
                self._chunks.append(data)
            else:
                self._chunks = [data]
            self._buffered += len(data)
        if self._buffered < self._need:
            return
        buf = self._chunks[0] if len(self._chunks) == 1 else b"".join(self._chunks)
        offset = 0
        need = _PREFIX
        try:
            while not self.paused and not self.discarding:
                if len(buf) - offset < _PREFIX:
                    need = _PREFIX
                    break
                (length,) = unpack_from("!I", buf, offset)
                if length > self.MAX_LENGTH:
                    buf, offset = b"", 0
                    self.discarding = True
                    self.lengthLimitExceeded(length)
                    break
                end = offset + _PREFIX + length
                if len(buf) < end:
                    need = end - offset
                    break
                packet = buf[offset + _PREFIX : end]
                offset = end
                self.stringReceived(packet)
        finally:
            rest = buf[offset:] if offset else buf
            if self.discarding:
                rest = b""
            self._chunks = [rest] if rest else []
            self._buffered = len(rest)
            self._need = 0 if self.paused else need

    def stringReceived(self, string: bytes) -> None:
        """
        One complete frame arrived; a subclass handles it.
        """
        raise NotImplementedError

    def lengthLimitExceeded(self, length: int) -> None:
        """
        A length prefix over C{MAX_LENGTH} arrived (nothing of its frame is
        kept): disconnect. A subclass may say why first.
        """
        self.transport.loseConnection()

    def sendString(self, string: bytes) -> None:
        """
        Send one frame: its 4-byte big-endian length, then C{string}.

        @raise StringTooLongError: if the length does not fit the prefix.
        """
        if len(string) >= 2 ** (8 * _PREFIX):
            raise StringTooLongError(f"frame of {len(string)} bytes does not fit a {_PREFIX}-byte length prefix")
        self.transport.write(pack("!I", len(string)) + string)
