"""
Where one caller request's time went, for its C{Server-Timing} header and
the histogram of the gateway's own time (docs/edge.md, "Server-Timing").

A L{Timing} is made with the request and marked as the request passes
each stage: handed to the service (it may wait for capacity), placed (a
lease was granted), sent to the Node, answered (the Node's first frame,
which says how long the back end took to answer as the Node saw it), and
ended (the Node's terminal frame); or, at an Edge of a cluster that
sent it to the Edge that serves it, forwarded. When the answer's headers
go out, what was marked by then becomes

  - C{queue}: from submission to the lease (waiting for capacity);
  - C{place}: from the lease until the request was on its way to the Node;
  - C{node}: the Node's part of the round trip (the wire both ways and the
    Node's own work: the round trip less the provider's part);
  - C{provider}: the back end's time to its first answer, as the Node
    measured it;
  - C{generate}: from the Node's first frame to its terminal, of an answer
    whose headers go out once it is whole (a non-streamed one): the back
    end's generation, which is no time of the Edge's;
  - C{forward}: the Edge of the cluster that served it (whose own
    C{Server-Timing} comes before), from the forward to its headers;
  - C{edge}: everything else the Edge spent (reading, checking and
    rendering), the gateway's own time.

Every duration is in milliseconds; a stage not reached (a request the
Edge answers itself, or headers sent while work still waits) is left out.
"""

from dataclasses import dataclass


@dataclass
class Timing:
    """
    The marks, as reactor times in seconds (C{None}: not reached).

    @ivar first_byte_ms: the Node's time from the request to the back end's
        first answer (its first frame's C{first_byte_ms}).
    """

    arrived: float | None = None
    submitted: float | None = None
    placed: float | None = None
    sent: float | None = None
    answered: float | None = None
    last_heard: float | None = None
    forwarded: float | None = None
    first_byte_ms: float = 0.0

    def place(self, now: float) -> None:
        """
        A lease was granted (again, for a later attempt: the last counts).
        """
        self.placed = now
        self.sent = None
        self.answered = None
        self.last_heard = None

    def heard(self, now: float, first_byte_ms: float) -> None:
        """
        A frame of the placed work came back from the Node: the first is its
        answer, and the latest ends what it generated.
        """
        if self.sent is None:
            return
        if self.answered is None:
            self.answered = now
            self.first_byte_ms = first_byte_ms
        self.last_heard = now

    def parts(self, now: float) -> list[tuple[str, float]]:
        """
        C{(name, milliseconds)} for each stage reached by C{now}, C{edge}
        last.
        """
        parts = []
        if self.submitted is not None and self.placed is not None:
            parts.append(("queue", self.placed - self.submitted))
        if self.placed is not None and self.sent is not None:
            parts.append(("place", self.sent - self.placed))
        if self.sent is not None and self.answered is not None:
            round_trip = self.answered - self.sent
            provider = min(max(self.first_byte_ms / 1000, 0.0), round_trip)
            parts += [("node", round_trip - provider), ("provider", provider)]
            if self.last_heard is not None and self.last_heard > self.answered:
                parts.append(("generate", self.last_heard - self.answered))
        if self.forwarded is not None:
            parts.append(("forward", now - self.forwarded))
        if self.arrived is not None:
            spent = sum(seconds for _, seconds in parts)
            parts.append(("edge", max(now - self.arrived - spent, 0.0)))
        return [(name, seconds * 1000) for name, seconds in parts]

    def gateway_seconds(self, now: float) -> float:
        """
        The gateway's own time by C{now}: C{edge} and C{place}, what no
        back end, Node or queue accounts for.
        """
        return sum(ms for name, ms in self.parts(now) if name in ("edge", "place")) / 1000


def server_timing(parts: list[tuple[str, float]]) -> str:
    """
    The C{Server-Timing} header value for C{parts}.
    """
    described = {"provider": ';desc="first byte"', "generate": ';desc="rest of the answer"'}
    return ", ".join(f"{name};dur={ms:.3f}{described.get(name, '')}" for name, ms in parts)
