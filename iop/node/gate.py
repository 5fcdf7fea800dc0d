"""
The Node's capacity gate: how much work one adapter instance has in hand.

Normalized runs and raw tunnels on the same adapter instance take slots
from the same gate, so even work that bypassed the Edge's admission never
exceeds the back end's C{max_concurrency}. A full gate refuses at once:
the Node never queues (queueing is the Edge's job).
"""

from collections.abc import Callable

from twisted.internet.defer import Deferred, succeed


class Slot:
    """
    One unit of capacity held by one run or tunnel. Releasing is
    idempotent, so every exit path may call it and the count stays exact.
    """

    def __init__(self, gate: "CapacityGate") -> None:
        self._gate = gate
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._gate._released()


class CapacityGate:
    """
    Counts in-flight work against C{limit}.

    @ivar on_change: called with the new in-use count after every change
        (the metrics gauge listens here).
    """

    def __init__(self, limit: int, on_change: Callable[[int], object] | None = None) -> None:
        self.limit = limit
        self.in_use = 0
        self.on_change = on_change
        self._idle_waiters: list[Deferred[None]] = []

    def acquire(self) -> Slot | None:
        """
        @return: a L{Slot}, or C{None} when the gate is full.
        """
        if self.in_use >= self.limit:
            return None
        self.in_use += 1
        self._changed()
        return Slot(self)

    def when_idle(self) -> Deferred[None]:
        """
        @return: a Deferred firing once nothing holds a slot.
        """
        if self.in_use == 0:
            return succeed(None)
        d: Deferred[None] = Deferred()

        self._idle_waiters.append(d)
        return d

    def _released(self) -> None:
        self.in_use -= 1
        self._changed()
        if self.in_use == 0:
            waiters, self._idle_waiters = self._idle_waiters, []
            for d in waiters:
                d.callback(None)

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change(self.in_use)
