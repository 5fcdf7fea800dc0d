"""
A recorder for tunnels: the sink an adapter writes a provider's response
into (L{iop.run.ITunnelSink}) and the listener an Edge surface gets
(L{iop.edge.dispatch.ITunnelListener}, which adds C{end} and C{error}).
"""

from typing import Any

from twisted.internet import defer
from twisted.internet.defer import Deferred
from zope.interface import implementer

from iop.edge.dispatch import ITunnelListener
from iop.run import RunFailure, Usage


@implementer(ITunnelListener)
class TunnelRecorder:
    """
    Records every call, in order, as C{(name, value)} (C{("end",)} for the
    end). C{for_work} is a surface's C{listener_for}.

    @ivar first_body: fires with the first body chunk.
    """

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.bodies: list[bytes] = []
        self.first_body: Deferred[bytes] = defer.Deferred()
        self.work_id: str | None = None

    def for_work(self, kind: str, work_id: str) -> "TunnelRecorder":
        self.work_id = work_id
        return self

    def status(self, code: int) -> None:
        self.calls.append(("status", code))

    def headers(self, pairs: list[tuple[str, str]]) -> None:
        self.calls.append(("headers", pairs))

    def body(self, data: bytes) -> None:
        self.calls.append(("body", data))
        self.bodies.append(data)
        if not self.first_body.called:
            self.first_body.callback(data)

    def usage(self, usage: Usage) -> None:
        self.calls.append(("usage", usage))

    def metadata(self, info: dict[str, Any]) -> None:
        self.calls.append(("metadata", info))

    def end(self) -> None:
        self.calls.append(("end",))

    def error(self, failure: RunFailure) -> None:
        self.calls.append(("error", failure))

    def of(self, kind: str) -> list[Any]:

        return [call[1] for call in self.calls if call[0] == kind]
