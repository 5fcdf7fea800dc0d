"""
A push producer that records what it is told, for flow-control tests.
"""

from twisted.internet.interfaces import IPushProducer
from zope.interface import implementer


@implementer(IPushProducer)
class RecordingProducer:
    """
    C{calls} lists C{"pause"}, C{"resume"} and C{"stop"} in order.
    """

    def __init__(self) -> None:
        self.calls: list[str] = []

    def pauseProducing(self) -> None:
        self.calls.append("pause")

    def resumeProducing(self) -> None:
        self.calls.append("resume")

    def stopProducing(self) -> None:
        self.calls.append("stop")
