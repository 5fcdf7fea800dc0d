"""
Taking caller work in bounded batches, so that a burst never holds the
reactor for long.

A burst of requests that arrive together would otherwise all be placed in
the reactor turn that read them; timers (heartbeats among them) wait for
that turn to end. The first L{ADMIT_PER_TURN} submissions of a turn are
placed at once; the rest wait in a FIFO backlog that is placed, the same
number per turn, on the turns after, each turn yielding to the reactor in
between. Order is kept: once anything waits in the backlog, new work
queues behind it.
"""

from collections import deque

from twisted.internet import defer

#: Submissions placed per reactor turn.
ADMIT_PER_TURN = 64


class _Entry:
    def __init__(self, work):
        self.work = work
        self.inner = None  # the placement's Deferred, once started
        self.outer = defer.Deferred(self._cancel)

    def _cancel(self, _):
        if self.inner is not None and not self.inner.called:
            self.inner.cancel()


class Admission:
    """
    @param place: C{place(work)} starts placing one piece of work and
        returns its (cancellable) Deferred.
    """

    def __init__(self, clock, place, per_turn=ADMIT_PER_TURN):
        self.clock = clock
        self.place = place
        self.per_turn = per_turn
        self.backlog = deque()
        self._placed_this_turn = 0
        self._turn = None

    def __len__(self):
        return len(self.backlog)

    def submit(self, work):
        """
        @return: a cancellable Deferred with the outcome of L{place}.
        """
        if not self.backlog and self._placed_this_turn < self.per_turn:
            self._placed_this_turn += 1
            self._next_turn_later()
            return self.place(work)
        entry = _Entry(work)
        self.backlog.append(entry)
        self._next_turn_later()
        return entry.outer

    def _next_turn_later(self):
        if self._turn is None:
            self._turn = self.clock.callLater(0, self._next_turn)

    def _next_turn(self):
        self._turn = None
        self._placed_this_turn = 0
        while self.backlog and self._placed_this_turn < self.per_turn:
            entry = self.backlog.popleft()
            if entry.outer.called:
                continue  # cancelled while it waited
            self._placed_this_turn += 1
            entry.inner = self.place(entry.work)
            entry.inner.chainDeferred(entry.outer)
        if self.backlog or self._placed_this_turn:
            self._next_turn_later()
