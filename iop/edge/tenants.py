"""
Caller keys as tenants of a shared Edge: who a piece of work is for, what
it is expected to cost, and the token budgets it is held to (docs/edge.md,
"Tenants").

  - L{Tenant}: a caller key's name with its share C{weight}, its
    C{priority} and its token budgets (C{api_keys[]} in C{edge.yaml};
    callers without a key are one tenant, C{anonymous}).
  - L{Ticket}: one request's standing: its tenant, its estimated tokens
    (input by length, plus C{max_tokens} or C{limits.token_estimate}),
    what to tell its caller while it waits, and — exactly once — what it
    really cost (L{Ticket.settle}), which whoever charged it on its way
    (fair share, budgets) hears of.
  - L{TokenBudgets}: C{tokens_per_minute} and C{tokens_per_day} per key,
    as token buckets: a request reserves its estimate at admission and is
    refused with L{BudgetExceeded} (HTTP 429 C{token_budget_exceeded}, with
    C{Retry-After}) when the bucket, less what running work reserved,
    cannot hold it; when it ends the reservation is replaced by the
    tokens the provider reported.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from iop.edge.errors import ServiceError
from iop.run import CANCELLED, COMPLETE

#: The tenant of callers without a key (an open API).
ANONYMOUS = "anonymous"

#: Tokens reserved for a request's answer when it names no C{max_tokens}
#: (C{limits.token_estimate}).
TOKEN_ESTIMATE = 1024

#: Characters per input token, for the estimate of a request's input.
CHARS_PER_TOKEN = 4

MINUTE = 60.0
DAY = 86400.0


@dataclass(frozen=True)
class Tenant:
    """
    A caller key as the queue and the budgets see it.

    @ivar name: the key's name (never the key).
    @ivar weight: its share of a busy queue, relative to other keys'.
    @ivar priority: the class its waiting work is served in (higher
        first); a request may ask for less (C{x-iop-priority}), never more.
    @ivar tokens_per_minute: its budget per minute (C{None}: unlimited).
    @ivar tokens_per_day: its budget per day (C{None}: unlimited).
    """

    name: str = ANONYMOUS
    weight: float = 1.0
    priority: int = 0
    tokens_per_minute: int | None = None
    tokens_per_day: int | None = None


def usage_tokens(usage: dict[str, Any] | None) -> int:
    """
    Input plus output tokens of a usage report (JSON form), 0 when the
    provider reported none (what that costs a ticket is
    L{Ticket.settle_usage}'s to say).
    """
    if not usage:
        return 0
    return int(usage.get("input_tokens") or 0) + int(usage.get("output_tokens") or 0)


class Ticket:
    """
    One request's standing as its tenant's work.

    @ivar tenant: the L{Tenant}.
    @ivar cost: its estimated tokens.
    @ivar priority: its class: the tenant's, or lower when asked.
    @ivar on_queued: C{on_queued(position, eta_ms)}, called while it waits
        for room (C{None}: nobody asks).
    @ivar work_id: its id, once known (a background run knows it at once).
    @ivar waiting_since: when it began to wait (C{None} while not waiting).
    @ivar at_bound: it came while the Edge held all the waiting work it may
        (C{limits.max_waiting}) and is being placed now: should it have to
        wait, it takes the place of the newest waiter of the key waiting
        most, or is refused (L{iop.edge.pool.Overloaded}); served at once
        or refused for itself, it takes nobody's place.
    """

    def __init__(
        self,
        tenant: Tenant,
        cost: int,
        priority: int | None = None,
        on_queued: Callable[[int, int], None] | None = None,
        provisional: int | None = None,
    ) -> None:
        self.tenant = tenant
        self.cost = cost
        #: What the work counts for in its queue's fair share until it
        #: reports what it cost, and what it costs if it ends reporting
        #: nothing (L{settle_usage}): C{cost}, unless the caller's cap on
        #: the answer is counted for less (its input and at most
        #: C{limits.token_estimate} of answer: a C{max_tokens} is the
        #: caller's word, not what it uses).
        self.provisional = cost if provisional is None else min(cost, provisional)
        self.priority = tenant.priority if priority is None else priority
        self.on_queued = on_queued
        self.work_id: str | None = None
        self.waiting_since: float | None = None
        self.at_bound = False
        self.charged = False
        self.settled = False
        self._settlers: list[Callable[[int], None]] = []

    def on_settle(self, settler: Callable[[int], None]) -> None:
        """
        Call C{settler(tokens)} with what the work cost, when it is known.
        """
        if self.settled:
            raise RuntimeError("ticket already settled")
        self._settlers.append(settler)

    def settle(self, tokens: int) -> None:
        """
        The work ended having cost C{tokens} (0 when it never ran or
        nothing was reported). Only the first call counts.
        """
        if self.settled:
            return
        self.settled = True
        settlers, self._settlers = self._settlers, []
        for settler in settlers:
            settler(tokens)

    def settle_usage(self, usage: dict[str, Any] | None, status: str | None = None) -> None:
        """
        Settle with what the work's C{usage} report says it cost. Work that
        was granted a slot and ended C{complete} or C{cancelled} (its
        caller left) with no report at all costs L{provisional} instead
        (its input, and its answer at most C{limits.token_estimate}): a
        tunnelled stream whose caller did not ask for usage, or a caller
        who hangs up before the usage chunk, would otherwise spend nothing
        of a budget or a fair share. A failed answer with no report costs
        nothing (the provider failed, not the caller).
        """
        if not usage and self.charged and status in (COMPLETE, CANCELLED):
            self.settle(self.provisional)
        else:
            self.settle(usage_tokens(usage))


class BudgetExceeded(ServiceError):
    """
    A key over its token budget: HTTP 429 C{token_budget_exceeded} with
    C{Retry-After}.
    """

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__("busy", message, code="token_budget_exceeded")
        self.retry_after = retry_after


class _Bucket:
    """
    A token bucket of C{size} tokens refilled evenly over C{period}
    seconds; C{reserved} is what admitted work still holds.
    """

    def __init__(self, size: int, period: float, now: float) -> None:
        self.size = size
        self.period = period
        self.rate = size / period
        self.level = float(size)
        self.reserved = 0
        self.at = now

    def resize(self, size: int, now: float) -> None:
        """
        A reloaded budget of C{size}: what was spent stays spent (the
        level is kept, at most the new size) and reservations stay held,
        so a reload never hands out a full bucket.
        """
        self.refill(now)
        self.size = size
        self.rate = size / self.period
        self.level = min(self.level, float(size))

    def refill(self, now: float) -> None:
        """
        Refill for the time since the last refill. The clock is the wall
        clock: one set back (an NTP step, a resumed VM) refills nothing
        for that while rather than draining the bucket into a debt as
        long as the step.
        """
        self.level = min(float(self.size), self.level + max(0.0, now - self.at) * self.rate)
        self.at = now

    def shortfall(self, amount: int) -> float:
        return amount - (self.level - self.reserved)


class TokenBudgets:
    """
    The token budgets of every key with one, by key name.

    @param seconds: a clock, C{seconds() -> float}.
    """

    def __init__(self, seconds: Callable[[], float]) -> None:
        self.seconds = seconds
        self._buckets: dict[tuple[str, str], _Bucket] = {}

    def reserve(self, ticket: Ticket) -> None:
        """
        Reserve the ticket's estimate against its tenant's budgets (an
        estimate larger than a whole budget reserves the whole budget, so
        that it can run when the budget is full); settling the ticket
        returns the reservation and spends what the work cost.

        @raise BudgetExceeded: a budget cannot hold it now (nothing is
            reserved).
        """
        tenant = ticket.tenant
        now = self.seconds()
        taken: list[tuple[_Bucket, int]] = []
        for label, size, bucket in self._current(tenant, now):
            amount = min(ticket.cost, size)
            short = bucket.shortfall(amount)
            if short > 0:
                raise BudgetExceeded(
                    f"API key {tenant.name} is over its token budget (tokens_per_{label} {size})",
                    retry_after=max(1, math.ceil(short / bucket.rate)),
                )
            taken.append((bucket, amount))
        if not taken:
            return
        for bucket, amount in taken:
            bucket.reserved += amount

        def spend(tokens: int) -> None:
            later = self.seconds()
            for bucket, amount in taken:
                bucket.refill(later)
                bucket.reserved -= amount
                bucket.level -= tokens

        ticket.on_settle(spend)

    def remaining(self, tenant: Tenant) -> dict[str, int]:
        """
        What is left of C{tenant}'s budgets now, less reservations (for
        status), by period: of the budgets it has now (a reload may have
        changed or removed them).
        """
        return {
            label: int(bucket.level - bucket.reserved) for label, _, bucket in self._current(tenant, self.seconds())
        }

    def _current(self, tenant: Tenant, now: float) -> list[tuple[str, int, "_Bucket"]]:
        """
        C{(label, size, bucket)} of each budget C{tenant} has, its bucket
        made (full) or resized to the budget's size and refilled to C{now}.
        """
        current = []
        for label, size, period in (
            ("minute", tenant.tokens_per_minute, MINUTE),
            ("day", tenant.tokens_per_day, DAY),
        ):
            if size is None:
                continue
            bucket = self._buckets.get((tenant.name, label))
            if bucket is None:
                bucket = self._buckets[(tenant.name, label)] = _Bucket(size, period, now)
            elif bucket.size != size:
                bucket.resize(size, now)
            bucket.refill(now)
            current.append((label, size, bucket))
        return current
