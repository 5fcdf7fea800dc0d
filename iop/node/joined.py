"""
Text deltas joined per reactor turn, on their way from an adapter to the
wire.

A provider that writes a burst of events (a model server catching up, a
fast back end, a long answer read 64 KiB at a time) gets them read in one
piece (L{iop.adapters.streams.read_body}); an HTTP adapter emits the
text of one read as one delta already, others (a command-line tool's
lines, a TLS read record by record) one C{delta} per event, all in the
same turn. Sent as they are, each costs a
frame, a store row and a pass through the Edge's dispatch, to end up in
the caller's socket in the same write. L{JoinedDeltas} sends the text of
consecutive deltas of one kind emitted in one turn as one delta, early in
the next turn: the text, its order and everything else are the same, no
delta waits for more than the rest of its turn, and a stream whose events
come one per turn (a paced model) is sent event by event as before.
"""

from collections.abc import Callable

from iop.run import HeldDeltas, RunEventData, joinable
from iop.turns import EndOfTurn


class JoinedDeltas(HeldDeltas):
    """
    Holds the text deltas of this turn for C{send}, in order
    (L{HeldDeltas}, flushed at the end of the turn).

    @param send: sends one event on.
    @param turns: the L{EndOfTurn} of the reactor whose turns bound a join.
    """

    def __init__(self, send: Callable[[RunEventData], object], turns: EndOfTurn) -> None:
        super().__init__(send)
        self._turns = turns

    def __call__(self, event: RunEventData) -> None:
        """
        Send C{event}: a text delta is held until the end of the turn (or
        the next event that is not of its kind); anything else goes out at
        once, after what was held.
        """
        if joinable(event) and self.held_type != event.type:
            # (What a flush before the end of the turn left finds nothing
            # held.)
            self._turns.at_end(self.flush)
        super().__call__(event)
