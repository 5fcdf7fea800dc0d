"""
Tests for L{iop.turns}: many calls at the end of a turn on one timer.
"""

from functools import partial

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from iop.turns import EndOfTurn


class EndOfTurnTests(SynchronousTestCase):
    def test_one_timer_in_order(self) -> None:
        clock = Clock()
        turns = EndOfTurn(clock)
        called: list[int] = []
        for i in range(100):
            turns.at_end(partial(called.append, i))
        self.assertEqual(len(clock.getDelayedCalls()), 1)
        self.assertEqual(called, [])
        clock.advance(0)
        self.assertEqual(called, list(range(100)))
        self.assertEqual(clock.getDelayedCalls(), [])

    def test_asked_while_running_waits_for_the_next_turn(self) -> None:
        clock = Clock()
        turns = EndOfTurn(clock)
        called: list[str] = []

        def first() -> None:
            called.append("first")
            turns.at_end(lambda: called.append("second"))
            self.assertEqual(len(clock.getDelayedCalls()), 1)

        turns.at_end(first)
        clock.advance(0)
        self.assertEqual(called, ["first", "second"])

    def test_a_failing_call_does_not_stop_the_others(self) -> None:
        """
        A call that raises is logged; the calls after it in the same turn
        still run, and the next turn gets its timer as usual.
        """
        clock = Clock()
        turns = EndOfTurn(clock)
        called: list[str] = []

        def broken() -> None:
            raise ZeroDivisionError("one caller's bug")

        turns.at_end(partial(called.append, "before"))
        turns.at_end(broken)
        turns.at_end(partial(called.append, "after"))
        clock.advance(0)
        self.assertEqual(called, ["before", "after"])
        self.assertEqual(len(self.flushLoggedErrors(ZeroDivisionError)), 1)
        turns.at_end(partial(called.append, "next turn"))
        clock.advance(0)
        self.assertEqual(called, ["before", "after", "next turn"])
