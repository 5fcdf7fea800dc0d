"""
A reader of a run's events that stops reading (L{iop.edge.http.native.SlowReader}):
the Edge holds a bounded amount for it, then cuts it off.
"""

from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from iop.edge.http.native import FOLLOW_BUFFER_MAX, SlowReader


class Transport:
    def __init__(self) -> None:
        self.aborted = 0

    def abortConnection(self) -> None:
        self.aborted += 1


class Channel:
    def __init__(self) -> None:
        self.transport = Transport()


class Request:
    def __init__(self) -> None:
        self.channel = Channel()
        self.producer: Any = None

    def registerProducer(self, producer: Any, streaming: bool) -> None:
        self.producer = producer


class SlowReaderTests(SynchronousTestCase):
    def test_bounded_while_paused(self) -> None:
        """
        While its connection takes writes, a reader gets every event; while
        it is paused, what it is written is counted, and past
        FOLLOW_BUFFER_MAX its connection is aborted (it resumes with
        Last-Event-ID); reading again starts the count over.
        """
        request: Any = Request()
        reader = SlowReader(request)
        self.assertIs(request.producer, reader)
        self.assertTrue(all(reader.keeps_up(1 << 20) for _ in range(10)))
        reader.pauseProducing()
        self.assertTrue(reader.keeps_up(FOLLOW_BUFFER_MAX // 2))
        reader.resumeProducing()
        reader.pauseProducing()
        self.assertTrue(reader.keeps_up(FOLLOW_BUFFER_MAX // 2))
        self.assertEqual(request.channel.transport.aborted, 0)
        self.assertFalse(reader.keeps_up(FOLLOW_BUFFER_MAX // 2))
        self.assertEqual(request.channel.transport.aborted, 1)
