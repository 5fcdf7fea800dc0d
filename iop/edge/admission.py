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
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from twisted.internet import defer
from twisted.internet.interfaces import IDelayedCall, IReactorTime

#: Submissions placed per reactor turn.
ADMIT_PER_TURN = 64

#: The work submitted, and what placing it gives.
W = TypeVar("W")
R = TypeVar("R")


class _Entry(Generic[W, R]):
    def __init__(self, work: W) -> None:
        self.work = work
        self.inner: defer.Deferred[R] | None = None  # the placement's Deferred, once started
        self.outer: defer.Deferred[R] = defer.Deferred(self._cancel)

    def _cancel(self, _: Any) -> None:
        if self.inner is not None and not self.inner.called:
            self.inner.cancel()


class Admission(Generic[W, R]):
    """
    @param place: C{place(work)} starts placing one piece of work and
        returns its (cancellable) Deferred.
    """

    def __init__(
        self, clock: IReactorTime, place: Callable[[W], "defer.Deferred[R]"], per_turn: int = ADMIT_PER_TURN
    ) -> None:
        self.clock = clock
        self.place = place
        self.per_turn = per_turn
        self.backlog: deque[_Entry[W, R]] = deque()
        self._placed_this_turn = 0
        self._turn: IDelayedCall | None = None

    def __len__(self) -> int:
        return len(self.backlog)

    def places_now(self) -> bool:
        """
        Whether the next L{submit} is placed in that call (else it waits
        in the backlog for a later turn).
        """
        return not self.backlog and self._placed_this_turn < self.per_turn

    def submit(self, work: W) -> "defer.Deferred[R]":
        """
        @return: a cancellable Deferred with the outcome of L{place}.
        """
        if self.places_now():
            self._placed_this_turn += 1
            self._next_turn_later()
            return self.place(work)
        entry: _Entry[W, R] = _Entry(work)
        self.backlog.append(entry)
        self._next_turn_later()
        return entry.outer

    def _next_turn_later(self) -> None:
        if self._turn is None:
            self._turn = self.clock.callLater(0, self._next_turn)

    def _next_turn(self) -> None:
        self._turn = None
        self._placed_this_turn = 0
        while self.backlog and self._placed_this_turn < self.per_turn:
            entry = self.backlog.popleft()
            if entry.outer.called:
                continue  # cancelled while it waited
            self._placed_this_turn += 1
            inner = entry.inner = self.place(entry.work)
            inner.chainDeferred(entry.outer)

        if self.backlog or self._placed_this_turn:
            self._next_turn_later()
