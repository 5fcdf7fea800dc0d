"""
Provider pools, leases and the wait queue of the Edge.

Ownership
=========

The pool owns two things and nothing else:

  - B{capacity}: for every provider resource (C{node_id} + C{provider_id})
    one ledger with a C{normal} and a C{long} counter and the leases that
    count against them. Every model group naming the resource shares that
    one ledger.
  - B{waiters}: one line per model group of callers waiting for room,
    ordered by priority and fair share across caller keys
    (L{iop.edge.fairline.FairLine}).

It does not own connections. The registry (elsewhere) owns Node
connections and their generations; the Edge service tells the pool when a
Node's generation becomes ready (L{ProviderPool.node_ready}) and when it is
gone (L{ProviderPool.node_disconnected}). The pool knows nothing of the
wire or of HTTP, and never touches the global reactor: time comes from the
C{clock} it is given (an C{IReactorTime}, C{task.Clock} in tests).

Rules
=====

  - A resource is I{live} from C{node_ready(node, generation)} until
    C{node_disconnected(node, generation)} with that same generation. A
    disconnect naming any other generation is stale and changes nothing. A
    ready with a new generation replaces the old one, returning the old
    generation's leases first.
  - L{ProviderPool.acquire} leases, among the live members with room of
    the best (lowest) C{priority}, the least loaded one (lowest C{in_use /
    capacity} for the request class; ties go to config order): a member of
    a worse priority is chosen only while every better one is full,
    ejected or offline, never for its lower load. With no room but a
    I{live candidate} (a live member whose capacity for the class is above
    0) it waits in the group's queue; without a live candidate it fails at
    once with L{NoLiveProvider}.
  - B{Panic mode}: when every live candidate of a group is ejected, work
    still goes to the ejected one that failed longest ago (with room)
    instead of failing with L{NoLiveProvider} for a whole cooldown; an
    answer there makes it healthy again.
  - A lease is returned exactly once: by L{Lease.release} or by its Node's
    disconnect (or replacement), whichever comes first. Later calls to
    C{release} return C{False} and change nothing.
  - Whenever room appears (a release, a ready) the queues are pumped: one
    grant at a time, each queue offers B{the first waiter in its fair
    order that can be served now} (higher priority first, then the caller
    key with the fewest tokens served per weight, then FIFO within a key;
    see L{iop.edge.fairline}); of those offers the highest priority, then
    the oldest, gets the lease. A waiter that cannot be served does not
    block one that can (a C{long} waiter does not hold back a C{normal}
    one). Every grant charges the waiter's key its estimated tokens; the
    ticket's settlement corrects that to what the provider reported.
  - Because the queues are pumped after every change, no waiter is ever
    left queued while a live resource of its group has room for its class;
    so a new acquire that finds room never jumps the queue.
  - After a disconnect every waiter is re-evaluated: one whose group has no
    live candidate left fails at once with L{NoLiveProvider}; the others
    keep waiting.

Re-entrancy: the pool's state is made consistent before any Deferred is
fired (it collects the waiters to serve or fail, updates its ledgers and
queues, then fires). A callback may therefore call C{release}, C{acquire},
C{cancel} or C{snapshot} synchronously.

Unknown model group: L{ProviderPool.acquire} and L{ProviderPool.classify}
raise C{KeyError} synchronously (a caller error, "model not found", not
an outage); use L{ProviderPool.group} to check first.
"""

import heapq
import math
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, replace
from functools import partial
from itertools import count
from operator import attrgetter
from typing import Any

from twisted.internet import defer
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger

from iop.edge.fairline import FairLine
from iop.edge.tenants import ANONYMOUS, Tenant, Ticket

NORMAL = "normal"
LONG = "long"
CLASSES = (NORMAL, LONG)

#: The tenant of work acquired without a ticket.
_NOBODY = Tenant(ANONYMOUS)


class PoolError(Exception):
    """
    Base of the pool's failures. The message names the model group (or,
    for direct work, the node and adapter).

    @ivar group: the model group's name (for direct work, C{node/adapter}).
    @ivar klass: the request class (L{NORMAL} or L{LONG}).
    """

    def __init__(self, queue: "_Queue", klass: str, problem: str) -> None:
        super().__init__(f"{queue.label}: {problem}")
        self.group = queue.name
        self.klass = klass
        #: Seconds until a retry may find room, from the queue's measured
        #: drain rate (L{_Queue.retry_after}).
        self.retry_after = queue.retry_after()


class NoLiveProvider(PoolError):
    """
    No provider of the model group is live with capacity for the request
    class ("unavailable"): raised at once, or to a waiter whose last live
    candidate disconnected.
    """


class QueueTimeout(PoolError):
    """
    The request waited C{queue_timeout_sec} without a provider having room.
    """


class QueueFull(PoolError):
    """
    No room, and the model group's queue already holds C{max_queue} waiters.
    """


class Overloaded(PoolError):
    """
    No room, the Edge holds all the waiting work it may
    (C{limits.max_waiting}), and no key waits with two more requests than
    this one's (L{iop.edge.tenants.Ticket.at_bound}).
    """


@dataclass(frozen=True)
class ProviderSpec:
    """
    A provider resource, keyed by C{(node_id, provider_id)}.

    @ivar adapter: the adapter instance name on that Node.
    @ivar adapter_type: C{echo}, C{openai_compat}, C{vllm}, C{ollama} or C{cli}.
    @ivar implicit: not configured as a provider: the resource of an adapter
        no provider names, which direct work leases.
    @ivar follows_adapter: configured without C{capacity.normal}: its
        normal capacity is what its adapter's C{max_concurrency} leaves, and
        follows it when a reload changes it.
    """

    node_id: str
    provider_id: str
    adapter: str
    adapter_type: str
    capacity_normal: int
    capacity_long: int
    implicit: bool = False
    follows_adapter: bool = False

    @property
    def key(self) -> tuple[str, str]:
        return (self.node_id, self.provider_id)

    def capacity(self, klass: str) -> int:
        return self.capacity_normal if klass == NORMAL else self.capacity_long


def _retired(resource: "_Resource") -> bool:
    """
    Whether C{resource} is that of an adapter a reload removed, idle now
    (L{ProviderPool.set_implicit}): not shown any more.
    """
    spec = resource.spec
    return spec.implicit and not (spec.capacity_normal or spec.capacity_long or resource.leases)


@dataclass(frozen=True)
class GroupMember:
    """
    One provider of a model group; C{target} is the model name at the back end.

    @ivar priority: the member's rank in its group: placement takes the
        lowest priority with room first (0, the default, is the first
        choice).
    """

    node_id: str
    provider_id: str
    target: str
    priority: int = 0

    @property
    def key(self) -> tuple[str, str]:
        return (self.node_id, self.provider_id)


@dataclass(frozen=True)
class ModelGroupSpec:
    """
    A model name callers use, and the providers that serve it.

    @ivar members: a tuple of L{GroupMember}, in preference order for ties.
    @ivar fallbacks: the names of the model groups that take the work, in
        order, when this group's providers failed it before its caller saw
        a byte.
    @ivar context_fallbacks: likewise for a provider that refused the
        prompt as too long for its context (C{context_length_exceeded}).
    @ivar queue_timeout_sec: how long a request may wait for room.
    @ivar max_queue: how many requests (of both classes) may wait;
        C{None} for no limit.
    @ivar long_threshold_chars: requests with more input characters than
        this are L{LONG}; C{None} makes every request L{NORMAL}.
    """

    name: str
    members: tuple[GroupMember, ...]
    queue_timeout_sec: float = 30.0
    max_queue: int | None = None
    long_threshold_chars: int | None = None
    #: How many times work whose provider failed before answering may be
    #: placed again on another provider of the group.
    retries: int = 1
    fallbacks: tuple = ()
    context_fallbacks: tuple = ()


@dataclass(frozen=True)
class HealthPolicy:
    """
    When a provider is ejected: after C{failures_to_eject} consecutive
    failures (before answering, or a cut or stalled answer), for
    C{cooldown_sec}, doubling (up to C{max_cooldown_sec}) each time it
    fails again on its first try back. While it is ejected it is probed
    every C{probe_interval_sec} (0: never), and returns as soon as a probe
    passes.
    """

    failures_to_eject: int = 3
    cooldown_sec: float = 30.0
    max_cooldown_sec: float = 300.0
    probe_interval_sec: float = 5.0


class Lease:
    """
    One slot of one provider resource, held by one request.

    Call L{release} when the request ends (terminal event, send failure):
    the first call returns the slot; later calls, and any call after the
    Node's disconnect already returned the slot, change nothing.
    """

    def __init__(
        self,
        pool: "ProviderPool",
        member: GroupMember,
        spec: ProviderSpec,
        klass: str,
        generation: int,
        queue: "_Queue",
        granted_at: float,
    ) -> None:
        self._pool = pool
        self.node_id = member.node_id
        self.provider_id = member.provider_id
        self.adapter = spec.adapter
        self.adapter_type = spec.adapter_type
        self.target = member.target
        self.klass = klass
        self.generation = generation
        self.queue = queue
        self.group = queue.name
        self.granted_at = granted_at
        queue.held += 1

    @property
    def active(self) -> bool:
        """
        C{True} while the slot counts against its resource.
        """
        return self._pool._is_active(self)

    def release(self) -> bool:
        """
        Return the slot. C{True} the first time only.
        """
        return self._pool._release(self)

    def report(self, code: str | None = None, message: str = "", deadline: str = "") -> None:
        """
        Tell the provider's health how its answer went: no C{code} for a
        whole answer; the failure's C{code} and C{message} when it failed
        (before answering, or cut or stalled mid-answer), and the
        C{deadline} it missed, if any (L{iop.run.DEADLINES}).
        """
        self._pool._report(self, code, message, deadline)

    def __repr__(self) -> str:
        return (
            f"<Lease {self.group}/{self.klass} on {self.node_id}/{self.provider_id}"
            f" gen={self.generation!r} target={self.target!r}>"
        )


class _Resource:
    """
    The ledger of one provider resource: its live generation (C{None} when
    offline), its counters and the leases behind them.
    """

    def __init__(self, spec: ProviderSpec, cooldown: float) -> None:
        self.spec = spec
        self.generation: int | None = None
        self.draining = False
        #: Health: consecutive failures, the last one, whether ejected.
        self.failures = 0
        self.last_error: str | None = None
        self.ejected: IDelayedCall | None = None  # the cooldown's DelayedCall while ejected
        self.probe: IDelayedCall | None = None  # the next probe's DelayedCall while ejected
        self.failed_at: float | None = None  # when it last failed (panic mode's order)
        self.cooldown = cooldown
        self.failures_total: dict[str, int] = {}  # failure code -> count since start
        self.ejections_total = 0
        self.probes_total: dict[str, int] = {}  # probe outcome (passed, failed) -> count
        self.deadlines_total: dict[str, int] = {}  # deadline kind (first_byte, stall, idle) -> count
        #: Bumped on every change of room or load; the L{_LoadIndex}es that
        #: hold this resource are told (stale entries are dropped lazily).
        self.version = 0
        self.indexes: list[_LoadIndex] = []
        self.in_use = {NORMAL: 0, LONG: 0}
        self.leases: dict[Lease, None] = {}  # in grant order

    def changed(self) -> None:
        self.version += 1
        for index in self.indexes:
            index.push(self)

    @property
    def live(self) -> bool:
        return self.generation is not None

    def candidate(self, klass: str) -> bool:
        return self.live and not self.draining and self.ejected is None and self.spec.capacity(klass) > 0

    def panic_candidate(self, klass: str) -> bool:
        """
        Whether it could serve in panic mode: live and taking work, but
        ejected.
        """
        return self.live and not self.draining and self.ejected is not None and self.spec.capacity(klass) > 0

    def room(self, klass: str) -> int:
        if not self.live or self.draining or self.ejected is not None:
            return 0
        return self.spec.capacity(klass) - self.in_use[klass]

    def panic_room(self, klass: str) -> int:
        return self.spec.capacity(klass) - self.in_use[klass] if self.panic_candidate(klass) else 0

    def load(self, klass: str) -> float:
        return self.in_use[klass] / self.spec.capacity(klass)

    def take(self, lease: Lease) -> None:
        self.in_use[lease.klass] += 1
        self.leases[lease] = None
        self.changed()

    def give(self, lease: Lease) -> bool:
        if lease not in self.leases:
            return False
        del self.leases[lease]
        self.in_use[lease.klass] -= 1
        self.changed()
        return True

    def set_generation(self, generation: int | None) -> int:
        """
        Go live under C{generation} (or offline for C{None}) with empty
        counters; return how many leases of the previous generation this
        returned.
        """
        returned = len(self.leases)
        for lease in self.leases:
            lease.queue.held -= 1
        self.leases.clear()
        self.in_use = {NORMAL: 0, LONG: 0}
        self.generation = generation
        self.draining = False
        self.changed()
        return returned


class _LoadIndex:
    """
    The members of one queue that have room for one request class, best
    priority first, then least loaded (ties: the order the queue lists
    them): a heap whose
    entries go stale when a resource changes (it pushes a fresh one), and
    are dropped when they reach the top. Choosing is O(log n) amortized,
    not a scan of every member.

    It also counts the members that are live candidates for the class
    (L{_Resource.candidate}) and panic candidates
    (L{_Resource.panic_candidate}), kept as each resource changes: whether
    a full group's request waits or fails is answered without a scan.
    """

    def __init__(
        self, klass: str, members: tuple[GroupMember, ...], resources: dict[tuple[str, str], _Resource]
    ) -> None:
        self.klass = klass
        self.members = {m.key: m for m in members}
        self.order = {m.key: (m.priority, i) for i, m in enumerate(members)}
        #: C{(priority, load, config order, version, resource)}: an entry
        #: is stale once its resource's version moved on.
        self.heap: list[tuple[int, float, int, int, _Resource]] = []
        #: How many members are (panic) candidates for the class, and what
        #: each member was when last counted: C{(candidate, panic
        #: candidate)} by key (a member listed twice counts once).
        self.candidates = 0
        self.panic_candidates = 0
        self.standing: dict[tuple[str, str], tuple[bool, bool]] = {}
        for member in members:
            resource = resources[member.key]
            resource.indexes.append(self)
            self.push(resource)

    def push(self, resource: _Resource) -> None:
        """
        C{resource} changed (or joins the index): recount it, and enter it
        again at its new load if it has room.
        """
        self._recount(resource)
        if resource.room(self.klass) <= 0:
            return
        priority, order = self.order[resource.spec.key]
        heapq.heappush(self.heap, (priority, resource.load(self.klass), order, resource.version, resource))
        if len(self.heap) > 4 * len(self.members) + 16:
            self._compact()

    def _recount(self, resource: _Resource) -> None:
        """
        Bring the candidate counts up to date with C{resource}'s state: it
        is told of every change (L{_Resource.changed}), so the counts stay
        exact without a scan of the members.
        """
        klass = self.klass
        now = (resource.candidate(klass), resource.panic_candidate(klass))
        key = resource.spec.key
        was = self.standing.get(key, (False, False))
        if now == was:
            return
        self.standing[key] = now
        self.candidates += now[0] - was[0]
        self.panic_candidates += now[1] - was[1]

    def best(self) -> "tuple[_Resource, GroupMember] | None":
        """
        The least loaded member with room of the best priority, as
        C{(resource, member)}, or C{None}.
        """
        heap = self.heap
        while heap:
            version, resource = heap[0][3:]
            if version == resource.version and resource.room(self.klass) > 0:
                return resource, self.members[resource.spec.key]
            heapq.heappop(heap)
        return None

    def _compact(self) -> None:
        fresh = {}
        for entry in self.heap:
            resource = entry[4]
            if entry[3] == resource.version and resource.room(self.klass) > 0:
                fresh[resource.spec.key] = entry
        self.heap = list(fresh.values())
        heapq.heapify(self.heap)


#: Weight of a new sample in a queue's measured hold time.
_HOLD_SMOOTHING = 0.2

#: How often waiters whose caller watches get their position.
REPORT_INTERVAL_SEC = 1.0

#: Creation order of queues (config order, then direct queues as used).
_queue_order = count()


class _Kind:
    """
    What a waiter can be served by: one request class on a queue's members
    (all of them, or those its caller's node or filter left). Waiters of
    one kind can all be served now or none can, so the pump asks once per
    kind waiting, not once per waiter (L{FairLine.first}). Equal kinds
    (the same class on the same members) are one; the hash is taken once,
    so a kind of many members is not hashed again at every question.
    """

    __slots__ = ("_hash", "klass", "members")

    def __init__(self, members: tuple[GroupMember, ...], klass: str) -> None:
        self.members = members
        self.klass = klass
        self._hash = hash((members, klass))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, _Kind):
            return NotImplemented
        return self._hash == other._hash and self.klass == other.klass and self.members == other.members


class _Queue:
    """
    The line of one model group, or of direct work on one adapter of one
    node: who may serve it (C{members}), how long a waiter may wait, how
    many may wait, in what order they are served (L{FairLine}), and how
    fast it drains (for positions' C{eta_ms} and C{Retry-After}).
    """

    def __init__(
        self, name: str, label: str, members: tuple[GroupMember, ...], timeout: float, max_queue: int | None
    ) -> None:
        self.name = name
        self.label = label
        self.members = members
        self.timeout = timeout
        self.max_queue = max_queue
        #: Its waiters, kept by their L{_Kind} too (for L{FairLine.first}).
        self.waiters: FairLine[_Waiter] = FairLine(attrgetter("kind"))
        #: The kind of a waiter for any member, by request class.
        self.kinds = {klass: _Kind(members, klass) for klass in CLASSES}
        #: Its place among the pool's queues (what lists them keeps it).
        self.order = next(_queue_order)
        self.indexes: dict[str, _LoadIndex] = {}  # request class -> index, built on first use
        #: Leases of this queue held now, and how long one is held
        #: (smoothed; C{None} until one was returned).
        self.held = 0
        self.hold_sec: float | None = None

    def index(self, klass: str, resources: dict[tuple[str, str], _Resource]) -> _LoadIndex:
        index = self.indexes.get(klass)
        if index is None:
            index = self.indexes[klass] = _LoadIndex(klass, self.members, resources)
        return index

    def returned(self, seconds: float) -> None:
        """
        A lease of this queue was returned after C{seconds}.
        """
        self.held -= 1
        sample = max(seconds, 0.0)
        self.hold_sec = sample if self.hold_sec is None else self.hold_sec + _HOLD_SMOOTHING * (sample - self.hold_sec)

    def eta(self, position: int) -> float:
        """
        Seconds until the waiter at C{position} (1: next) is served, at
        the measured drain rate: C{held} slots each freed every
        C{hold_sec}. Before the first lease came back, one per second.
        """
        if self.hold_sec is None:
            return float(position)
        return position * self.hold_sec / max(self.held, 1)

    def retry_after(self) -> int:
        """
        Whole seconds until a new request might be served (at least 1).
        """
        return max(1, math.ceil(self.eta(len(self.waiters) + 1)))


class _Waiter:
    """
    One caller waiting in a queue, for any of C{members} (the queue's, or
    fewer when the caller named a node), as its tenant's work (its
    L{Ticket}).
    """

    def __init__(
        self,
        seq: int,
        queue: _Queue,
        members: tuple[GroupMember, ...],
        klass: str,
        ticket: Ticket,
        since: float,
        cancelled: "Callable[[_Waiter], None]",
    ) -> None:
        """
        @param cancelled: called with this waiter when its caller cancels
            its Deferred.
        """
        self.seq = seq
        self.queue = queue
        self.members = members
        self.klass = klass
        self.ticket = ticket
        self.tenant = ticket.tenant.name
        self.weight = ticket.tenant.weight
        self.priority = ticket.priority
        self.kind = queue.kinds[klass] if members is queue.members else _Kind(members, klass)
        self.since = since
        self.deferred: defer.Deferred[Lease] = defer.Deferred(lambda d: cancelled(self))
        self.timer: IDelayedCall | None = None

    @property
    def group(self) -> str:
        return self.queue.name

    @property
    def cost(self) -> int | None:
        """
        What serving it charges its key in its queue's line (L{_grant}):
        its provisional estimate (a caller's huge C{max_tokens} counts at
        most C{limits.token_estimate}), or C{None} for work charged
        already (placed again after a failure) or settled, whose grant is
        not recorded; positions play the line forward with this, so they
        are the order work is really served in.
        """
        ticket = self.ticket
        if ticket.charged or ticket.settled:
            return None
        return ticket.provisional


class ProviderPool:
    """
    Capacity and waiters for the Edge's provider resources and model groups.

    @param clock: an C{IReactorTime} for queue timeouts.
    @param providers: the L{ProviderSpec}s, in config order.
    @param groups: the L{ModelGroupSpec}s, in config order.
    @param health: the L{HealthPolicy}.
    @param prober: C{prober(spec)} probes the back end of an ejected
        provider (a L{ProviderSpec}) with a cheap request; its Deferred
        fires with C{True} (it answers), C{False} (it does not), or
        C{None} (it cannot be probed: it waits for its cooldown). C{None}:
        no probes.
    @raise ValueError: duplicate providers or groups, a negative capacity,
        or a group member naming an unknown provider.
    """

    log = Logger()

    def __init__(
        self,
        clock: IReactorTime,
        providers: Iterable[ProviderSpec],
        groups: Iterable[ModelGroupSpec],
        direct_timeout: float = 30.0,
        health: HealthPolicy | None = None,
        prober: Callable[[ProviderSpec], "defer.Deferred[bool | None]"] | None = None,
    ) -> None:
        self._clock = clock
        self.prober = prober
        self._direct_timeout = direct_timeout
        #: Every waiter of every queue, by tenant: who crowds whom out of
        #: the Edge's bound on waiting work (its fair-share counters are
        #: not used; each queue's own line orders its waiters).
        self._everyone: FairLine[_Waiter] = FairLine()
        #: The queues with waiters: what the pump looks at on a release,
        #: not every queue there is (a direct queue per node and adapter).
        self._busy: dict[_Queue, None] = {}
        #: tenant -> the queues it has waiters in -> how many: a key asking
        #: where its work stands looks at those queues only.
        self._waiting_in: dict[str, dict[_Queue, int]] = {}
        self._health = health or HealthPolicy()
        self._resources: dict[tuple[str, str], _Resource] = {}
        self._by_node: dict[str, list[_Resource]] = {}
        for spec in providers:
            if spec.key in self._resources:
                raise ValueError(f"provider {spec.node_id}/{spec.provider_id} is configured twice")
            for klass in CLASSES:
                if not isinstance(spec.capacity(klass), int) or spec.capacity(klass) < 0:
                    raise ValueError(
                        f"provider {spec.node_id}/{spec.provider_id}: {klass} capacity must be"
                        f" a non-negative integer, got {spec.capacity(klass)!r}"
                    )
            resource = _Resource(spec, self._health.cooldown_sec)
            self._resources[spec.key] = resource
            self._by_node.setdefault(spec.node_id, []).append(resource)
        self._groups: dict[str, ModelGroupSpec] = {}
        #: group name -> its queue; direct work: (node, adapter) -> its queue.
        self._queues: dict[str | tuple[str, str], _Queue] = {}
        for group in groups:
            if group.name in self._groups:
                raise ValueError(f"model group {group.name!r} is configured twice")
            for member in group.members:
                if member.key not in self._resources:
                    raise ValueError(
                        f"model group {group.name!r}: unknown provider {member.node_id}/{member.provider_id}"
                    )
            self._groups[group.name] = group
            self._queues[group.name] = _Queue(
                group.name, f"model group {group.name!r}", group.members, group.queue_timeout_sec, group.max_queue
            )
        self._seq = count()
        #: Waiters whose caller wants to hear where they stand.
        self._watched: dict[_Waiter, None] = {}
        #: C{on_wait_end(ticket, queue name, seconds, outcome)}: a waiter
        #: left its queue (for metrics), or C{None}.
        self.on_wait_end: Callable[[Ticket, str, float, str], None] | None = None
        self._positions_call: IDelayedCall | None = None
        #: group name -> {fallback group name: times it took the group's work}
        self._fallbacks_taken: dict[str, dict[str, int]] = {}

    # -- questions

    def group(self, name: str) -> ModelGroupSpec | None:
        """
        The L{ModelGroupSpec} called C{name}, or C{None}.
        """
        return self._groups.get(name)

    def classify(self, group_name: str, input_chars: int) -> str:
        """
        L{LONG} if the group has a threshold and C{input_chars} exceeds it,
        else L{NORMAL}.

        @raise KeyError: unknown model group.
        """
        threshold = self._group(group_name).long_threshold_chars
        if threshold is not None and input_chars > threshold:
            return LONG
        return NORMAL

    def active_leases(self) -> list[Lease]:
        """
        Every lease currently counted, by resource in config order, then in
        grant order.
        """
        return [lease for resource in self._resources.values() for lease in resource.leases]

    def snapshot(self) -> dict[str, Any]:
        """
        Providers in config order (an offline one shows capacity and
        in_use 0) and the number of waiters per model group.
        """
        providers: list[dict[str, Any]] = []
        for resource in self._resources.values():
            spec = resource.spec
            if _retired(resource):
                continue
            live = resource.live
            providers.append(
                {
                    "node": spec.node_id,
                    "id": spec.provider_id,
                    "adapter": spec.adapter,
                    "status": ("draining" if resource.draining else "available") if live else "unavailable",
                    "health": self._health_of(resource),
                    "capacity": {k: spec.capacity(k) if live else 0 for k in CLASSES},
                    "in_use": {k: resource.in_use[k] for k in CLASSES},
                }
            )
            if spec.implicit:
                providers[-1]["implicit"] = True
            if resource.last_error is not None:
                providers[-1]["last_error"] = resource.last_error
            if resource.ejected is not None:
                providers[-1]["ejected_for_sec"] = round(max(resource.ejected.getTime() - self._clock.seconds(), 0), 1)
            for name, counts in (
                ("failures", resource.failures_total),
                ("deadline_hits", resource.deadlines_total),
                ("probes", resource.probes_total),
            ):
                if counts:
                    providers[-1][name] = dict(counts)
        groups = []
        for name, group in self._groups.items():
            entry = {"name": name, "queued": len(self._queues[name].waiters)}
            if group.fallbacks:
                entry["fallbacks"] = list(group.fallbacks)
            if group.context_fallbacks:
                entry["context_fallbacks"] = list(group.context_fallbacks)
            if name in self._fallbacks_taken:
                entry["fallbacks_taken"] = dict(self._fallbacks_taken[name])
            if self._in_panic(group):
                entry["panic"] = True
            groups.append(entry)
        # The lines of direct work (an adapter named as the model, or an
        # explicit node), as /v1/queue names them: NODE/ADAPTER.
        direct = [
            {"name": queue.name, "queued": len(queue.waiters)}
            for key, queue in self._queues.items()
            if isinstance(key, tuple)
        ]
        return {"providers": providers, "model_groups": groups, "direct_queues": direct}

    def _in_panic(self, group: ModelGroupSpec) -> bool:
        """
        Whether every live provider of C{group} is ejected (so work goes to
        the one that failed longest ago).
        """
        resources = [self._resources[m.key] for m in group.members]
        live = [r for r in resources if r.live and not r.draining]
        return bool(live) and all(r.ejected is not None for r in live)

    def _health_of(self, resource: _Resource) -> str:
        if not resource.live:
            return "offline"
        return "ejected" if resource.ejected is not None else "ok"

    def health_counters(self) -> list[tuple[str, str, dict[str, int], int, dict[str, int]]]:
        """
        Per provider C{(node, provider, {failure code: count}, ejections,
        {probe outcome: count})} since start, for metrics.
        """
        return [
            (r.spec.node_id, r.spec.provider_id, dict(r.failures_total), r.ejections_total, dict(r.probes_total))
            for r in self._resources.values()
        ]

    # -- health

    def fallback_taken(self, group: str, fallback: str) -> None:
        """
        Work of the model group C{group} went to its fallback group
        C{fallback} (counted for the status).
        """
        taken = self._fallbacks_taken.setdefault(group, {})
        taken[fallback] = taken.get(fallback, 0) + 1

    def _report(self, lease: Lease, code: str | None, message: str, deadline: str) -> None:
        resource = self._resources[(lease.node_id, lease.provider_id)]
        if code is None:
            self._healthy(resource, "answered")
            return
        if deadline:
            resource.deadlines_total[deadline] = resource.deadlines_total.get(deadline, 0) + 1
        resource.failures += 1
        resource.failed_at = self._clock.seconds()
        resource.failures_total[code] = resource.failures_total.get(code, 0) + 1
        resource.last_error = f"{code}: {message}"
        if resource.failures >= self._health.failures_to_eject and resource.ejected is None:
            self._eject(resource)

    def _healthy(self, resource: _Resource, why: str) -> None:
        """
        The provider answered (or passed a probe): its failures are
        forgotten, its cooldown is reset, and an ejected one returns at
        once.
        """
        if resource.failures or resource.last_error is not None:
            self.log.info(
                "provider {node}/{provider} is healthy again ({why})",
                node=resource.spec.node_id,
                provider=resource.spec.provider_id,
                why=why,
            )
        resource.failures = 0
        resource.last_error = None
        resource.cooldown = self._health.cooldown_sec
        if resource.ejected is not None:
            if resource.ejected.active():
                resource.ejected.cancel()
            self._cooled(resource)

    def _eject(self, resource: _Resource) -> None:
        """
        Take a failing provider out of placement for its cooldown; the next
        cooldown doubles (up to the cap) unless it answers first. It is
        probed meanwhile (L{HealthPolicy.probe_interval_sec}).
        """
        cooldown = resource.cooldown
        resource.cooldown = min(cooldown * 2, self._health.max_cooldown_sec)
        resource.ejections_total += 1
        resource.ejected = self._clock.callLater(cooldown, self._cooled, resource)
        resource.changed()
        self.log.warn(
            "provider {node}/{provider} ejected for {cooldown:g}s after {failures} failures: {error}",
            node=resource.spec.node_id,
            provider=resource.spec.provider_id,
            cooldown=cooldown,
            failures=resource.failures,
            error=resource.last_error,
        )
        self._probe_later(resource)
        self._fail_waiters(self._stranded, None)

    def _probe_later(self, resource: _Resource) -> None:
        interval = self._health.probe_interval_sec
        if self.prober is not None and interval > 0 and resource.ejected is not None:
            resource.probe = self._clock.callLater(interval, self._probe, resource)

    def _probe(self, resource: _Resource) -> None:
        """
        Ask an ejected provider's back end whether it answers again.
        """
        resource.probe = None
        prober = self.prober
        if resource.ejected is None or prober is None:
            return
        d = defer.maybeDeferred(prober, resource.spec)
        d.addErrback(lambda failure: False)
        d.addCallback(self._probed, resource)

    def _probed(self, passed: bool | None, resource: _Resource) -> None:
        if passed is None:
            # It cannot be probed: it waits for its cooldown.
            return
        outcome = "passed" if passed else "failed"
        resource.probes_total[outcome] = resource.probes_total.get(outcome, 0) + 1
        if resource.ejected is None:
            return
        if passed:
            self._healthy(resource, "a probe passed")
        else:
            self._probe_later(resource)

    def _cooled(self, resource: _Resource) -> None:
        """
        The cooldown passed (or the provider answered): it is tried again
        (one more failure ejects it again at once; an answer makes it
        healthy).
        """
        resource.ejected = None
        if resource.probe is not None and resource.probe.active():
            resource.probe.cancel()
        resource.probe = None
        resource.changed()
        self.log.info(
            "provider {node}/{provider} back on trial",
            node=resource.spec.node_id,
            provider=resource.spec.provider_id,
        )
        self._pump()

    # -- acquiring

    def acquire(
        self,
        group_name: str,
        klass: str,
        node_id: str | None = None,
        accept: Callable[[ProviderSpec], bool] | None = None,
        ticket: Ticket | None = None,
    ) -> defer.Deferred[Lease]:
        """
        Lease a provider of C{group_name} for a request of class C{klass}
        (only its providers on C{node_id}, when given, and only those whose
        L{ProviderSpec} C{accept} accepts, when given), as C{ticket}'s
        work (L{iop.edge.tenants.Ticket}: its tenant's share, priority and
        cost; none: an anonymous request of no estimated cost).

        @return: a cancellable Deferred firing with a L{Lease}, or failing
            with L{NoLiveProvider}, L{QueueFull} or L{QueueTimeout};
            cancelling it while it waits removes it from the queue.
        @raise KeyError: unknown model group, or no provider of it on
            C{node_id} (or none that C{accept} accepts).
        @raise ValueError: C{klass} is neither L{NORMAL} nor L{LONG}.
        """
        queue = self._queues[self._group(group_name).name]
        return self._acquire(queue, self._members(queue, node_id, accept), klass, ticket)

    def waiting(self) -> int:
        """
        How many requests wait in all queues together.
        """
        return len(self._everyone)

    def can_make_room(self, tenant: str) -> bool:
        """
        Whether L{make_room} for C{tenant} would free a place now.
        """
        return self._everyone.crowding(tenant) is not None

    def make_room(self, tenant: str) -> bool:
        """
        The Edge holds as much waiting work as it may: turn away the newest
        waiter of the tenant waiting most, if it has at least two more
        than C{tenant}, so that one tenant cannot fill the bound and lock
        the others out.

        @return: whether a place was freed (else C{tenant}'s request is
            the one to refuse).
        """
        waiter = self._everyone.crowding(tenant)
        if waiter is None:
            return False
        self._turn_away(waiter)
        return True

    def retry_after(self, group_name: str | None) -> int:
        """
        Whole seconds until a new request for C{group_name} might be served
        (1 for anything but a model group).
        """
        queue = self._queues.get(group_name) if group_name is not None and group_name in self._groups else None
        return queue.retry_after() if queue is not None else 1

    def has_candidate(
        self,
        group_name: str,
        klass: str,
        node_id: str | None = None,
        accept: Callable[[ProviderSpec], bool] | None = None,
        panic: bool = True,
    ) -> bool:
        """
        Whether a live provider of C{group_name} (filtered as for
        L{acquire}) could serve a request of class C{klass}, now or after
        a wait (an ejected one too, in panic mode, unless C{panic} is
        false).
        """
        queue = self._queues[self._group(group_name).name]
        try:
            return self._has_candidate(queue, self._members(queue, node_id, accept), klass, panic)
        except KeyError:
            return False

    def has_room(self, group_name: str, klass: str, accept: Callable[[ProviderSpec], bool] | None = None) -> bool:
        """
        Whether a healthy live provider of C{group_name} (only those
        C{accept} accepts, when given) has room for a request of class
        C{klass} now (an Edge of a cluster forwards what finds none here;
        panic mode does not count as room).
        """
        queue = self._queues[self._group(group_name).name]
        try:
            members = self._members(queue, None, accept)
        except KeyError:
            return False
        return self._best(queue, members, klass, panic=False) is not None

    def _members(
        self, queue: _Queue, node_id: str | None, accept: Callable[[ProviderSpec], bool] | None
    ) -> tuple[GroupMember, ...]:
        members = queue.members
        if node_id is not None:
            members = tuple(m for m in members if m.node_id == node_id)
            if not members:
                raise KeyError(f"{queue.label} has no provider on node {node_id!r}")
        if accept is not None:
            members = tuple(m for m in members if accept(self._resources[m.key].spec))
            if not members:
                raise KeyError(f"{queue.label} has no provider that can serve this request")
        return members

    def acquire_direct(
        self, node_id: str, adapter: str, klass: str = NORMAL, ticket: Ticket | None = None
    ) -> defer.Deferred[Lease]:
        """
        Lease a slot for work sent to an adapter by name: from the provider
        resources of that adapter on C{node_id} (the adapter's own implicit
        resource when no provider names it), under the same rules as a
        model group, with its own queue.

        @raise KeyError: no resource of that adapter on that node.
        """
        queue = self._direct_queue(node_id, adapter)
        return self._acquire(queue, queue.members, klass, ticket)

    def _direct_queue(self, node_id: str, adapter: str) -> _Queue:
        key = (node_id, adapter)
        queue = self._queues.get(key)
        if queue is None:
            members = tuple(
                GroupMember(node_id, r.spec.provider_id, "")
                for r in self._by_node.get(node_id, ())
                if r.spec.adapter == adapter
            )
            if not members:
                raise KeyError(f"node {node_id!r} has no adapter {adapter!r}")
            queue = _Queue(
                f"{node_id}/{adapter}", f"adapter {adapter!r} on node {node_id}", members, self._direct_timeout, None
            )
            self._queues[key] = queue
        return queue

    def _acquire(
        self, queue: _Queue, members: tuple[GroupMember, ...], klass: str, ticket: Ticket | None
    ) -> defer.Deferred[Lease]:
        if klass not in CLASSES:
            raise ValueError(f"{queue.label}: unknown request class {klass!r}")
        ticket = ticket if ticket is not None else Ticket(_NOBODY, 0)
        best = self._best(queue, members, klass)
        if best is not None:
            return defer.succeed(self._grant(queue, best, klass, ticket))
        if not self._has_candidate(queue, members, klass):
            return defer.fail(self._unavailable(queue, klass))
        # A place turned away for the queue's bound is one of the Edge's too.
        at_bound, ticket.at_bound = ticket.at_bound, False
        if queue.max_queue is not None and len(queue.waiters) >= queue.max_queue:
            crowding = queue.waiters.crowding(ticket.tenant.name)
            if crowding is None:
                return defer.fail(QueueFull(queue, klass, f"queue is full ({queue.max_queue} waiting)"))
            self._turn_away(crowding)
        elif at_bound and not self.make_room(ticket.tenant.name):
            return defer.fail(Overloaded(queue, klass, "the Edge is overloaded: too much work is waiting"))
        waiter = _Waiter(next(self._seq), queue, members, klass, ticket, self._clock.seconds(), self._cancelled)
        waiter.timer = self._clock.callLater(queue.timeout, self._timed_out, waiter)
        queue.waiters.add(waiter)
        self._everyone.add(waiter)
        self._busy[queue] = None
        mine = self._waiting_in.setdefault(waiter.tenant, {})
        mine[queue] = mine.get(queue, 0) + 1
        ticket.waiting_since = waiter.since
        if ticket.on_queued is not None:
            self._watched[waiter] = None
            self._tell_positions_soon()
        return waiter.deferred

    def _group(self, name: str) -> ModelGroupSpec:
        group = self._groups.get(name)
        if group is None:
            raise KeyError(f"unknown model group {name!r}")
        return group

    def _has_candidate(self, queue: _Queue, members: Iterable[GroupMember], klass: str, panic: bool = True) -> bool:
        """
        Whether a live member of C{queue} (of C{members}, which are all of
        its members or some of them) could serve C{klass}, now or after a
        wait (an ejected one too, with C{panic}: panic mode).

        All of them: the counts its index keeps answer, so that a request
        on a full group of many members does not scan them all. Some of
        them (a named node, a filter): those few are asked.
        """
        if members is queue.members:
            index = queue.index(klass, self._resources)
            return index.candidates > 0 or (panic and index.panic_candidates > 0)
        resources = [self._resources[m.key] for m in members]
        return any(r.candidate(klass) or (panic and r.panic_candidate(klass)) for r in resources)

    def _stranded(self, waiter: _Waiter) -> bool:
        """
        Whether C{waiter} is left without a live candidate (after a
        disconnect, a drain, an ejection or a removed adapter): it fails
        at once rather than wait for nothing.
        """
        return not self._has_candidate(waiter.queue, waiter.members, waiter.klass)

    def _unavailable(self, queue: _Queue, klass: str) -> NoLiveProvider:
        return NoLiveProvider(queue, klass, f"no live provider for {klass} requests")

    def _best(
        self, queue: _Queue, members: tuple[GroupMember, ...], klass: str, panic: bool = True
    ) -> tuple[_Resource, GroupMember] | None:
        """
        The least loaded member with room of the best priority, as
        C{(resource, member)}; in panic mode (unless C{panic} is false)
        the ejected member with room that failed longest ago; else
        C{None}.
        """
        best: tuple[_Resource, GroupMember] | None = None
        if members is queue.members:
            best = queue.index(klass, self._resources).best()
        else:
            # A filtered choice (a named node, a type or a failed provider
            # left out): few members, scanned.
            for member in members:
                resource = self._resources[member.key]
                if resource.room(klass) > 0:
                    rank = (member.priority, resource.load(klass))
                    if best is None or rank < (best[1].priority, best[0].load(klass)):
                        best = (resource, member)
        if best is None and panic and not self._has_candidate(queue, members, klass, panic=False):
            if members is queue.members and not queue.index(klass, self._resources).panic_candidates:
                # No ejected member either (every one offline, say): none
                # to choose among, known without a scan.
                return None
            return self._panic_choice(members, klass)
        return best

    def _panic_choice(self, members: tuple[GroupMember, ...], klass: str) -> tuple[_Resource, GroupMember] | None:
        """
        Every live member is ejected: the one with room that failed
        longest ago, or C{None}.
        """
        best: tuple[_Resource, GroupMember] | None = None
        for member in members:
            resource = self._resources[member.key]
            if resource.panic_room(klass) > 0 and (
                best is None or (resource.failed_at or 0) < (best[0].failed_at or 0)
            ):
                best = (resource, member)
        return best

    def _grant(self, queue: _Queue, best: tuple[_Resource, GroupMember], klass: str, ticket: Ticket) -> Lease:
        """
        Take a slot on C{best} for C{ticket}'s work, charging its tenant
        the work's provisional tokens in C{queue}'s fair share (corrected
        to what it cost when the ticket is settled).
        """
        resource, member = best
        # A resource with room is live.
        assert resource.generation is not None
        lease = Lease(self, member, resource.spec, klass, resource.generation, queue, self._clock.seconds())
        # The charge comes first: should the bookkeeping ever raise, no slot
        # has been taken that nothing would return.
        if not ticket.charged:
            ticket.charged = True
            if not ticket.settled:
                # (Counted for its provisional tokens until it reports.)
                tenant, weight, cost = ticket.tenant.name, ticket.tenant.weight, ticket.provisional
                queue.waiters.grant(tenant, weight, cost)
                ticket.on_settle(lambda tokens: queue.waiters.settle(tenant, weight, cost, tokens))
        resource.take(lease)
        return lease

    def _dequeue(self, waiter: _Waiter, outcome: str) -> None:
        """
        Take C{waiter} out of its queue; it leaves as C{outcome}
        (C{served}, C{timeout}, C{cancelled}, C{failed} or
        C{turned_away}), which
        L{on_wait_end} hears of with the time it waited.
        """
        if self.on_wait_end is not None:
            self.on_wait_end(waiter.ticket, waiter.queue.name, self._clock.seconds() - waiter.since, outcome)
        waiter.queue.waiters.remove(waiter)
        self._everyone.remove(waiter)
        if not waiter.queue.waiters:
            del self._busy[waiter.queue]
        mine = self._waiting_in[waiter.tenant]
        if mine[waiter.queue] > 1:
            mine[waiter.queue] -= 1
        else:
            del mine[waiter.queue]
            if not mine:
                del self._waiting_in[waiter.tenant]
        self._watched.pop(waiter, None)
        waiter.ticket.waiting_since = None
        if waiter.timer is not None and waiter.timer.active():
            waiter.timer.cancel()
        waiter.timer = None

    def _timed_out(self, waiter: _Waiter) -> None:
        waiter.timer = None
        self._dequeue(waiter, "timeout")
        queue = waiter.queue
        self.log.info(
            "{queue}: {klass} request timed out after {timeout}s in queue",
            queue=queue.label,
            klass=waiter.klass,
            timeout=queue.timeout,
        )
        waiter.deferred.errback(QueueTimeout(queue, waiter.klass, f"no provider free within {queue.timeout}s"))

    def _turn_away(self, waiter: _Waiter) -> None:
        """
        C{waiter}'s tenant is crowding others out of a full queue (or of
        the Edge's bound): its newest waiter leaves, refused as if it had
        found the queue full.
        """
        self._dequeue(waiter, "turned_away")
        queue = waiter.queue
        self.log.info(
            "{queue}: a waiting request of key {key} turned away for another key's",
            queue=queue.label,
            key=waiter.tenant,
        )
        waiter.deferred.errback(
            QueueFull(queue, waiter.klass, "queue is full: its place went to a key with fewer requests waiting")
        )

    def _cancelled(self, waiter: _Waiter) -> None:
        # The Deferred errbacks CancelledError once this returns. A waiter
        # already served but not yet fired is no longer queued: _pump sees
        # the fired Deferred and returns its lease.
        if waiter in waiter.queue.waiters:
            self._dequeue(waiter, "cancelled")

    def _waiters(self) -> list[_Waiter]:
        """
        Every queued waiter, oldest first, as a list (safe to mutate the
        queues while walking it).
        """
        return sorted((w for queue in self._busy_queues() for w in queue.waiters), key=lambda w: w.seq)

    def _busy_queues(self) -> list[_Queue]:
        """
        The queues with waiters, in the order the pool lists its queues.
        """
        return sorted(self._busy, key=lambda queue: queue.order)

    def _usable(self, queue: _Queue, full: set[_Kind], kind: Hashable) -> bool:
        """
        Whether waiters of C{kind} in C{queue} can be served now. A kind
        found without room is remembered in C{full} for the rest of one
        pump (its grants only take room).
        """
        assert isinstance(kind, _Kind)
        if kind in full:
            return False
        if self._best(queue, kind.members, kind.klass) is None:
            full.add(kind)
            return False
        return True

    def _pump(self) -> None:
        """
        Serve every waiter that can be served now, one grant at a time:
        each time the first servable waiter of each queue with waiters in
        its fair order (L{FairLine.first}), and of those the one of the
        highest priority, then the oldest. Then fire.

        Room is asked of each L{_Kind} waiting (a class on some members),
        not of each waiter, and a kind without room is not asked again in
        this pump: a release in a long queue none of whom fits costs the
        kinds and tenants waiting, not the waiters.
        """
        served: list[tuple[_Waiter, Lease]] = []
        full: set[_Kind] = set()  # kinds found without room in this pass
        while True:
            chosen: tuple[_Waiter, tuple[_Resource, GroupMember]] | None = None
            for queue in list(self._busy):
                waiter = queue.waiters.first(partial(self._usable, queue, full))
                if waiter is None:
                    continue
                best = self._best(queue, waiter.members, waiter.klass)
                assert best is not None, "a usable kind has room"
                if chosen is None or (-waiter.priority, waiter.seq) < (-chosen[0].priority, chosen[0].seq):
                    chosen = (waiter, best)
            if chosen is None:
                break
            waiter, best = chosen
            self._dequeue(waiter, "served")
            served.append((waiter, self._grant(waiter.queue, best, waiter.klass, waiter.ticket)))
        for waiter, lease in served:
            if waiter.deferred.called:
                # Cancelled by an earlier callback of this same batch.
                lease.release()
            else:
                waiter.deferred.callback(lease)

    # -- what waiters are told

    def _tell_positions_soon(self) -> None:
        if self._positions_call is None or self._positions_call.getTime() > self._clock.seconds():
            if self._positions_call is not None:
                self._positions_call.cancel()
            self._positions_call = self._clock.callLater(0, self._tell_positions)

    def _tell_positions(self) -> None:
        """
        Tell every watched waiter where it stands: once as soon as it
        queued (all those of one reactor turn together), then every
        L{REPORT_INTERVAL_SEC} while it waits.
        """
        self._positions_call = None
        if not self._watched:
            return
        watched_queues = {waiter.queue for waiter in self._watched}
        for queue in watched_queues:
            for waiter, position in queue.waiters.positions().items():
                on_queued = waiter.ticket.on_queued
                if waiter in self._watched and on_queued is not None:
                    on_queued(position, int(queue.eta(position) * 1000))
        if self._watched:
            self._positions_call = self._clock.callLater(REPORT_INTERVAL_SEC, self._tell_positions)

    def queued(self, tenant: str | None = None) -> list[dict[str, Any]]:
        """
        Every waiter (only C{tenant}'s, when given), in each queue's fair
        order: its model group (or node/adapter), tenant, priority,
        position, seconds waited so far and expected, and work id when
        known.
        """
        now = self._clock.seconds()
        entries: list[dict[str, Any]] = []
        if tenant is None:
            queues = self._busy_queues()
        else:
            queues = sorted(self._waiting_in.get(tenant, ()), key=lambda queue: queue.order)
        for queue in queues:
            for waiter, position in sorted(queue.waiters.positions(tenant).items(), key=lambda pair: pair[1]):
                entry: dict[str, Any] = {
                    "model": queue.name,
                    "key": waiter.tenant,
                    "priority": waiter.priority,
                    "class": waiter.klass,
                    "position": position,
                    "waited_ms": int((now - waiter.since) * 1000),
                    "eta_ms": int(queue.eta(position) * 1000),
                }
                if waiter.ticket.work_id is not None:
                    entry["id"] = waiter.ticket.work_id
                entries.append(entry)
        return entries

    # -- releasing

    def _is_active(self, lease: Lease) -> bool:
        resource = self._resources[(lease.node_id, lease.provider_id)]
        return lease in resource.leases

    def _release(self, lease: Lease) -> bool:
        resource = self._resources[(lease.node_id, lease.provider_id)]
        if not resource.give(lease):
            return False
        lease.queue.returned(self._clock.seconds() - lease.granted_at)
        self._pump()
        return True

    def update_capacity(self, spec: ProviderSpec) -> None:
        """
        A reload changed a resource's capacity, or added one (an adapter's
        implicit resource follows its C{max_concurrency}, and a new adapter
        brings a new one). Leases held stay; new ones follow the new
        capacity; a new resource joins its node's live generation; waiters
        are served if room appeared.
        """
        resource = self._resources.get(spec.key)
        if resource is None:
            resource = _Resource(spec, self._health.cooldown_sec)
            siblings = self._by_node.setdefault(spec.node_id, [])
            if siblings:
                resource.generation, resource.draining = siblings[0].generation, siblings[0].draining
            self._resources[spec.key] = resource
            siblings.append(resource)
        elif resource.spec == spec:
            return
        resource.spec = spec
        resource.changed()
        self._pump()

    def set_implicit(self, node_id: str, specs: Iterable[ProviderSpec]) -> None:
        """
        The resources of C{node_id}'s adapters that no provider names are
        C{specs} now (L{update_capacity} each); one of an adapter removed
        is left with no capacity — its leases held return as they end, no
        new one is granted, and its waiters, without a candidate now, fail
        at once — and is no longer shown once idle.
        """
        wanted = {spec.key: spec for spec in specs}
        for spec in wanted.values():
            self.update_capacity(spec)
        for resource in list(self._by_node.get(node_id, ())):
            spec = resource.spec
            if spec.implicit and spec.key not in wanted and (spec.capacity_normal or spec.capacity_long):
                resource.spec = replace(spec, capacity_normal=0, capacity_long=0)
                resource.changed()
                self._fail_waiters(self._stranded, None)

    # -- Node lifecycle (told by the Edge service)

    def node_ready(
        self, node_id: str, generation: int, adopt: Iterable[tuple[str, str, str | None, str] | None] = ()
    ) -> list[Lease | None]:
        """
        The Node's C{generation} is ready: its resources go live with their
        configured capacity and waiters are served at once. A new
        generation first returns the leases of the one it replaces; the
        same generation again changes nothing.

        @param adopt: work already running on the Node that the new
            generation takes back (background runs that outlived a lost
            link): C{(provider_id, klass, group, target)} each, or C{None}.
            Their leases are taken before any waiter is served, even beyond
            capacity (the work holds the Node's slots already).
        @return: the adopted L{Lease}s, in the order of C{adopt} (C{None}
            for an entry with no such live resource).
        """
        returned = 0
        for resource in self._by_node.get(node_id, ()):
            if resource.generation != generation:
                returned += resource.set_generation(generation)
        if returned:
            self.log.info(
                "node {node} ready as generation {generation}: returned {count} leases of the old generation",
                node=node_id,
                generation=generation,
                count=returned,
            )
        leases = [None if held is None else self._adopt(node_id, generation, *held) for held in adopt]
        self._pump()
        return leases

    def _adopt(
        self, node_id: str, generation: int, provider_id: str, klass: str, group: str | None, target: str
    ) -> Lease | None:
        resource = self._resources.get((node_id, provider_id))
        if resource is None or resource.generation != generation or klass not in CLASSES:
            return None
        if group in self._groups:
            queue = self._queues[group]
        else:
            queue = self._direct_queue(node_id, resource.spec.adapter)
        lease = Lease(
            self,
            GroupMember(node_id, provider_id, target),
            resource.spec,
            klass,
            generation,
            queue,
            self._clock.seconds(),
        )
        resource.take(lease)
        return lease

    def resource_of(self, node_id: str, adapter: str) -> str | None:
        """
        The id of the first provider resource of C{adapter} on C{node_id}
        (where work found running there is counted), or C{None}.
        """
        for resource in self._by_node.get(node_id, ()):
            if resource.spec.adapter == adapter:
                return resource.spec.provider_id
        return None

    def node_draining(self, node_id: str, generation: int) -> None:
        """
        The Node's live C{generation} is shutting down: its resources keep
        their leases (returned as the work ends) but take no new ones, and
        every waiter left without a live candidate fails at once.
        """
        resources = self._by_node.get(node_id, ())
        if not resources or resources[0].generation != generation:
            return
        for resource in resources:
            resource.draining = True
            resource.changed()
        self._fail_waiters(self._stranded, None)

    def fail_waiters(self, error: Exception) -> None:
        """
        Fail every queued waiter with C{error} (the Edge is shutting down).
        """
        self._fail_waiters(lambda waiter: True, error)

    def _fail_waiters(self, condition: Callable[[_Waiter], bool], error: Exception | None) -> int:
        """
        Take every waiter meeting C{condition} out of its queue, then fail
        each with C{error} (C{None}: L{NoLiveProvider} for its group).

        @return: how many failed.
        """
        failed: list[_Waiter] = []
        for waiter in self._waiters():
            if condition(waiter):
                self._dequeue(waiter, "failed")
                failed.append(waiter)
        for waiter in failed:
            if not waiter.deferred.called:  # not cancelled by an earlier errback
                waiter.deferred.errback(error or self._unavailable(waiter.queue, waiter.klass))
        return len(failed)

    def node_disconnected(self, node_id: str, generation: int) -> None:
        """
        The Node's C{generation} is gone. If it is the live one: return its
        leases, take its resources offline, and fail at once every waiter
        left without a live candidate. Otherwise (stale) change nothing.
        """
        resources = self._by_node.get(node_id, ())
        if not resources or resources[0].generation is None or resources[0].generation != generation:
            self.log.debug(
                "ignoring stale disconnect of node {node} generation {generation}", node=node_id, generation=generation
            )
            return
        returned = sum(resource.set_generation(None) for resource in resources)
        failed = self._fail_waiters(self._stranded, None)
        self.log.info(
            "node {node} generation {generation} disconnected: returned {count} leases, {failed} waiters unavailable",
            node=node_id,
            generation=generation,
            count=returned,
            failed=failed,
        )
