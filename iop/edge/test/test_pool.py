"""
Tests for L{iop.edge.pool}: leases, shared capacity, the FIFO queue and
Node lifecycle.
"""

from collections.abc import Callable, Iterable
from typing import TypeVar

from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from iop.edge.pool import (
    LONG,
    NORMAL,
    GroupMember,
    Lease,
    ModelGroupSpec,
    NoLiveProvider,
    Overloaded,
    ProviderPool,
    ProviderSpec,
    QueueFull,
    QueueTimeout,
)
from iop.edge.tenants import Tenant, Ticket


def provider(node, pid, normal=1, long=0, adapter=None, adapter_type="echo"):
    return ProviderSpec(node, pid, adapter or f"{pid}-adapter", adapter_type, normal, long)


def group(name, *keys, **kwargs):
    members = tuple(GroupMember(node, pid, f"{name}-on-{node}") for node, pid in keys)
    return ModelGroupSpec(name, members, **kwargs)


class PoolTestCase(SynchronousTestCase):
    def make_pool(
        self, providers: list[ProviderSpec], groups: list[ModelGroupSpec], ready: Iterable[str] = ()
    ) -> ProviderPool:
        self.clock = Clock()
        pool = ProviderPool(self.clock, providers, groups)
        for node in ready:
            pool.node_ready(node, 1)
        return pool

    def in_use(self, pool, node, pid):
        for entry in pool.snapshot()["providers"]:
            if (entry["node"], entry["id"]) == (node, pid):
                return entry["in_use"]
        raise AssertionError(f"no provider {node}/{pid}")

    def queued(self, pool, name):
        for entry in pool.snapshot()["model_groups"]:
            if entry["name"] == name:
                return entry["queued"]
        raise AssertionError(f"no group {name}")

    def lease_of(self, d: Deferred[Lease]) -> Lease:
        lease = self.successResultOf(d)
        self.assertIsInstance(lease, Lease)
        return lease


class AcquireTests(PoolTestCase):
    """
    Immediate leases and the choice of provider.
    """

    def test_immediate_lease(self):
        """
        With room on a live provider, acquire fires at once with a lease
        describing the provider, the member's target, the class, the live
        generation and the group, and the counter goes up by one.
        """
        pool = self.make_pool(
            [provider("n1", "p1", normal=2, adapter="vllm-a", adapter_type="vllm")],
            [group("m", ("n1", "p1"))],
        )
        pool.node_ready("n1", 7)
        lease = self.lease_of(pool.acquire("m", NORMAL))
        self.assertEqual(
            (
                lease.node_id,
                lease.provider_id,
                lease.adapter,
                lease.adapter_type,
                lease.target,
                lease.klass,
                lease.generation,
                lease.group,
            ),
            ("n1", "p1", "vllm-a", "vllm", "m-on-n1", NORMAL, 7, "m"),
        )
        self.assertTrue(lease.active)
        self.assertEqual(self.in_use(pool, "n1", "p1"), {NORMAL: 1, LONG: 0})
        self.assertEqual(pool.active_leases(), [lease])

    def test_least_loaded(self):
        """
        Acquire picks the live member with the lowest in_use/capacity ratio;
        ties go to config order.
        """
        pool = self.make_pool(
            [provider("n1", "a", normal=2), provider("n2", "b", normal=4)],
            [group("m", ("n1", "a"), ("n2", "b"))],
            ready=["n1", "n2"],
        )
        picks = [self.lease_of(pool.acquire("m", NORMAL)).provider_id for _ in range(6)]
        # 0/2=0/4 -> a; 1/2>0/4 -> b; 1/2>1/4 -> b; 1/2=2/4 -> a; 2/2 full -> b; -> b
        self.assertEqual(picks, ["a", "b", "b", "a", "b", "b"])

    def test_shared_capacity(self):
        """
        Two model groups naming one resource share its one counter: a lease
        taken through one group leaves no room for the other, and its
        release serves the other group's waiter.
        """
        pool = self.make_pool(
            [provider("n1", "p1", normal=1)],
            [group("g1", ("n1", "p1")), group("g2", ("n1", "p1"))],
            ready=["n1"],
        )
        first = self.lease_of(pool.acquire("g1", NORMAL))
        waiting = pool.acquire("g2", NORMAL)
        self.assertNoResult(waiting)
        self.assertEqual(self.in_use(pool, "n1", "p1"), {NORMAL: 1, LONG: 0})
        self.assertTrue(first.release())
        second = self.lease_of(waiting)
        self.assertEqual((second.group, second.target), ("g2", "g2-on-n1"))
        self.assertEqual(self.in_use(pool, "n1", "p1"), {NORMAL: 1, LONG: 0})

    def test_classes_independent(self):
        """
        The normal and long counters of a resource are independent: a full
        normal counter does not stop a long lease, and each lease counts
        only against its own class.
        """
        pool = self.make_pool(
            [provider("n1", "p1", normal=1, long=1)],
            [group("m", ("n1", "p1"))],
            ready=["n1"],
        )
        normal = self.lease_of(pool.acquire("m", NORMAL))
        long = self.lease_of(pool.acquire("m", LONG))
        self.assertEqual((normal.klass, long.klass), (NORMAL, LONG))
        self.assertEqual(self.in_use(pool, "n1", "p1"), {NORMAL: 1, LONG: 1})
        self.assertNoResult(pool.acquire("m", NORMAL))
        long.release()
        self.assertEqual(self.in_use(pool, "n1", "p1"), {NORMAL: 1, LONG: 0})
        self.assertEqual(self.queued(pool, "m"), 1)

    def test_long_waiter_does_not_block_normal(self):
        """
        A queued long request does not hold back a normal one of the same
        group: normal room serves the normal waiter behind it.
        """
        pool = self.make_pool(
            [provider("n1", "p1", normal=1, long=1)],
            [group("m", ("n1", "p1"))],
            ready=["n1"],
        )
        normal = self.lease_of(pool.acquire("m", NORMAL))
        self.lease_of(pool.acquire("m", LONG))
        long_waiter = pool.acquire("m", LONG)
        normal_waiter = pool.acquire("m", NORMAL)
        normal.release()
        self.assertNoResult(long_waiter)
        self.assertEqual(self.lease_of(normal_waiter).klass, NORMAL)

    def test_classify(self):
        """
        A request is long only when the group has a threshold and the input
        is strictly longer than it.
        """
        pool = self.make_pool(
            [provider("n1", "p1")],
            [group("t", ("n1", "p1"), long_threshold_chars=100), group("u", ("n1", "p1"))],
        )
        self.assertEqual(pool.classify("t", 0), NORMAL)
        self.assertEqual(pool.classify("t", 100), NORMAL)
        self.assertEqual(pool.classify("t", 101), LONG)
        self.assertEqual(pool.classify("u", 10**9), NORMAL)

    def test_unknown_group(self):
        """
        An unknown model group is a caller error: acquire and classify raise
        KeyError naming it; group() returns None.
        """
        pool = self.make_pool([provider("n1", "p1")], [group("m", ("n1", "p1"))], ready=["n1"])
        self.assertIsNone(pool.group("nope"))
        spec = pool.group("m")
        assert spec is not None
        self.assertEqual(spec.name, "m")
        error = self.assertRaises(KeyError, pool.acquire, "nope", NORMAL)
        self.assertIn("nope", str(error))
        self.assertRaises(KeyError, pool.classify, "nope", 1)

    def test_unknown_class(self):
        """
        A request class other than normal or long is refused.
        """
        pool = self.make_pool([provider("n1", "p1")], [group("m", ("n1", "p1"))], ready=["n1"])
        self.assertRaises(ValueError, pool.acquire, "m", "huge")

    def test_bad_config(self):
        """
        Duplicate providers or groups, negative capacities and members naming
        unknown providers are refused with messages naming them.
        """
        clock = Clock()
        p = provider("n1", "p1")
        error = self.assertRaises(ValueError, ProviderPool, clock, [p, p], [])
        self.assertIn("n1/p1", str(error))
        error = self.assertRaises(ValueError, ProviderPool, clock, [provider("n1", "p1", normal=-1)], [])
        self.assertIn("normal", str(error))
        error = self.assertRaises(ValueError, ProviderPool, clock, [p], [group("m", ("n1", "zz"))])
        self.assertIn("n1/zz", str(error))
        error = self.assertRaises(ValueError, ProviderPool, clock, [p], [group("m"), group("m")])
        self.assertIn("'m'", str(error))

    def test_no_live_provider_at_once(self):
        """
        With no live candidate (every member offline, or no capacity for the
        class) acquire fails at once with NoLiveProvider naming the group,
        and nothing waits.
        """
        pool = self.make_pool([provider("n1", "p1", normal=1, long=0)], [group("m", ("n1", "p1"))])
        failure = self.failureResultOf(pool.acquire("m", NORMAL), NoLiveProvider)
        self.assertIn("'m'", str(failure.value))
        self.assertEqual(failure.value.group, "m")
        pool.node_ready("n1", 1)
        self.failureResultOf(pool.acquire("m", LONG), NoLiveProvider)
        self.assertEqual(self.clock.getDelayedCalls(), [])
        self.assertEqual(self.queued(pool, "m"), 0)

    def test_group_without_members(self):
        """
        A group with no members has no live candidate.
        """
        pool = self.make_pool([], [group("empty")])
        self.failureResultOf(pool.acquire("empty", NORMAL), NoLiveProvider)


class QueueTests(PoolTestCase):
    """
    Waiting for room: FIFO, timeouts, limits and cancellation.
    """

    def setUp(self):
        self.pool = self.make_pool(
            [provider("n1", "p1", normal=1)],
            [group("m", ("n1", "p1"), queue_timeout_sec=2.5, max_queue=3)],
            ready=["n1"],
        )
        self.held = self.lease_of(self.pool.acquire("m", NORMAL))

    def test_fifo(self):
        """
        Waiters of one group are served one per freed slot, oldest first.
        """
        waiters = [self.pool.acquire("m", NORMAL) for _ in range(3)]
        lease = self.held
        for i, d in enumerate(waiters):
            for later in waiters[i:]:
                self.assertNoResult(later)
            lease.release()
            lease = self.lease_of(d)
        self.assertEqual(self.queued(self.pool, "m"), 0)

    def test_oldest_waiter_across_groups(self):
        """
        A slot freed on a resource shared by two groups goes to the waiter
        that has waited longest, whichever group it is in.
        """
        pool = self.make_pool(
            [provider("n1", "p1", normal=1)],
            [group("g1", ("n1", "p1")), group("g2", ("n1", "p1"))],
            ready=["n1"],
        )
        held = self.lease_of(pool.acquire("g1", NORMAL))
        w2 = pool.acquire("g2", NORMAL)
        w1 = pool.acquire("g1", NORMAL)
        held.release()
        self.assertEqual(self.lease_of(w2).group, "g2")
        self.assertNoResult(w1)

    def test_timeout_exactly(self):
        """
        A waiter fails with QueueTimeout naming the group exactly
        queue_timeout_sec after it was queued, and leaves the queue.
        """
        d = self.pool.acquire("m", NORMAL)
        self.clock.advance(2.25)
        self.assertNoResult(d)
        self.clock.advance(0.25)
        failure = self.failureResultOf(d, QueueTimeout)
        self.assertIn("'m'", str(failure.value))
        self.assertEqual(self.queued(self.pool, "m"), 0)
        self.held.release()
        self.assertEqual(self.in_use(self.pool, "n1", "p1"), {NORMAL: 0, LONG: 0})

    def test_served_cancels_timer(self):
        """
        A served waiter's timeout timer is cancelled.
        """
        d = self.pool.acquire("m", NORMAL)
        self.assertEqual(len(self.clock.getDelayedCalls()), 1)
        self.held.release()
        self.lease_of(d)
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_queue_full(self):
        """
        With max_queue waiters already queued, acquire fails at once with
        QueueFull naming the group; the waiters are untouched.
        """
        waiters = [self.pool.acquire("m", NORMAL) for _ in range(3)]
        failure = self.failureResultOf(self.pool.acquire("m", NORMAL), QueueFull)
        self.assertIn("'m'", str(failure.value))
        self.assertEqual(self.queued(self.pool, "m"), 3)
        for d in waiters:
            self.assertNoResult(d)

    def test_at_the_bound_a_waiter_takes_a_crowding_place(self):
        """
        Work that came at the Edge's bound on waiting work
        (C{Ticket.at_bound}) and must wait takes the newest place of a key
        waiting two more than its own; with no such key it is refused
        (L{Overloaded}) and nobody's place is taken. The mark is for that
        one acquire.
        """
        heavy = [self.pool.acquire("m", NORMAL, ticket=Ticket(Tenant("heavy"), 1)) for _ in range(2)]
        light = Ticket(Tenant("light"), 1)
        light.at_bound = True
        newcomer = self.pool.acquire("m", NORMAL, ticket=light)
        self.assertNoResult(newcomer)
        self.assertFalse(light.at_bound)
        self.assertNoResult(heavy[0])
        self.failureResultOf(heavy[1], QueueFull)
        another = Ticket(Tenant("heavy"), 1)
        another.at_bound = True
        self.failureResultOf(self.pool.acquire("m", NORMAL, ticket=another), Overloaded)
        self.assertEqual(self.queued(self.pool, "m"), 2)

    def test_queue_zero(self):
        """
        max_queue=0 means never wait: no room is QueueFull at once.
        """
        pool = self.make_pool([provider("n1", "p1")], [group("m", ("n1", "p1"), max_queue=0)], ready=["n1"])
        self.lease_of(pool.acquire("m", NORMAL))
        self.failureResultOf(pool.acquire("m", NORMAL), QueueFull)

    def test_cancel_waiter(self):
        """
        Cancelling a waiting acquire removes it from the queue at once,
        cancels its timer and errbacks CancelledError; the next freed slot
        goes to the next waiter.
        """
        d1 = self.pool.acquire("m", NORMAL)
        d2 = self.pool.acquire("m", NORMAL)
        self.assertEqual(self.queued(self.pool, "m"), 2)
        d1.cancel()
        self.failureResultOf(d1, CancelledError)
        self.assertEqual(self.queued(self.pool, "m"), 1)
        self.assertEqual(len(self.clock.getDelayedCalls()), 1)
        self.held.release()
        self.lease_of(d2)
        self.assertEqual(self.clock.getDelayedCalls(), [])
        self.assertEqual(self.in_use(self.pool, "n1", "p1"), {NORMAL: 1, LONG: 0})

    def test_cancel_lease_is_no_op(self):
        """
        Cancelling an acquire that already fired changes nothing: the lease
        stays held.
        """
        d = self.pool.acquire("m", NORMAL)
        self.held.release()
        d.cancel()
        self.assertTrue(self.lease_of(d).active)

    def test_duplicate_release(self):
        """
        Release returns True the first time only; a second release changes
        no counter and serves nobody.
        """
        d = self.pool.acquire("m", NORMAL)
        self.assertTrue(self.held.release())
        lease = self.lease_of(d)
        self.assertFalse(self.held.release())
        self.assertFalse(self.held.active)
        self.assertEqual(self.in_use(self.pool, "n1", "p1"), {NORMAL: 1, LONG: 0})
        self.assertTrue(lease.release())
        self.assertFalse(lease.release())
        self.assertEqual(self.in_use(self.pool, "n1", "p1"), {NORMAL: 0, LONG: 0})


class LifecycleTests(PoolTestCase):
    """
    Node ready and disconnect, generations.
    """

    def test_disconnect(self):
        """
        Disconnect of the live generation returns the Node's leases (their
        release then returns False), takes its providers offline, fails at
        once the waiters left without a live candidate and keeps the others
        waiting.
        """
        pool = self.make_pool(
            [provider("n1", "p"), provider("n2", "p")],
            [group("only1", ("n1", "p")), group("both", ("n1", "p"), ("n2", "p"))],
            ready=["n1", "n2"],
        )
        on_n1 = self.lease_of(pool.acquire("only1", NORMAL))
        on_n2 = self.lease_of(pool.acquire("both", NORMAL))
        self.assertEqual(on_n2.node_id, "n2")
        lost = pool.acquire("only1", NORMAL)
        kept = pool.acquire("both", NORMAL)
        pool.node_disconnected("n1", 1)
        failure = self.failureResultOf(lost, NoLiveProvider)
        self.assertIn("'only1'", str(failure.value))
        self.assertNoResult(kept)
        self.assertFalse(on_n1.active)
        self.assertFalse(on_n1.release())
        self.assertEqual(self.in_use(pool, "n1", "p"), {NORMAL: 0, LONG: 0})
        self.assertEqual(pool.active_leases(), [on_n2])
        self.assertEqual(self.queued(pool, "only1"), 0)
        self.assertEqual(self.queued(pool, "both"), 1)
        self.assertEqual(len(self.clock.getDelayedCalls()), 1)
        on_n2.release()
        self.assertEqual(self.lease_of(kept).node_id, "n2")

    def test_stale_disconnect_ignored(self):
        """
        A disconnect naming a generation that is not the live one (an old
        one, or a Node never ready) changes nothing.
        """
        pool = self.make_pool([provider("n1", "p")], [group("m", ("n1", "p"))])
        pool.node_disconnected("n1", 1)
        pool.node_ready("n1", 2)
        lease = self.lease_of(pool.acquire("m", NORMAL))
        waiter = pool.acquire("m", NORMAL)
        pool.node_disconnected("n1", 1)
        pool.node_disconnected("ghost", 2)
        self.assertTrue(lease.active)
        self.assertNoResult(waiter)
        self.assertEqual(pool.snapshot()["providers"][0]["status"], "available")

    def test_reconnect_serves_waiters_once(self):
        """
        A reconnect's ready restores capacity under the new generation and
        serves the waiters at once, each exactly once, in FIFO order.
        """
        pool = self.make_pool(
            [provider("n1", "p", normal=2), provider("n2", "p", normal=1)],
            [group("m", ("n1", "p"), ("n2", "p"))],
            ready=["n1", "n2"],
        )
        [self.lease_of(pool.acquire("m", NORMAL)) for _ in range(3)]
        served = []
        waiters = [pool.acquire("m", NORMAL) for _ in range(3)]
        for i, d in enumerate(waiters):
            d.addCallback(lambda lease, i: served.append((i, lease)), i)
        pool.node_disconnected("n1", 1)
        self.assertEqual(served, [])
        pool.node_ready("n1", 2)
        self.assertEqual([(i, lease.node_id, lease.generation) for i, lease in served], [(0, "n1", 2), (1, "n1", 2)])
        pool.node_ready("n1", 2)  # a duplicate ready changes nothing
        self.assertEqual(len(served), 2)
        self.assertEqual(self.queued(pool, "m"), 1)
        self.assertEqual(self.in_use(pool, "n1", "p"), {NORMAL: 2, LONG: 0})

    def test_old_generation_release(self):
        """
        Releasing a lease of an old generation after the reconnect returns
        False and leaves the new generation's counters alone.
        """
        pool = self.make_pool([provider("n1", "p", normal=2)], [group("m", ("n1", "p"))], ready=["n1"])
        old = self.lease_of(pool.acquire("m", NORMAL))
        pool.node_disconnected("n1", 1)
        pool.node_ready("n1", 2)
        new = self.lease_of(pool.acquire("m", NORMAL))
        self.assertEqual(new.generation, 2)
        self.assertFalse(old.release())
        self.assertEqual(self.in_use(pool, "n1", "p"), {NORMAL: 1, LONG: 0})
        self.assertEqual(pool.active_leases(), [new])

    def test_ready_replaces_generation(self):
        """
        A ready with a new generation while the old one is still live
        returns the old generation's leases first (once: their release
        returns False) and serves waiters with the restored room.
        """
        pool = self.make_pool([provider("n1", "p")], [group("m", ("n1", "p"))], ready=["n1"])
        old = self.lease_of(pool.acquire("m", NORMAL))
        waiter = pool.acquire("m", NORMAL)
        pool.node_ready("n1", 2)
        self.assertFalse(old.active)
        self.assertEqual(self.lease_of(waiter).generation, 2)
        self.assertFalse(old.release())
        self.assertEqual(self.in_use(pool, "n1", "p"), {NORMAL: 1, LONG: 0})

    def test_snapshot(self):
        """
        The snapshot lists every configured provider in config order, an
        offline one as unavailable/offline with capacity and in_use 0, and
        the queue length of every model group.
        """
        pool = self.make_pool(
            [
                provider("n1", "p1", normal=2, long=1, adapter="a1"),
                provider("n2", "p2", normal=3, long=2, adapter="a2"),
            ],
            [group("m", ("n1", "p1")), group("o", ("n2", "p2"))],
            ready=["n1"],
        )
        self.lease_of(pool.acquire("m", LONG))
        pool.acquire("m", LONG)
        self.assertEqual(
            pool.snapshot(),
            {
                "providers": [
                    {
                        "node": "n1",
                        "id": "p1",
                        "adapter": "a1",
                        "status": "available",
                        "health": "ok",
                        "capacity": {"normal": 2, "long": 1},
                        "in_use": {"normal": 0, "long": 1},
                    },
                    {
                        "node": "n2",
                        "id": "p2",
                        "adapter": "a2",
                        "status": "unavailable",
                        "health": "offline",
                        "capacity": {"normal": 0, "long": 0},
                        "in_use": {"normal": 0, "long": 0},
                    },
                ],
                "model_groups": [{"name": "m", "queued": 1}, {"name": "o", "queued": 0}],
                "direct_queues": [],
            },
        )


class ReentrancyTests(PoolTestCase):
    """
    Callbacks on fired Deferreds may call back into the pool.
    """

    def setUp(self):
        self.pool = self.make_pool([provider("n1", "p", normal=1)], [group("m", ("n1", "p"))], ready=["n1"])

    def test_release_in_callback(self):
        """
        A served waiter whose callback releases its lease at once passes the
        slot on to the next waiter; counters stay exact.
        """
        held = self.lease_of(self.pool.acquire("m", NORMAL))
        first = self.pool.acquire("m", NORMAL)
        first.addCallback(lambda lease: lease.release())
        second = self.pool.acquire("m", NORMAL)
        held.release()
        self.assertIs(self.successResultOf(first), True)
        lease = self.lease_of(second)
        self.assertEqual(self.pool.active_leases(), [lease])
        self.assertEqual(self.in_use(self.pool, "n1", "p"), {NORMAL: 1, LONG: 0})

    def test_acquire_in_callback(self):
        """
        A callback may acquire again: with no room it queues behind the
        waiters already there.
        """
        held = self.lease_of(self.pool.acquire("m", NORMAL))
        inner = []
        first = self.pool.acquire("m", NORMAL)

        def again(lease: Lease) -> Lease:
            inner.append(self.pool.acquire("m", NORMAL))
            return lease

        first.addCallback(again)
        second = self.pool.acquire("m", NORMAL)
        held.release()
        lease = self.lease_of(first)
        lease.release()
        self.lease_of(second)
        self.assertNoResult(inner[0])

    def test_state_consistent_before_firing(self):
        """
        When a ready serves several waiters, every lease is counted before
        the first Deferred fires; a callback cancelling a waiter served in
        the same batch makes the pool take that lease back.
        """
        pool = self.make_pool([provider("n1", "p", normal=2)], [group("m", ("n1", "p"))])
        pool.node_ready("n1", 1)
        held = [self.lease_of(pool.acquire("m", NORMAL)) for _ in range(2)]
        seen = []
        first = pool.acquire("m", NORMAL)
        second = pool.acquire("m", NORMAL)
        third = pool.acquire("m", NORMAL)

        def on_first(lease):
            seen.append(self.in_use(pool, "n1", "p")[NORMAL])
            second.cancel()
            return lease

        first.addCallback(on_first)
        pool.node_ready("n1", 2)  # returns the two held leases, room for two
        self.assertEqual(seen, [2])
        self.assertFalse(held[0].active)
        self.failureResultOf(second, CancelledError)
        self.lease_of(first)
        self.assertEqual(self.lease_of(third).generation, 2)
        self.assertEqual(self.in_use(pool, "n1", "p"), {NORMAL: 2, LONG: 0})
        self.assertEqual(self.clock.getDelayedCalls(), [])


T = TypeVar("T")


def waiter_reads(case: SynchronousTestCase, action: Callable[[], T]) -> tuple[T, int]:
    """
    What C{action()} returns, and how many times it read an attribute of
    a waiter: what a queue costs to walk, counted instead of timed.
    """
    from iop.edge import pool as module

    reads = [0]
    plain = object.__getattribute__

    def counted(waiter: object, name: str) -> object:
        reads[0] += 1
        return plain(waiter, name)

    case.patch(module._Waiter, "__getattribute__", counted)
    try:
        result = action()
    finally:
        case.patch(module._Waiter, "__getattribute__", plain)
    return result, reads[0]


class PumpCostTests(PoolTestCase):
    """
    A release costs what can be served, not the length of the queue: the
    pump does not look at every waiter of a queue none of whom fits.
    """

    WAITERS = 2000

    def touches(self, pool: ProviderPool, release: Lease) -> int:
        """
        How many times waiters' attributes are read while C{release} is
        returned (the pump's walk over the queue, whatever its shape).
        """
        return waiter_reads(self, release.release)[1]

    def fill(self, pool: ProviderPool, klass: str, node_id: str | None = None) -> list[Deferred[Lease]]:
        tenants = [Tenant(f"k{i}") for i in range(4)]
        return [
            pool.acquire("m", klass, node_id=node_id, ticket=Ticket(tenants[i % 4], 10)) for i in range(self.WAITERS)
        ]

    def test_full_group(self):
        """
        Every provider of the group is full: a release serves the next
        waiter, and the pass after it, finding no room, does not walk the
        rest of the line.
        """
        pool = self.make_pool([provider("n1", "p1", normal=1)], [group("m", ("n1", "p1"))], ready=["n1"])
        held = self.lease_of(pool.acquire("m", NORMAL))
        waiters = self.fill(pool, NORMAL)
        self.assertLess(self.touches(pool, held), 200)
        self.lease_of(waiters[0])
        self.assertNoResult(waiters[1])

    def test_class_without_room(self):
        """
        Every waiter wants the long class, which is full: a normal slot
        coming back does not make the pump look at each of them.
        """
        pool = self.make_pool([provider("n1", "p1", normal=1, long=1)], [group("m", ("n1", "p1"))], ready=["n1"])
        self.lease_of(pool.acquire("m", LONG))
        normal = self.lease_of(pool.acquire("m", NORMAL))
        waiters = self.fill(pool, LONG)
        self.assertLess(self.touches(pool, normal), 200)
        self.assertNoResult(waiters[0])

    def test_named_node_without_room(self):
        """
        Every waiter named a node whose provider is full: a slot of another
        node of the group coming back does not make the pump try each of
        them.
        """
        pool = self.make_pool(
            [provider("n1", "p1"), provider("n2", "p2")], [group("m", ("n1", "p1"), ("n2", "p2"))], ready=["n1", "n2"]
        )
        self.lease_of(pool.acquire("m", NORMAL, node_id="n1"))
        other = self.lease_of(pool.acquire("m", NORMAL, node_id="n2"))
        waiters = self.fill(pool, NORMAL, node_id="n1")
        self.assertLess(self.touches(pool, other), 200)
        self.assertNoResult(waiters[0])


class QueueViewCostTests(PoolTestCase):
    """
    A key asking where its work stands (C{GET /v1/queue}) costs what it
    has waiting and what stands ahead of it, not every queued request.
    """

    def touches(self, pool: ProviderPool, tenant: str) -> tuple[list[dict], int]:
        """
        C{pool.queued(tenant)}, and how many times waiters' attributes
        were read to answer it.
        """
        return waiter_reads(self, lambda: pool.queued(tenant))

    def setUp(self):
        self.pool = self.make_pool(
            [provider("n1", "p1"), provider("n2", "p2")],
            [group("big", ("n1", "p1")), group("small", ("n2", "p2"))],
            ready=["n1", "n2"],
        )
        self.lease_of(self.pool.acquire("big", NORMAL))
        self.lease_of(self.pool.acquire("small", NORMAL))
        self.crowd = [self.pool.acquire("big", NORMAL, ticket=Ticket(Tenant(f"k{i % 4}"), 10)) for i in range(2000)]

    def test_other_queue_not_looked_at(self):
        """
        A key waiting in another queue, or nowhere, is answered without
        playing the crowded queue's line forward.
        """
        self.pool.acquire("small", NORMAL, ticket=Ticket(Tenant("me"), 10))
        view, reads = self.touches(self.pool, "me")
        self.assertEqual(view, [e for e in self.pool.queued() if e["key"] == "me"])
        self.assertEqual([(e["model"], e["position"]) for e in view], [("small", 1)])
        self.assertLess(reads, 100)
        view, reads = self.touches(self.pool, "nobody")
        self.assertEqual((view, reads), ([], 0))

    def test_front_of_a_long_line(self):
        """
        A key whose one request is next in a long line is answered from the
        front of the line, not from all of it.
        """
        self.pool.acquire("big", NORMAL, ticket=Ticket(Tenant("me"), 10))
        view, reads = self.touches(self.pool, "me")
        self.assertEqual(view, [e for e in self.pool.queued() if e["key"] == "me"])
        self.assertEqual([e["position"] for e in view], [5])  # behind the 4 keys' first
        self.assertLess(reads, 200)

    def test_behind_a_higher_class(self):
        """
        Work of a lower class stands behind all of a higher one: counted,
        not played forward.
        """
        self.pool.acquire("big", NORMAL, ticket=Ticket(Tenant("me", priority=-1), 10))
        view, reads = self.touches(self.pool, "me")
        self.assertEqual(view, [e for e in self.pool.queued() if e["key"] == "me"])
        self.assertEqual([e["position"] for e in view], [2001])
        self.assertLess(reads, 100)


class FullGroupCostTests(PoolTestCase):
    """
    A request to a large group that is full (a busy Edge's usual state)
    learns whether to wait or fail without asking every member whether it
    is a live candidate: a count kept per queue answers.
    """

    MEMBERS = 1000

    def setUp(self):
        providers = [provider(f"n{i}", "p", normal=1) for i in range(self.MEMBERS)]
        self.pool = self.make_pool(
            providers, [group("m", *((p.node_id, "p") for p in providers))], ready=[p.node_id for p in providers]
        )
        self.held = [self.lease_of(self.pool.acquire("m", NORMAL)) for _ in range(self.MEMBERS)]

    def asks(self, call) -> int:
        """
        How many times members are looked up or asked whether they are a
        (panic) candidate while C{call()} runs.
        """
        from iop.edge import pool as module

        asked = [0]
        for name in ("candidate", "panic_candidate"):
            plain = getattr(module._Resource, name)

            def counted(resource, klass, plain=plain):
                asked[0] += 1
                return plain(resource, klass)

            self.patch(module._Resource, name, counted)

        class Resources(dict):
            def __getitem__(self, key):
                asked[0] += 1
                return dict.__getitem__(self, key)

        self.patch(self.pool, "_resources", Resources(self.pool._resources))
        call()
        return asked[0]

    def test_acquire_on_full_group(self):
        """
        A new request on a full group waits, having asked a handful of
        members at most.
        """
        waiting: list[Deferred[Lease]] = []
        self.assertLess(self.asks(lambda: waiting.append(self.pool.acquire("m", NORMAL))), 20)
        self.assertNoResult(waiting[0])
        self.assertEqual(self.queued(self.pool, "m"), 1)

    def test_release_with_waiters(self):
        """
        A release on a full group with work waiting serves the next waiter;
        finding no more room after it costs a handful of questions, not one
        per member.
        """
        waiting = [self.pool.acquire("m", NORMAL) for _ in range(3)]
        self.assertLess(self.asks(self.held.pop().release), 20)
        self.lease_of(waiting[0])
        self.assertNoResult(waiting[1])

    def test_acquire_behind_members_gone(self):
        """
        Likewise when most of the group is offline or draining and the
        live candidates are the last members listed.
        """
        for i in range(self.MEMBERS - 10):
            if i % 2:
                self.pool.node_disconnected(f"n{i}", 1)
            else:
                self.pool.node_draining(f"n{i}", 1)
        waiting: list[Deferred[Lease]] = []
        self.assertLess(self.asks(lambda: waiting.append(self.pool.acquire("m", NORMAL))), 20)
        self.assertNoResult(waiting[0])

    def test_no_live_candidate(self):
        """
        With every member offline a request fails at once, again without
        asking each of them.
        """
        for i in range(self.MEMBERS):
            self.pool.node_disconnected(f"n{i}", 1)
        failed: list[Deferred[Lease]] = []
        self.assertLess(self.asks(lambda: failed.append(self.pool.acquire("m", NORMAL))), 20)
        self.failureResultOf(failed[0], NoLiveProvider)
