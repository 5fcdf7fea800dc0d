"""
Tests for L{iop.node.joined}: the text deltas of one reactor turn go out
as one, in order, and nothing else waits.
"""

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from iop.node.joined import JoinedDeltas
from iop.run import DELTA, HELD_MAX_CHARS, REASONING_DELTA, START, TOOL_CALL, RunEventData, ToolCall, Usage
from iop.turns import EndOfTurn


class JoinedDeltasTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.sent: list[RunEventData] = []
        self.join = JoinedDeltas(self.sent.append, EndOfTurn(self.clock))

    def test_one_turn_one_delta(self) -> None:
        for word in ("hello ", "brave ", "world"):
            self.join(RunEventData(DELTA, text=word))
        self.assertEqual(self.sent, [])
        self.clock.advance(0)
        self.assertEqual(self.sent, [RunEventData(DELTA, text="hello brave world")])
        self.join(RunEventData(DELTA, text="!"))
        self.clock.advance(0)
        self.assertEqual(self.sent[1:], [RunEventData(DELTA, text="!")])

    def test_kinds_kept_apart_in_order(self) -> None:
        self.join(RunEventData(REASONING_DELTA, text="think "))
        self.join(RunEventData(REASONING_DELTA, text="more"))
        self.join(RunEventData(DELTA, text="answer"))
        self.clock.advance(0)
        self.assertEqual(
            self.sent, [RunEventData(REASONING_DELTA, text="think more"), RunEventData(DELTA, text="answer")]
        )

    def test_anything_else_goes_at_once_after_what_is_held(self) -> None:
        call = ToolCall("c1", "f", "{}")
        self.join(RunEventData(START))
        self.join(RunEventData(DELTA, text="a"))
        self.join(RunEventData(DELTA, text="b", usage=Usage(1, 2)))
        self.join(RunEventData(TOOL_CALL, tool_call=call))
        self.assertEqual(
            self.sent,
            [
                RunEventData(START),
                RunEventData(DELTA, text="a"),
                RunEventData(DELTA, text="b", usage=Usage(1, 2)),
                RunEventData(TOOL_CALL, tool_call=call),
            ],
        )
        self.clock.advance(0)
        self.assertEqual(len(self.sent), 4)

    def test_flush_sends_once(self) -> None:
        self.join.flush()
        self.assertEqual(self.sent, [])
        self.join(RunEventData(DELTA, text="x"))
        self.join.flush()
        self.clock.advance(0)
        self.assertEqual(self.sent, [RunEventData(DELTA, text="x")])
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_a_join_fits_in_a_frame(self) -> None:
        """
        A turn's text past HELD_MAX_CHARS goes out in pieces of at most
        that many characters, in order, the text unchanged: one event must
        fit in a frame, however much one turn read.
        """
        piece = "x" * (HELD_MAX_CHARS // 4 + 1)
        for _ in range(5):
            self.join(RunEventData(DELTA, text=piece))
        self.join(RunEventData(DELTA, text="y" * (2 * HELD_MAX_CHARS + 5)))
        self.clock.advance(0)
        self.assertTrue(all(len(e.text) <= HELD_MAX_CHARS for e in self.sent))
        self.assertEqual("".join(e.text for e in self.sent), piece * 5 + "y" * (2 * HELD_MAX_CHARS + 5))
        self.assertEqual({e.type for e in self.sent}, {DELTA})
