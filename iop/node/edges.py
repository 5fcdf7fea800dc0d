"""
Several Edges for one Node (an Edge cluster): C{node.yaml} C{edge} may
list endpoint strings, and the supervisor dials them in turn.

The supervisor moves to the next Edge after every failed attempt and
after every lost session (a dead Edge, or one that drained): with one
policy (C{reconnect}) for all of them, and the attempt count shared, so
C{max_attempts} consecutive failures anywhere end the Node as before.
With one Edge this is the plain endpoint.
"""

from collections.abc import Sequence

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IProtocol, IProtocolFactory, IStreamClientEndpoint
from zope.interface import implementer


@implementer(IStreamClientEndpoint)
class EdgeRotation:
    """
    @param endpoints: C{[(description, IStreamClientEndpoint)]}, in the
        order of C{node.yaml}; the first is dialled first.
    """

    def __init__(self, endpoints: Sequence[tuple[str, IStreamClientEndpoint]]) -> None:

        if not endpoints:
            raise ValueError("at least one Edge endpoint is needed")
        self.endpoints = list(endpoints)
        self.index = 0

    def __len__(self) -> int:
        return len(self.endpoints)

    @property
    def current(self) -> str:
        """
        The description of the Edge dialled now (or next).
        """
        return self.endpoints[self.index][0]

    def move_on(self) -> str:
        """
        Dial the next Edge from now on. @return: its description.
        """
        self.index = (self.index + 1) % len(self.endpoints)
        return self.current

    def connect(self, factory: IProtocolFactory) -> "Deferred[IProtocol]":

        return self.endpoints[self.index][1].connect(factory)
