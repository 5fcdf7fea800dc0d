"""
The Edge's side of per-stream flow control (wire version 3; docs/wire.md,
"Flow control").

A L{ReceiveWindow} is the credit of one run or tunnel. The Node may send
C{window} body bytes (tunnel body, delta text) beyond what the Edge has
granted back; the Edge grants them back with C{WindowUpdate} as it hands
them to its caller — but only while the caller's connection is draining.
The window is the C{IPushProducer} a streaming surface registers with its
HTTP request: when the caller stops reading and the socket's buffer
fills, twisted.web pauses it, grants stop, and the Node (after at most one
more window) stops sending and pauses its provider. So the Edge holds at
most about one window per stream, whatever the caller does, and the other
streams of the same Node link flow on.
"""

from collections.abc import Callable

from google.protobuf.message import Message
from twisted.internet.interfaces import IDelayedCall, IPushProducer, IReactorTime
from zope.interface import implementer

from iop.protocols import messages

#: How long a caller's connection may stay undrained (the stream paused:
#: twisted.web resumes it once all that was written is taken) before it is
#: cut off.
STALL_TIMEOUT_SEC = 60.0
#: What a window that opened wide grants at a time.
WIDE_GRANT_BYTES = 1 << 30


class StallWatch:
    """
    The deadline of a caller's connection that does not drain: started
    when twisted.web pauses a stream's producer, stopped when it resumes
    or the stream ends; past C{timeout} seconds undrained, C{on_stall} is
    called (once). Without a clock it never fires.
    """

    def __init__(self, clock: IReactorTime | None, timeout: float, on_stall: Callable[[], None]) -> None:
        self.clock = clock
        self.timeout = timeout
        self.on_stall = on_stall
        self._call: IDelayedCall | None = None

    def start(self) -> None:
        """
        The connection stopped draining (a deadline already running goes on).
        """
        if self.clock is not None and self._call is None:
            self._call = self.clock.callLater(self.timeout, self._fire)

    def stop(self) -> None:
        """
        The connection drains again, or the stream ended.
        """
        if self._call is not None and self._call.active():
            self._call.cancel()
        self._call = None

    def _fire(self) -> None:
        self._call = None
        self.on_stall()


@implementer(IPushProducer)
class ReceiveWindow:
    """
    @param send: sends one message to the Node (the dispatch's link).
    @param stream_id: the run or tunnel id.
    @param window: the window the stream was started with, in bytes.
    @param clock: for the stall timeout (C{None}: none).
    @ivar on_stall: called when the window stayed paused for
        C{stall_timeout} seconds.
    """

    def __init__(
        self,
        send: Callable[[Message], object],
        stream_id: str,
        window: int,
        clock: IReactorTime | None = None,
        stall_timeout: float = STALL_TIMEOUT_SEC,
    ) -> None:
        self._send = send
        self.stream_id = stream_id
        self.window = window
        self.on_stall: Callable[[], None] | None = None
        self.unacked = 0
        self.paused = False
        self.closed = False
        self._stall = StallWatch(clock, stall_timeout, self._stalled)
        #: The work goes on when its reader leaves (a background run):
        #: then the window opens wide instead of closing.
        self.keep_flowing = False
        self.wide = False

    def received(self, size: int) -> None:
        """
        C{size} body bytes of the stream were handed to the caller.
        """
        if self.closed or size <= 0:
            return
        self.unacked += size
        if self.wide:
            if self.unacked >= WIDE_GRANT_BYTES // 2:
                self._grant()
            return
        # Granting in halves of the window keeps updates few and the
        # stream moving.
        if not self.paused and self.unacked >= self.window // 2:
            self._grant()

    def _grant(self) -> None:
        if self.unacked and not self.closed:
            size, self.unacked = self.unacked, 0
            try:
                self._send(messages.window_update(self.stream_id, size))
            except Exception:
                # The link is going away; its loss ends the stream.
                self.closed = True

    def close(self) -> None:
        """
        The stream ended: nothing more is granted.
        """
        self.closed = True
        self._stall.stop()

    def _stalled(self) -> None:
        if not self.closed and self.on_stall is not None:
            self.on_stall()

    # -- IPushProducer: the caller's connection

    def pauseProducing(self) -> None:
        if self.wide:
            return
        self.paused = True
        if not self.closed:
            self._stall.start()

    def resumeProducing(self) -> None:
        self.paused = False
        self._stall.stop()
        self._grant()

    def stopProducing(self) -> None:
        if self.keep_flowing and not self.closed:
            self.open_wide()
            return
        self.closed = True
        self._stall.stop()

    def open_wide(self) -> None:
        """
        Nobody reads the stream any more, but the work must go on (a
        background run whose caller left): grant without waiting for a
        reader from now on, so the Node never holds it back.
        """
        self.wide = True
        self.paused = False
        self._stall.stop()
        self.unacked += WIDE_GRANT_BYTES
        self._grant()
