"""
Placing a caller's work again when its provider failed before the caller
saw a byte: which failures qualify, where it goes next, and when.

A L{Work} is one caller's request across its placements (attempts). Its
first attempt goes on the wire under the work's own id; a later one under
C{<id>-<n>}, so that a late frame of an abandoned attempt can never reach
the new one, while the caller keeps seeing one id.

Where a failed attempt goes (L{Failover.plan}), in this order:

  1. a Node that refused admitted work (C{capacity_exceeded}): anywhere,
     once;
  2. a provider that refused the prompt as too long for its context
     (C{context_length_exceeded}): the group's C{context_fallbacks}, in
     order;
  3. the provider's own failure (L{provider_failed}), while the group's
     C{retries} last: another provider of the group; with none, the same
     provider once more: after its C{Retry-After} for a 429 or 503 that
     gave one (when the caller's queue deadline allows the wait), at once
     for another 5xx;
  4. then the group's C{fallbacks}, in order (a fallback's own fallbacks
     right after it).

Any other failure (a 4xx other than 429) is the caller's answer,
unchanged.

An answer cut after the caller saw part of it (C{incomplete}) is, for a
normalized run that is not a background run, continued when a provider
that can continue it (C{continuation: true} on its adapter) can take it
(L{Failover.continuation}): another provider of the group, else a
fallback group, in order, with the text so far as C{assistant_prefix};
the caller's answer goes on where it was cut.
"""

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from iop.edge.spec import RunSpec
from iop.edge.tenants import Ticket
from iop.run import (
    ASSISTANT_PREFIX_OPTION,
    CAPACITY_EXCEEDED,
    CONTEXT_LENGTH_EXCEEDED,
    INCOMPLETE,
    PROVIDER_ERROR,
    PROVIDER_TIMEOUT,
    PROVIDER_UNREACHABLE,
    RunFailure,
)

if TYPE_CHECKING:
    from iop.edge.bus import EventBus
    from iop.edge.pool import ModelGroupSpec, ProviderPool

#: Why work moved to another model group, by the group field that sent it.
FALLBACKS = "fallbacks"
CONTEXT_FALLBACKS = "context_fallbacks"


def provider_failed(failure: RunFailure) -> bool:
    """
    Whether C{failure} (a L{iop.run.RunFailure}) is the provider's own
    failure to serve: no connection, no answer in time, an HTTP 5xx or 429
    status, or an answer cut, stalled or malformed mid-way. These feed the
    provider's health; those seen before any output may be retried
    elsewhere.
    """
    if failure.code in (PROVIDER_UNREACHABLE, PROVIDER_TIMEOUT, INCOMPLETE):
        return True
    return failure.code == PROVIDER_ERROR and (failure.status >= 500 or failure.status == 429)


class Where(Protocol):
    """
    Where a failed attempt ran (an L{iop.edge.dispatch.Placement}).
    """

    @property
    def node_id(self) -> str: ...

    @property
    def provider_id(self) -> str: ...

    @property
    def key(self) -> tuple[str, str]: ...


class Attempt(Protocol):
    """
    What L{Failover} reads of a failed attempt (an
    L{iop.edge.dispatch.Dispatch}).
    """

    @property
    def placement(self) -> Where: ...


class Elsewhere(Protocol):
    """
    Whether another provider could take a piece of work (the
    L{iop.edge.placement.Placer}).
    """

    def elsewhere(self, spec: RunSpec, avoid: set[tuple[str, str]]) -> bool: ...


@dataclass(eq=False)
class Work:
    """
    @ivar spec: the L{iop.edge.spec.RunSpec} of the current attempt (its
        C{model} is the model group serving it, a fallback's once one took
        it).
    @ivar retries: how many times a provider failure may be placed again
        in the current group (its C{retries}; 0 for work sent to an
        adapter by name, which has nowhere else to go).
    @ivar avoid: the provider resources (keys) that already failed it.
    @ivar ticket: its L{iop.edge.tenants.Ticket} (tenant, estimated
        tokens), settled once when it ends.
    @ivar since: when it was submitted (its queue deadline counts from
        there).
    @ivar tried: the model groups it was placed in.
    @ivar pending: for each of L{FALLBACKS} and L{CONTEXT_FALLBACKS}, the
        groups still to try, in order.
    @ivar listener: the listener of its latest attempt (an attempt that
        continues a cut answer keeps it: the caller's answer goes on).
    """

    spec: RunSpec
    listener_for: Callable[[str, str], Any]
    retries: int
    id: str | None = None
    attempts: int = 0
    refused_once: bool = False
    avoid: set[tuple[str, str]] = field(default_factory=set)
    ticket: Ticket | None = None
    since: float = 0.0
    tried: set[str] = field(default_factory=set)
    pending: dict[str, list[str]] = field(default_factory=dict)
    listener: Any = None

    def wire_id(self) -> str:
        """
        This attempt's id on the wire (the work has its id once placed).
        """
        assert self.id is not None
        return self.id if self.attempts <= 1 else f"{self.id}-{self.attempts}"


class Failover:
    """
    Decides where an attempt that failed before its caller saw a byte goes
    next (L{plan}), and where the rest of an answer cut after it comes
    from (L{continuation}).

    @param pool: the L{iop.edge.pool.ProviderPool} (the model groups).
    @param placer: the L{iop.edge.placement.Placer} (whether another
        provider could take the work).
    @param clock: an C{IReactorTime} (queue deadlines).
    @param bus: the L{iop.edge.bus.EventBus} (C{provider} events: C{retry},
        C{fallback}).
    """

    log = Logger()

    def __init__(self, pool: "ProviderPool", placer: Elsewhere, clock: IReactorTime, bus: "EventBus") -> None:
        self.pool = pool
        self.placer = placer
        self.clock = clock
        self.bus = bus

    def plan(self, failed: Attempt, failure: RunFailure, work: Work) -> float | None:
        """
        @param failed: the failed attempt's L{iop.edge.dispatch.Dispatch}.
        @return: in how many seconds to place C{work} again (having
            changed it for its next attempt), or C{None} to let its caller
            have the failure.
        """
        if failure.code == CAPACITY_EXCEEDED:
            # The Node's gate disagrees with the Edge's ledger: once.
            if work.refused_once:
                return None
            work.refused_once = True
            self.log.warn(
                "node {node} refused {id} with capacity_exceeded although the Edge admitted it;"
                " placing it again (check the node's max_concurrency against its providers' capacity)",
                node=failed.placement.node_id,
                id=work.id,
            )
            return 0.0
        if failure.code == CONTEXT_LENGTH_EXCEEDED:
            return self._fall_back(work, CONTEXT_FALLBACKS, failure)
        if not provider_failed(failure):
            return None
        key = failed.placement.key
        if work.retries > 0:
            if self.placer.elsewhere(work.spec, work.avoid | {key}):
                work.retries -= 1
                work.avoid.add(key)
                self._retrying(failed, failure, work, "placing it elsewhere")
                return 0.0
            delay = self._same_again(failure, work)
            if delay is not None:
                work.retries -= 1
                self._retrying(failed, failure, work, f"trying it there again in {delay:g}s")
                return delay
        return self._fall_back(work, FALLBACKS, failure)

    def _same_again(self, failure: RunFailure, work: Work) -> float | None:
        """
        The delay before the same provider may be tried again: its
        C{Retry-After} when it gave one and the queue deadline allows
        the wait, none for another 5xx; C{None} when not at all.
        """
        if failure.retry_after_sec > 0:
            group = self.pool.group(work.spec.model) if work.spec.model else None
            deadline = work.since + (group.queue_timeout_sec if group is not None else 0.0)
            return failure.retry_after_sec if self.clock.seconds() + failure.retry_after_sec <= deadline else None
        if failure.code == PROVIDER_ERROR and failure.status >= 500:
            return 0.0
        return None

    def _retrying(self, failed: Attempt, failure: RunFailure, work: Work, what: str) -> None:
        self.log.info(
            "{id}: provider {node}/{provider} failed before answering ({code}); {what}",
            id=work.id,
            node=failed.placement.node_id,
            provider=failed.placement.provider_id,
            code=failure.code,
            what=what,
        )
        self.bus.publish(
            "provider", {"event": "retry", "node": failed.placement.node_id, "provider": failed.placement.provider_id}
        )

    def continuation(self, failed: Attempt, failure: RunFailure, work: Work, text: str) -> float | None:
        """
        An answer cut after its caller saw C{text} of it (C{incomplete}):
        where the rest may come from.

        @return: 0 (place the rest at once, C{work} changed to continue
            from C{text}), or C{None}: the caller gets the explicit error.
        """
        spec = work.spec
        if failure.code != INCOMPLETE or not text or spec.background:
            return None
        group = self.pool.group(spec.model) if spec.model else None
        if group is None:
            return None
        prefix = spec.options.get(ASSISTANT_PREFIX_OPTION, "") + text
        # (Always a normalized run: the caller's answer is being rendered.)
        rest = replace(
            spec, tunnel=None, options=dict(spec.options, **{ASSISTANT_PREFIX_OPTION: prefix}), continues=True
        )
        avoid = work.avoid | {failed.placement.key}
        if self.placer.elsewhere(rest, avoid):
            work.spec, work.avoid = rest, avoid
            return 0.0
        self._track(work, group)
        for name in list(work.pending[FALLBACKS]):
            fallback = self.pool.group(name)
            if fallback is None or name in work.tried or not self.placer.elsewhere(served_by(rest, name), avoid):
                continue
            work.pending[FALLBACKS].remove(name)
            work.avoid = avoid
            self._move(work, rest, group, fallback, FALLBACKS, failure)
            return 0.0
        return None

    def _track(self, work: Work, group: "ModelGroupSpec") -> None:
        """
        Start keeping which groups C{work} tried, from its first one.
        """
        if not work.tried:
            work.tried.add(group.name)
            for name in (FALLBACKS, CONTEXT_FALLBACKS):
                work.pending[name] = list(getattr(group, name))

    def _fall_back(self, work: Work, reason: str, failure: RunFailure) -> float | None:
        """
        Move C{work} to the next model group of its C{reason} list.

        @return: 0 (place it at once), or C{None} when none is left.
        """
        group = self.pool.group(work.spec.model) if work.spec.model else None
        if group is None:
            return None
        self._track(work, group)
        pending = work.pending[reason]
        while pending:
            fallback = self.pool.group(pending.pop(0))
            if fallback is None or fallback.name in work.tried:
                continue
            self._move(work, work.spec, group, fallback, reason, failure)
            return 0.0
        return None

    def _move(
        self,
        work: Work,
        spec: RunSpec,
        group: "ModelGroupSpec",
        fallback: "ModelGroupSpec",
        reason: str,
        failure: RunFailure,
    ) -> None:
        """
        C{work} goes on as C{spec} in the model group C{fallback}: its own
        fallbacks come next, and it has that group's retries.
        """
        work.tried.add(fallback.name)
        for name in (FALLBACKS, CONTEXT_FALLBACKS):
            work.pending[name][:0] = [g for g in getattr(fallback, name) if g not in work.tried]
        work.spec = served_by(spec, fallback.name)
        work.retries = fallback.retries
        self.pool.fallback_taken(group.name, fallback.name)
        self.log.info(
            "{id}: model group {group} failed it ({code}); falling back to {fallback}",
            id=work.id,
            group=group.name,
            code=failure.code,
            fallback=fallback.name,
        )
        self.bus.publish(
            "provider", {"event": "fallback", "model_group": group.name, "fallback": fallback.name, "reason": reason}
        )


def served_by(spec: RunSpec, group: str) -> RunSpec:
    """
    C{spec} for the model group C{group}: its C{model}, and a tunnel's body
    naming it (a provider without a C{target} gets the group's name, as
    the caller's own group would give the caller's).
    """
    tunnel = spec.tunnel
    if tunnel is not None:
        tunnel = replace(tunnel, body=dict(tunnel.body, model=group), raw=None)
    return replace(spec, model=group, tunnel=tunnel)
