"""
Property-based tests for L{iop.edge.pool}: random interleavings of
acquires, releases, Node lifecycle events, timeouts and cancellations,
checked against a small model after every step and at quiescence.
"""

from fractions import Fraction

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test
from twisted.internet.defer import CancelledError
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from iop.edge.pool import (
    LONG,
    NORMAL,
    GroupMember,
    ModelGroupSpec,
    NoLiveProvider,
    ProviderPool,
    ProviderSpec,
    QueueFull,
    QueueTimeout,
)

NODES = ("n1", "n2")
RESOURCES = (("n1", "a"), ("n1", "b"), ("n2", "a"))
CLASSES = (NORMAL, LONG)


def make_groups():
    def members(*keys):
        return tuple(GroupMember(node, pid, f"{node}-{pid}") for node, pid in keys)

    return [
        ModelGroupSpec("g1", members(("n1", "a"), ("n2", "a")), queue_timeout_sec=3),
        ModelGroupSpec("g2", members(("n1", "a"), ("n1", "b")), queue_timeout_sec=5, max_queue=2),
        ModelGroupSpec("g3", members(("n2", "a")), queue_timeout_sec=2),
        ModelGroupSpec("g4", members(("n1", "b"), ("n2", "a")), queue_timeout_sec=4, max_queue=1),
    ]


GROUPS = {g.name: g for g in make_groups()}
MAX_TIMEOUT = max(g.queue_timeout_sec for g in GROUPS.values())


class Acquisition:
    """
    One call to acquire and every result its Deferred delivered.
    """

    def __init__(self, group, klass, start):
        self.group = group
        self.klass = klass
        self.start = start
        self.results = []
        self.deferred = None

    @property
    def pending(self):
        return not self.results


class PoolMachine(RuleBasedStateMachine):
    """
    Drives a L{ProviderPool} and keeps a model: the live generation of each
    Node, every lease granted and which leases we released successfully.
    """

    def __init__(self):
        super().__init__()
        self._pool: ProviderPool | None = None

    @property
    def pool(self) -> ProviderPool:
        assert self._pool is not None, "set_up_pool runs first"
        return self._pool

    @initialize(
        capacities=st.lists(
            st.tuples(st.sampled_from([0, 1, 1, 1, 2]), st.sampled_from([0, 1, 1, 1, 2])),
            min_size=len(RESOURCES),
            max_size=len(RESOURCES),
        )
    )
    def set_up_pool(self, capacities):
        self.clock = Clock()
        providers = [
            ProviderSpec(node, pid, f"{node}-{pid}-adapter", "echo", normal, long)
            for (node, pid), (normal, long) in zip(RESOURCES, capacities, strict=True)
        ]
        self.capacity = {
            (p.node_id, p.provider_id): {NORMAL: p.capacity_normal, LONG: p.capacity_long} for p in providers
        }
        self._pool = ProviderPool(self.clock, providers, make_groups())
        self.live: dict[str, int | None] = {node: None for node in NODES}
        self.last_generation = {node: 0 for node in NODES}
        self.acquisitions = []
        self.leases = []
        self.released = set()
        for node in NODES:
            self.ready(node)

    # -- model helpers

    def counted(self, lease):
        return lease not in self.released and lease.generation == self.live[lease.node_id]

    def counted_leases(self):
        return [lease for lease in self.leases if self.counted(lease)]

    def providers(self):
        return {(p["node"], p["id"]): p for p in self.pool.snapshot()["providers"]}

    def has_room(self, group, klass, providers):
        return any(
            providers[m.key]["capacity"][klass] - providers[m.key]["in_use"][klass] > 0 for m in GROUPS[group].members
        )

    def has_candidate(self, group, klass, providers):
        return any(providers[m.key]["capacity"][klass] > 0 for m in GROUPS[group].members)

    def check_bounds(self):
        for entry in self.providers().values():
            for klass in CLASSES:
                assert 0 <= entry["in_use"][klass] <= entry["capacity"][klass], entry

    # -- actions

    def acquire(self, group, klass, reentry):
        record = Acquisition(group, klass, self.clock.seconds())
        self.acquisitions.append(record)
        before = self.providers()
        calling = True

        def granted(lease):
            record.results.append(lease)
            self.leases.append(lease)
            # The pool is consistent before it fires anything.
            self.check_bounds()
            assert lease.active
            assert (lease.group, lease.klass) == (group, klass)
            assert lease.generation == self.live[lease.node_id]
            member = [m for m in GROUPS[group].members if m.key == (lease.node_id, lease.provider_id)]
            assert member and lease.target == member[0].target
            if calling:
                # Granted at once: the least loaded member with room, ties
                # to config order.
                with_room = [
                    m.key
                    for m in GROUPS[group].members
                    if before[m.key]["capacity"][klass] - before[m.key]["in_use"][klass] > 0
                ]
                best = min(with_room, key=lambda k: Fraction(before[k]["in_use"][klass], before[k]["capacity"][klass]))
                assert (lease.node_id, lease.provider_id) == best, (before, lease)
            if reentry == "release":
                self.release(lease)
            elif reentry == "acquire":
                self.acquire(group, klass, None)

        def failed(failure):
            kind = failure.trap(NoLiveProvider, QueueTimeout, QueueFull, CancelledError)
            record.results.append(kind)
            self.check_bounds()
            if kind is NoLiveProvider:
                assert not self.has_candidate(group, klass, self.providers())
            elif kind is QueueTimeout:
                assert self.clock.seconds() - record.start >= GROUPS[group].queue_timeout_sec
            elif kind is QueueFull:
                queued = {g["name"]: g["queued"] for g in self.pool.snapshot()["model_groups"]}
                assert queued[group] == GROUPS[group].max_queue
            if kind is not CancelledError:
                assert group in str(failure.value)

        record.deferred = self.pool.acquire(group, klass)
        record.deferred.addCallbacks(granted, failed)
        calling = False

    def release(self, lease):
        expected = self.counted(lease)
        result = lease.release()
        assert result is expected, (lease, result)
        if result:
            self.released.add(lease)

    # -- rules

    @rule(
        group=st.sampled_from(sorted(GROUPS)),
        klass=st.sampled_from(CLASSES),
        reentry=st.sampled_from([None, None, "release", "release", "acquire"]),
        times=st.integers(1, 3),
    )
    def acquire_rule(self, group, klass, reentry, times):
        for _ in range(times):
            self.acquire(group, klass, reentry)

    @rule(index=st.integers(0, 1000), held=st.booleans())
    def release_or_send_failure(self, index, held):
        """
        Release a held lease (terminal event or send failure), or any lease
        ever granted (a duplicate release, or one of a dead generation).
        """
        choices = self.counted_leases() if held else self.leases
        if choices:
            self.release(choices[index % len(choices)])

    @rule(node=st.sampled_from(NODES), reconnect=st.booleans())
    def disconnect(self, node, reconnect):
        """
        The Node's live generation goes away (if it is offline, its last
        generation is named again: stale), maybe followed by a reconnect.
        """
        generation = self.live[node]
        self.live[node] = None
        self.pool.node_disconnected(node, generation if generation is not None else self.last_generation[node])
        if reconnect:
            self.ready(node)

    @rule(node=st.sampled_from(NODES), back=st.integers(1, 3))
    def stale_disconnect(self, node, back):
        self.pool.node_disconnected(node, self.last_generation[node] - back)

    @rule(node=st.sampled_from(NODES))
    def ready(self, node):
        self.last_generation[node] += 1
        generation = self.live[node] = self.last_generation[node]
        self.pool.node_ready(node, generation)

    @rule(node=st.sampled_from(NODES))
    def duplicate_ready(self, node):
        generation = self.live[node]
        if generation is not None:
            self.pool.node_ready(node, generation)

    @rule(seconds=st.sampled_from([0.5, 1, 2, 3, 5]))
    def advance(self, seconds):
        self.clock.advance(seconds)

    @rule(index=st.integers(0, 1000), waiting=st.booleans())
    def cancel(self, index, waiting):
        """
        The caller goes away: cancel a waiting acquire, or any acquire
        (one that already fired ignores the cancel).
        """
        choices = [a for a in self.acquisitions if a.pending] if waiting else self.acquisitions
        if choices:
            choices[index % len(choices)].deferred.cancel()

    # -- invariants

    @invariant()
    def consistent(self):
        if self._pool is None:
            return
        providers = self.providers()
        self.check_bounds()
        for key, entry in providers.items():
            live = self.live[key[0]] is not None
            assert entry["status"] == ("available" if live else "unavailable")
            for klass in CLASSES:
                assert entry["capacity"][klass] == (self.capacity[key][klass] if live else 0)
                expected = sum(
                    1
                    for lease in self.counted_leases()
                    if (lease.node_id, lease.provider_id, lease.klass) == key + (klass,)
                )
                assert entry["in_use"][klass] == expected, (key, klass, entry, expected)
        assert set(self.pool.active_leases()) == set(self.counted_leases())
        pending = [a for a in self.acquisitions if a.pending]
        queued = {g["name"]: g["queued"] for g in self.pool.snapshot()["model_groups"]}
        for name in GROUPS:
            assert queued[name] == sum(1 for a in pending if a.group == name)
        for waiter in pending:
            assert not self.has_room(waiter.group, waiter.klass, providers)
            assert self.has_candidate(waiter.group, waiter.klass, providers)
        assert len(self.clock.getDelayedCalls()) == len(pending)
        assert all(len(a.results) <= 1 for a in self.acquisitions)

    def teardown(self):
        """
        Quiescence: release everything and let every timeout pass; every
        counter is then 0 and every acquire has fired exactly once.
        """
        if self._pool is None:
            return
        for _ in range(100):
            held = self.counted_leases()
            for lease in held:
                self.release(lease)
            if not held and not any(a.pending for a in self.acquisitions):
                break
            self.clock.advance(MAX_TIMEOUT + 1)
        self.consistent()
        for entry in self.providers().values():
            assert entry["in_use"] == {NORMAL: 0, LONG: 0}, entry
        assert self.pool.active_leases() == []
        assert self.clock.getDelayedCalls() == []
        assert all(len(a.results) == 1 for a in self.acquisitions)


class PoolPropertyTests(SynchronousTestCase):
    """
    Random interleavings against the model.
    """

    def test_random_interleavings(self):
        """
        Over random interleavings of acquires (both classes, four groups
        sharing three resources, with callbacks that release or acquire
        re-entrantly), releases, duplicate releases, disconnects, stale
        disconnects, reconnects, duplicate readies, clock advances and
        cancellations: counters stay within [0, capacity] and equal the
        live generation's unreleased leases; release returns True exactly
        once per counted lease; no waiter waits while its group has room or
        without a live candidate; every waiter has exactly one timer; and at
        quiescence counters are 0 and every acquire fired exactly once.
        """
        run_state_machine_as_test(
            PoolMachine,
            settings=settings(max_examples=200, stateful_step_count=40, deadline=None, database=None),
        )
