"""
Text deltas joined per reactor turn, on their way from an adapter to the
wire.

A provider that writes a burst of events (a model server catching up, a
fast back end, a long answer read 64 KiB at a time) gets them read in one
piece (L{iop.adapters.streams.read_body}), and its adapter emits one
C{delta} per event, all in the same turn. Sent as they are, each costs a
frame, a store row and a pass through the Edge's dispatch, to end up in
the caller's socket in the same write. L{JoinedDeltas} sends the text of
consecutive deltas of one kind emitted in one turn as one delta, early in
the next turn: the text, its order and everything else are the same, no
delta waits for more than the rest of its turn, and a stream whose events
come one per turn (a paced model) is sent event by event as before.
"""

from collections.abc import Callable

from iop.run import RunEventData, joinable
from iop.turns import EndOfTurn


class JoinedDeltas:
    """
    Holds the text deltas of this turn for C{send}, in order.

    @param send: sends one event on.
    @param turns: the L{EndOfTurn} of the reactor whose turns bound a join.
    """

    def __init__(self, send: Callable[[RunEventData], None], turns: EndOfTurn) -> None:
        self._send = send
        self._turns = turns
        self._kind: str | None = None
        self._texts: list[str] = []

    def __call__(self, event: RunEventData) -> None:
        """
        Send C{event}: a text delta is held until the end of the turn (or
        the next event that is not of its kind); anything else goes out at
        once, after what was held.
        """
        if not joinable(event):
            self.flush()
            self._send(event)
            return
        if self._kind != event.type:
            self.flush()
            self._kind = event.type
            # (What a flush before the end of the turn left finds
            # nothing held.)
            self._turns.at_end(self.flush)
        self._texts.append(event.text)

    def flush(self) -> None:
        """
        Send what is held now, as one delta.
        """
        if self._kind is None:
            return
        kind, texts = self._kind, self._texts
        self._kind, self._texts = None, []
        self._send(RunEventData(kind, text="".join(texts)))
