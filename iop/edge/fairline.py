"""
The order in which one queue's waiters are served when several caller
keys (tenants) share it (docs/edge.md, "Tenants").

Three rules, in this order:

  1. B{Priority classes.} Waiting work of a higher C{priority} is served
     before any of a lower one. Work that already started is never
     preempted: priorities only order the line.
  2. B{Weighted fair share of tokens} within a class. Every tenant has a
     I{virtual token counter}: the tokens it was served divided by its
     C{weight}. The waiting tenant with the lowest counter is served next
     (ties: the one served least recently, so equals take turns and a
     newcomer goes first). A tenant is charged its
     work's estimated tokens when the work is granted a slot, and the
     difference to the tokens the provider reported when it ends, so
     shares converge to the weights in tokens, not in requests.
  3. B{FIFO} within one tenant and class.

A tenant that had nothing waiting cannot bank credit while it was away:
when it starts waiting again in a class its counter is lifted to the
lowest counter among the tenants already waiting in that class (the
"virtual token counter" rule; a backlog of another class does not count), so a
newcomer is served next (it was served least recently) but does not then
monopolise the line: it waits at most for the next free slot. Work still
running counts at its provisional estimate (the pool charges its input
and at most C{limits.token_estimate} of answer, not a caller's
C{max_tokens}: one of 10**18 would lift a newcomer to where it stays
behind that tenant's whole line once the work settles for what it cost).
The line is work-conserving: it only orders waiters, so a lone tenant
still gets every free slot.

The line knows nothing of leases, clocks or Twisted; the pool
(L{iop.edge.pool}) decides who I{can} be served, the line who I{should}.
"""

import heapq
from collections.abc import Callable, Hashable, Iterator
from typing import Generic, Protocol, TypeVar


class Waiting(Protocol):
    """
    What the line needs of a waiter.

    @ivar seq: arrival order (lower is older), unique.
    @ivar tenant: the caller key's name.
    @ivar weight: the tenant's share weight (> 0).
    @ivar priority: the waiter's class (higher first).
    """

    seq: int
    tenant: str
    weight: float
    priority: int

    @property
    def cost(self) -> int | None:
        """
        What its grant will charge its tenant (L{FairLine.grant}), for
        positions; C{None}: its grant is not recorded at all (not even as
        a turn taken).
        """


W = TypeVar("W", bound=Waiting)


class FairLine(Generic[W]):
    """
    The waiters of one queue, by priority class and tenant (any kind of
    L{Waiting}: the line hands back what it was given).
    """

    def __init__(self, kind: Callable[[W], Hashable] | None = None) -> None:
        """
        @param kind: what a waiter can be served by (for L{first}): waiters
            of one kind can all be served or none can, so the line keeps
            each tenant's waiters by kind too and a choice looks at kinds,
            not at every waiter. C{None}: one kind for all.
        """
        #: priority -> tenant -> its waiters, oldest first (a dict as an
        #: ordered set: O(1) removal of a waiter that leaves early).
        self._levels: dict[int, dict[str, dict[W, None]]] = {}
        self._kind: Callable[[W], Hashable] = kind or _one_kind
        #: priority -> tenant -> kind -> its waiters of that kind, oldest first.
        self._by_kind: dict[int, dict[str, dict[Hashable, dict[W, None]]]] = {}
        #: kind -> how many of its waiters are in the line.
        self._kinds: dict[Hashable, int] = {}
        #: tenant -> tokens settled / weight.
        self._virtual: dict[str, float] = {}
        #: tenant -> weight -> estimated tokens of its work granted at that
        #: weight and not yet settled (whole numbers, so that a huge
        #: estimate leaves no residue behind when it settles).
        self._pending: dict[str, dict[float, int]] = {}
        #: tenant -> when it was last granted a slot (a grant count).
        self._last_grant: dict[str, int] = {}
        self._grants = 0
        self._size = 0
        #: tenant -> how many of its waiters are in the line.
        self._counts: dict[str, int] = {}

    def __len__(self) -> int:
        return self._size

    def __iter__(self) -> Iterator[W]:
        """
        Every waiter (in no particular order across tenants).
        """
        for level in self._levels.values():
            for fifo in level.values():
                yield from fifo

    def __contains__(self, waiter: W) -> bool:
        fifo = self._levels.get(waiter.priority, {}).get(waiter.tenant)
        return fifo is not None and waiter in fifo

    def counter(self, tenant: str) -> float:
        """
        The tenant's virtual token counter: tokens served / weight, its
        running work counted at its estimate.
        """
        pending = self._pending.get(tenant, {})
        return self._virtual.get(tenant, 0.0) + sum(tokens / weight for weight, tokens in pending.items())

    def add(self, waiter: W) -> None:
        level = self._levels.setdefault(waiter.priority, {})
        fifo = level.get(waiter.tenant)
        if fifo is None:
            self._lift(waiter.tenant, level)
            fifo = level[waiter.tenant] = {}
        fifo[waiter] = None
        self._size += 1
        self._counts[waiter.tenant] = self._counts.get(waiter.tenant, 0) + 1
        kind = self._kind(waiter)
        kinds = self._by_kind.setdefault(waiter.priority, {}).setdefault(waiter.tenant, {})
        kinds.setdefault(kind, {})[waiter] = None
        self._kinds[kind] = self._kinds.get(kind, 0) + 1

    def remove(self, waiter: W) -> None:
        level = self._levels[waiter.priority]
        fifo = level[waiter.tenant]
        del fifo[waiter]
        self._size -= 1
        left = self._counts[waiter.tenant] - 1
        if left:
            self._counts[waiter.tenant] = left
        else:
            del self._counts[waiter.tenant]
        if not fifo:
            del level[waiter.tenant]
            if not level:
                del self._levels[waiter.priority]
        kind = self._kind(waiter)
        by_tenant = self._by_kind[waiter.priority]
        kinds = by_tenant[waiter.tenant]
        of_kind = kinds[kind]
        del of_kind[waiter]
        if not of_kind:
            del kinds[kind]
            if not kinds:
                del by_tenant[waiter.tenant]
                if not by_tenant:
                    del self._by_kind[waiter.priority]
        left = self._kinds[kind] - 1
        if left:
            self._kinds[kind] = left
        else:
            del self._kinds[kind]

    def has(self, tenant: str) -> bool:
        """
        Whether C{tenant} has a waiter in the line (O(1): a caller asking
        for its own waiters skips lines where it has none).
        """
        return tenant in self._counts

    def crowding(self, tenant: str) -> W | None:
        """
        The waiter to turn away so that C{tenant} may wait in a full line:
        the newest of the lowest class of the tenant with the most
        waiters, if that tenant has at least two more than C{tenant} (so
        the line ends shared, never flipping between two). C{None}: no one
        is crowding C{tenant} out, and C{tenant} is the one to refuse.
        """
        if not self._counts:
            return None
        heavy = max(self._counts, key=self._counts.__getitem__)
        if self._counts[heavy] <= self._counts.get(tenant, 0) + 1:
            return None
        for priority in sorted(self._levels):
            fifo = self._levels[priority].get(heavy)
            if fifo:
                return next(reversed(fifo))
        return None

    def grant(self, tenant: str, weight: float, estimate: int) -> None:
        """
        C{tenant} was granted a slot for work expected to cost
        C{estimate} tokens; L{settle} follows once, when it ends.
        """
        self._grants += 1
        self._last_grant[tenant] = self._grants
        pending = self._pending.setdefault(tenant, {})
        pending[weight] = pending.get(weight, 0) + estimate

    def settle(self, tenant: str, weight: float, estimate: int, tokens: int) -> None:
        """
        Work of C{tenant} granted at C{weight} for C{estimate} tokens
        ended having cost C{tokens}.
        """
        pending = self._pending.get(tenant, {})
        left = pending.get(weight, 0) - estimate
        if left > 0:
            pending[weight] = left
        else:
            pending.pop(weight, None)
            if not pending:
                self._pending.pop(tenant, None)
        self._virtual[tenant] = self._virtual.get(tenant, 0.0) + tokens / weight

    def _rank(self, tenant: str, fifo: dict[W, None]) -> tuple[float, int, int]:
        return (self.counter(tenant), self._last_grant.get(tenant, 0), _head(fifo).seq)

    def order(self) -> Iterator[W]:
        """
        Every waiter in the order it should be served now: classes highest
        first; within one, tenants by counter (then least recently
        served, then oldest waiter); each
        tenant's waiters oldest first. The caller serves the first it can
        and asks again, since serving changes the counters.
        """
        for priority in sorted(self._levels, reverse=True):
            level = self._levels[priority]
            for tenant in sorted(level, key=lambda t: self._rank(t, level[t])):
                yield from level[tenant]

    def first(self, usable: Callable[[Hashable], bool]) -> W | None:
        """
        The first waiter of L{order} whose kind is C{usable}, or C{None}.

        C{usable} is asked once per kind waiting, and each tenant's
        waiters are looked at only by the oldest of each kind: the cost
        is that of the kinds and tenants waiting, not of the waiters (a
        line none of whom fits costs as little as an empty one to ask).
        """
        kinds = {kind for kind in self._kinds if usable(kind)}
        if not kinds:
            return None
        for priority in sorted(self._levels, reverse=True):
            level = self._levels[priority]
            by_tenant = self._by_kind[priority]
            best: tuple[tuple[float, int, int], W] | None = None
            for tenant, fifo in level.items():
                of_tenant = by_tenant[tenant]
                heads = [_head(of_kind) for kind, of_kind in of_tenant.items() if kind in kinds]
                if not heads:
                    continue
                rank = self._rank(tenant, fifo)
                if best is None or rank < best[0]:
                    best = (rank, min(heads, key=lambda waiter: waiter.seq))
            if best is not None:
                return best[1]
        return None

    def positions(self, tenant: str | None = None) -> dict[W, int]:
        """
        Where each waiter stands (1: next), if every waiter ahead of it is
        served and costs what its grant charges (L{Waiting.cost}): the
        fair order played forward, one grant at a time, each charged as
        L{grant} would, carried from class to class, in O(n log tenants).

        @param tenant: only this tenant's waiters: a class of none of its
            waiters is counted whole, not played (all of a higher class
            stands ahead, none of a lower one), unless a tenant of it also
            waits in a class that is played (what it is served there
            moves it there); the last class where C{tenant} waits is
            played only until its last waiter is placed; a line where it
            waits not at all costs nothing. So a key asking where its
            work stands pays for its work and what stands ahead of it,
            not for the whole line.
        """
        positions: dict[W, int] = {}
        levels = sorted(self._levels, reverse=True)
        played: set[int] = set()
        if tenant is not None:
            if tenant not in self._counts:
                return positions
            mine = [priority for priority in levels if tenant in self._levels[priority]]
            levels = levels[: levels.index(mine[-1]) + 1]
            # Bottom up: a class is played when the tenant waits in it or
            # one of its tenants waits in a class played below it.
            below: set[str] = set()
            for priority in reversed(levels):
                level = self._levels[priority]
                if tenant in level or not below.isdisjoint(level):
                    played.add(priority)
                    below.update(level)
        # What the play-through granted so far: tenant -> its pending
        # tokens by weight, and its last grant (as L{grant} keeps them, so
        # counters come out as L{counter} would compute them, bit for bit).
        pending: dict[str, dict[float, int]] = {}
        stamps: dict[str, int] = {}
        grants = self._grants

        def counter(name: str) -> float:
            tokens = pending.get(name)
            if tokens is None:
                return self.counter(name)
            return self._virtual.get(name, 0.0) + sum(t / weight for weight, t in tokens.items())

        position = 0
        for priority in levels:
            level = self._levels[priority]
            size = sum(len(fifo) for fifo in level.values())
            if tenant is not None and priority not in played:
                position += size
                continue
            # Only the last class played may stop early: what the rest of
            # a class is served moves its tenants in the classes below.
            last = tenant is not None and priority == levels[-1]
            wanted = len(level[tenant]) if tenant is not None and last else size
            end = position + size
            lines = {name: iter(fifo) for name, fifo in level.items()}
            heap = [
                (
                    counter(name),
                    stamps.get(name, self._last_grant.get(name, 0)),
                    _head(fifo).seq,
                    name,
                    next(lines[name]),
                )
                for name, fifo in level.items()
            ]
            heapq.heapify(heap)
            while heap and wanted:
                virtual, stamp, _, name, waiter = heapq.heappop(heap)
                position += 1
                if tenant is None or name == tenant:
                    positions[waiter] = position
                if not last or name == tenant:
                    wanted -= 1
                cost = waiter.cost
                if cost is not None:
                    grants += 1
                    stamp = stamps[name] = grants
                    tokens = pending.setdefault(name, dict(self._pending.get(name, {})))
                    tokens[waiter.weight] = tokens.get(waiter.weight, 0) + cost
                    virtual = counter(name)
                after = next(lines[name], None)
                if after is not None:
                    heapq.heappush(heap, (virtual, stamp, after.seq, name, after))
            position = end
        return positions

    def _lift(self, tenant: str, level: dict[str, dict[W, None]]) -> None:
        """
        C{tenant} starts waiting in C{level}'s class: lift its counter to
        the lowest counter of the tenants already waiting in that class.
        Fair share orders tenants within a class, so only they count: a
        backlog of a lower class (never served while this one is busy)
        would otherwise hold the lift down, and a tenant could bank credit
        by keeping one waiter parked in a low class. Only this class's
        tenants are scanned (at most one per key), not every waiter.
        """
        waiting = [self.counter(t) for t in level]
        if waiting:
            self._virtual[tenant] = max(self._virtual.get(tenant, 0.0), min(waiting))


def _head(fifo: dict[W, None]) -> W:
    return next(iter(fifo))


def _one_kind(waiter: object) -> Hashable:
    """
    The kind of every waiter of a line given none: L{FairLine.first} then
    asks once whether anyone can be served.
    """
    return None
