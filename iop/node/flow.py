"""
The Node's side of per-stream flow control (wire version 3; docs/wire.md,
"Flow control").

Each run or tunnel the Edge starts with a C{window_bytes} credit gets a
L{SendWindow}: every frame of the stream goes through it, in order. Body
bytes (tunnel body frames, delta text of runs) spend credit; while there
is credit left a frame goes out at once (so one frame may overdraw it by
at most its own size), otherwise it waits here, with everything after it,
until a C{WindowUpdate} grants more. While frames wait, the source is
paused: the adapter's registered producer (a provider's HTTP response)
stops being read, so a slow caller slows the provider down rather than
filling anyone's memory.

Without a window (an Edge older than version 3) frames go out at once.
"""

from collections import deque
from collections.abc import Callable
from typing import Any

from twisted.internet.interfaces import IPushProducer

#: A wire message (a protobuf C{Envelope} field message).
Message = Any


class SendWindow:
    """
    @param send: sends one wire message.
    @param window: the initial credit in bytes; C{None} or 0 for unlimited.
    """

    def __init__(self, send: Callable[[Message], object], window: int | None = None) -> None:
        self._send = send
        self.credit = window or None
        self.queue: deque[tuple[Message, int]] = deque()
        self.producer: IPushProducer | None = None
        self.paused = False
        self._idle: list[Callable[[], object]] = []

    def send(self, message: Message, size: int = 0) -> None:
        """
        Send C{message} now, or queue it behind what waits. C{size} is how
        much credit it spends (0 for frames that carry no body).
        """
        if self.credit is None or (not self.queue and (size == 0 or self.credit > 0)):
            self._out(message, size)
            return
        self.queue.append((message, size))
        self._pause()

    def _out(self, message: Message, size: int) -> None:
        if size and self.credit is not None:
            self.credit -= size
            if self.credit <= 0:
                self._pause()
        self._send(message)

    def grant(self, size: int) -> None:
        """
        The Edge granted C{size} more bytes: send what now fits, and resume
        the source once nothing waits and credit is left.
        """
        if self.credit is None:
            return
        self.credit += size
        while self.queue and (self.queue[0][1] == 0 or self.credit > 0):
            message, spent = self.queue.popleft()
            self._out(message, spent)
        if not self.queue and self.credit > 0:
            self._resume()
        self._check_idle()

    def abandon(self) -> None:
        """
        The stream was cancelled: its body is no longer wanted. Queued body
        frames are dropped, the others (headers, usage, the terminal) go
        out now, and from here on nothing is held back.
        """
        self._release(keep_body=False)

    def flush(self) -> None:
        """
        The stream ended by itself but its rest waits for credit, and
        nothing may wait any more (a drain's grace passed): everything
        queued goes out now, body and all, so that its success terminal
        never follows a cut body; from here on nothing is held back.
        """
        self._release(keep_body=True)

    def _release(self, keep_body: bool) -> None:
        queued, self.queue = self.queue, deque()
        self.credit = None
        for message, size in queued:
            if keep_body or not size:
                self._send(message)
        self._resume()
        self._check_idle()

    def register_producer(self, producer: IPushProducer) -> None:
        """
        The source of the stream's body (an C{IPushProducer}, such as a
        provider response's transport): paused while frames wait.
        """
        self.producer = producer
        if self.paused:
            producer.pauseProducing()

    def when_idle(self, callback: Callable[[], object]) -> None:
        """
        Call C{callback()} once nothing is queued (at once if nothing is).
        """
        if not self.queue:
            callback()
        else:
            self._idle.append(callback)

    def _check_idle(self) -> None:
        if not self.queue:
            waiting, self._idle = self._idle, []
            for callback in waiting:
                callback()

    def _pause(self) -> None:
        if not self.paused:
            self.paused = True
            if self.producer is not None:
                self.producer.pauseProducing()

    def _resume(self) -> None:
        if self.paused:
            self.paused = False
            if self.producer is not None:
                self.producer.resumeProducing()
