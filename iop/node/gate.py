"""
The Node's capacity gate: how much work one adapter instance has in hand.

Normalized runs and raw tunnels on the same adapter instance take slots
from the same gate, so even work that bypassed the Edge's admission never
exceeds the back end's C{max_concurrency}. A full gate refuses at once:
the Node never queues (queueing is the Edge's job).
"""

from twisted.internet.defer import Deferred, succeed


class Slot:
    """
    One unit of capacity held by one run or tunnel. Releasing is
    idempotent, so every exit path may call it and the count stays exact.
    """

    def __init__(self, gate):
        self._gate = gate
        self.released = False

    def release(self):
        if not self.released:
            self.released = True
            self._gate._released()


class CapacityGate:
    """
    Counts in-flight work against C{limit}.

    @ivar onChange: called with the new in-use count after every change
        (the metrics gauge listens here).
    """

    def __init__(self, limit, onChange=None):
        self.limit = limit
        self.inUse = 0
        self.onChange = onChange
        self._idleWaiters = []

    def acquire(self):
        """
        @return: a L{Slot}, or C{None} when the gate is full.
        """
        if self.inUse >= self.limit:
            return None
        self.inUse += 1
        self._changed()
        return Slot(self)

    def whenIdle(self):
        """
        @return: a Deferred firing once nothing holds a slot.
        """
        if self.inUse == 0:
            return succeed(None)
        d = Deferred()
        self._idleWaiters.append(d)
        return d

    def _released(self):
        self.inUse -= 1
        self._changed()
        if self.inUse == 0:
            waiters, self._idleWaiters = self._idleWaiters, []
            for d in waiters:
                d.callback(None)

    def _changed(self):
        if self.onChange is not None:
            self.onChange(self.inUse)
