"""
Work put off to the end of the reactor's turn, for many callers on one
timer.

Gathering what arrives in one turn (a provider's burst read as one piece,
the text deltas of one turn sent as one) needs a call early in the next
turn. With a C{callLater(0)} per stream, a Node relaying hundreds of paced
streams, each event in a turn of its own, would add and run hundreds of
timers per turn; L{EndOfTurn} keeps one for all of them.
"""

from collections.abc import Callable

from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger


class EndOfTurn:
    """
    Calls made once, early in the reactor's next turn, in the order they
    were asked for, on one C{callLater(0)}. A call asked for while they run
    waits for the turn after. The calls are the business of many callers
    (every run of a Node): one that raises is logged, and the others run
    all the same.
    """

    log = Logger()

    def __init__(self, reactor: IReactorTime) -> None:
        self._reactor = reactor
        self._calls: list[Callable[[], object]] = []
        self._timer: IDelayedCall | None = None

    def at_end(self, call: Callable[[], object]) -> None:
        self._calls.append(call)
        if self._timer is None:
            self._timer = self._reactor.callLater(0, self._run)

    def _run(self) -> None:
        self._timer = None
        calls, self._calls = self._calls, []
        for call in calls:
            try:
                call()
            except Exception:
                self.log.failure("a call at the end of the turn failed: {call!r}", call=call)
