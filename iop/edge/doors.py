"""
Doors per source address: how many connections one address may have
inside at once, and a line where its others wait, unread, instead of
taking places that belong to other addresses (docs/edge.md, "Doors per
source address").

L{Doors} only counts and decides; the listener does the rest with the
two callables each connection gives it: C{enter} (its wait is over: read
it from now on) and C{evict} (put it out to make room). It knows nothing
of sockets or HTTP.

  - An address has at most C{per_address} connections inside; more wait
    in its line, oldest first, at most C{per_address} of them. A full
    line refuses at once.
  - When one of an address's connections leaves, the oldest of its line
    goes in.
  - All connections together, inside and waiting, are at most C{total}.
    When that is reached, a newcomer takes the place of the oldest
    waiting connection of the longest line (a newcomer from the address
    of that line is refused instead); with nobody waiting, it is
    refused. So an address within its cap is never shut out by another
    address's connections over their cap.
  - Optionally (C{hall}, the Node port's choice) a newcomer that would
    be refused because every place is taken waits instead in one
    first-come line beyond C{total}, the hall, at most C{hall} of them;
    as places free, the oldest of the hall takes them (inside, or in its
    address's line). So a herd larger than C{total} gets in in order
    instead of being reset, while an address within its cap still takes
    the place of a waiting connection before the hall does.

Finding the longest line walks the lines, and only when every place is
taken; an address has a line only while it has C{per_address}
connections inside, so there are at most C{total / per_address} lines.
"""

from collections import deque
from collections.abc import Callable

#: Why a connection was refused or put out (the C{reason} label of
#: C{iop_edge_refusals_total}).
FULL = "max_http_connections"
LINE_FULL = "max_http_connections_per_address"
EVICTED = "address_line_evicted"
#: A waiting connection closed at its header deadline (the listener's).
WAITED_OUT = "address_wait_timeout"


class Ticket:
    """
    One connection's place: inside, or waiting in its address's line.
    """

    __slots__ = ("host", "enter", "evict", "inside", "in_hall", "gone")

    def __init__(self, host: str | None, enter: Callable[[], None], evict: Callable[[], None]) -> None:
        self.host = host
        self.enter = enter
        self.evict = evict
        self.inside = False
        self.in_hall = False
        self.gone = False


class Doors:
    """
    @param per_address: connections one address may have inside at once
        (and waiting at once, unless C{line} says otherwise); 0 for no
        per-address limit.
    @param total: connections at once, inside and waiting together.
    @param refused: called with the reason of each refusal or eviction
        (L{FULL}, L{LINE_FULL}, L{EVICTED}).
    @param line: the longest an address's line may be (default
        C{per_address}).
    @param hall: how many connections may wait beyond C{total} (default
        0: none, a newcomer finding every place taken is refused).

    @ivar count: connections inside or waiting in a line (not the hall).
    @ivar waiting: connections waiting in a line.
    @ivar waits: connections that ever waited in a line or the hall.
    """

    def __init__(
        self,
        per_address: int,
        total: int,
        refused: Callable[[str], None] = lambda reason: None,
        line: int | None = None,
        hall: int = 0,
    ) -> None:
        self.refused = refused
        self.set_limits(per_address, total, line, hall)
        self.count = 0
        self.waiting = 0
        self.waits = 0
        self._inside: dict[str | None, int] = {}
        self._lines: dict[str | None, deque[Ticket]] = {}
        # Insertion-ordered, so the oldest is first and any leaves in O(1).
        self._hall: dict[Ticket, None] = {}

    def set_limits(self, per_address: int, total: int, line: int | None = None, hall: int = 0) -> None:
        """
        Change the limits (a reloaded configuration); connections already
        in keep their places, and the new limits apply from the next one.
        """
        self.per_address = per_address
        self.total = total
        self.line_limit = per_address if line is None else line
        self.hall_limit = hall

    @property
    def in_hall(self) -> int:
        """
        Connections waiting in the hall, beyond C{total}.
        """
        return len(self._hall)

    def inside(self, host: str | None) -> int:
        return self._inside.get(host, 0)

    def line(self, host: str | None) -> int:
        return len(self._lines.get(host, ()))

    def arrive(self, host: str | None, enter: Callable[[], None], evict: Callable[[], None]) -> Ticket | None:
        """
        A connection from C{host} (C{None}: no address to count by, e.g. a
        UNIX socket) arrives.

        @return: its L{Ticket} (C{inside} says whether it may be read now),
            or C{None}: it is refused.
        """
        over = self._over(host)
        if over and self.line(host) >= self.line_limit:
            self.refused(LINE_FULL)
            return None
        ticket = Ticket(host, enter, evict)
        if self.count >= self.total and not self._make_room(host if over else None):
            if len(self._hall) >= self.hall_limit:
                self.refused(FULL)
                return None
            ticket.in_hall = True
            self._hall[ticket] = None
            self.waits += 1
            return ticket
        self._place(ticket, over)
        return ticket

    def _over(self, host: str | None) -> bool:
        return bool(self.per_address) and host is not None and self.inside(host) >= self.per_address

    def _place(self, ticket: Ticket, over: bool) -> None:
        """
        Count C{ticket} in: inside, or at the end of its address's line.
        """
        self.count += 1
        if over:
            self._lines.setdefault(ticket.host, deque()).append(ticket)
            self.waiting += 1
            if not ticket.in_hall:
                self.waits += 1
        else:
            self._go_in(ticket)
        ticket.in_hall = False

    def _make_room(self, waiting_host: str | None) -> bool:
        """
        Put out the oldest waiting connection of the longest line, unless
        that is the line of C{waiting_host} (a newcomer that would wait
        there itself). @return: whether a place was freed.
        """
        if not self._lines:
            return False
        host, line = max(self._lines.items(), key=lambda item: len(item[1]))
        if waiting_host is not None and len(self._lines.get(waiting_host, ())) >= len(line):
            return False
        victim = line.popleft()
        if not line:
            del self._lines[host]
        self.waiting -= 1
        self._gone(victim)
        self.refused(EVICTED)
        victim.evict()
        return True

    def leave(self, ticket: Ticket) -> None:
        """
        C{ticket}'s connection closed; if it was inside, the oldest of its
        address's line goes in (C{enter} is called), and the oldest of the
        hall take the places that are free.
        """
        if ticket.gone:
            return
        if ticket.in_hall:
            ticket.gone = True
            del self._hall[ticket]
            return
        self._gone(ticket)
        host = ticket.host
        if not ticket.inside:
            waiting_in = self._lines[host]
            waiting_in.remove(ticket)
            if not waiting_in:
                del self._lines[host]
            self.waiting -= 1
        else:
            self._let_in_from_line(host)
        self._let_in_from_hall()

    def _let_in_from_line(self, host: str | None) -> None:
        """
        One of C{host}'s connections inside left: the oldest of its line
        takes its place.
        """
        left = self._inside[host] - 1
        if left:
            self._inside[host] = left
        else:
            del self._inside[host]
        line = self._lines.get(host)
        if line:
            promoted = line.popleft()
            if not line:
                del self._lines[host]
            self.waiting -= 1
            self._go_in(promoted)
            promoted.enter()

    def _let_in_from_hall(self) -> None:
        """
        Places are free: the oldest of the hall take them, inside (told
        C{enter}) or in their address's line.
        """
        while self._hall and self.count < self.total:
            ticket = next(iter(self._hall))
            del self._hall[ticket]
            over = self._over(ticket.host)
            if over and self.line(ticket.host) >= self.line_limit:
                ticket.gone = True
                self.refused(LINE_FULL)
                ticket.evict()
                continue
            self._place(ticket, over)
            if ticket.inside:
                ticket.enter()

    def _go_in(self, ticket: Ticket) -> None:
        ticket.inside = True
        self._inside[ticket.host] = self._inside.get(ticket.host, 0) + 1

    def _gone(self, ticket: Ticket) -> None:
        ticket.gone = True
        self.count -= 1
