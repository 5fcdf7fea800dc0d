"""
The pool's order and health beyond ejection: members' C{priority}, panic
mode when every provider of a group is ejected, and probes that return an
ejected provider before its cooldown ends.
"""

from twisted.internet import defer
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from iop.edge.pool import NORMAL, GroupMember, HealthPolicy, ModelGroupSpec, ProviderPool, ProviderSpec


def make_pool(priorities=(0, 0, 0), prober=None, probe_interval=5.0):
    clock = Clock()
    providers = [ProviderSpec("n", f"p{i}", f"a{i}", "echo", 2, 0) for i in range(len(priorities))]
    members = tuple(
        GroupMember("n", p.provider_id, "", priority) for p, priority in zip(providers, priorities, strict=True)
    )
    health = HealthPolicy(failures_to_eject=1, cooldown_sec=30, max_cooldown_sec=60, probe_interval_sec=probe_interval)
    pool = ProviderPool(clock, providers, [ModelGroupSpec("g", members)], health=health, prober=prober)
    pool.node_ready("n", 1)
    return pool, clock


class PriorityTests(SynchronousTestCase):
    def leased(self, pool, **kwargs):
        return self.successResultOf(pool.acquire("g", NORMAL, **kwargs))

    def test_best_priority_first_even_when_loaded(self):
        """
        Priority 0 takes both its slots before priority 1 gets one, and
        priority 2 comes last, whatever their load.
        """
        pool, _ = make_pool((1, 0, 2))
        order = [self.leased(pool).provider_id for _ in range(6)]
        self.assertEqual(order, ["p1", "p1", "p0", "p0", "p2", "p2"])

    def test_filtered_choice_keeps_priority(self):
        """
        A filtered choice (some providers left out) keeps the order too.
        """
        pool, _ = make_pool((1, 0, 2))
        accept = lambda spec: spec.provider_id != "p0"  # noqa: E731
        order = [self.leased(pool, accept=accept).provider_id for _ in range(3)]
        self.assertEqual(order, ["p1", "p1", "p2"])

    def test_ejected_better_priority_skipped(self):
        """
        An ejected provider of the best priority is passed over for the
        next one.
        """
        pool, _ = make_pool((0, 1, 2))
        self.leased(pool).report("provider_unreachable", "down")
        self.assertEqual(self.leased(pool).provider_id, "p1")


class PanicTests(SynchronousTestCase):
    def test_all_ejected_goes_to_oldest_failure(self):
        """
        With every provider ejected, work goes to the one that failed
        longest ago (not NoLiveProvider); its answer returns it at once.
        """
        pool, clock = make_pool((0, 0, 0), probe_interval=0)
        leases = [self.successResultOf(pool.acquire("g", NORMAL)) for _ in range(3)]
        for name in ("p1", "p0", "p2"):
            (lease,) = [lease for lease in leases if lease.provider_id == name]
            lease.report("provider_unreachable", "down")
            lease.release()
            clock.advance(1)
        self.assertEqual(pool.snapshot()["model_groups"][0]["panic"], True)
        lease = self.successResultOf(pool.acquire("g", NORMAL))
        self.assertEqual(lease.provider_id, "p1")
        lease.report()
        self.assertEqual(pool.snapshot()["providers"][1]["health"], "ok")
        self.assertNotIn("panic", pool.snapshot()["model_groups"][0])

    def test_offline_is_not_panic(self):
        """
        Providers that are offline are no candidates, panic or not.
        """
        pool, _ = make_pool((0,))
        pool.node_disconnected("n", 1)
        self.failureResultOf(pool.acquire("g", NORMAL))


class ProbeTests(SynchronousTestCase):
    def setUp(self):
        self.answers: list[bool | None] = []
        self.probed: list[str] = []

        def prober(spec):
            self.probed.append(spec.provider_id)
            return defer.succeed(self.answers.pop(0))

        self.pool, self.clock = make_pool((0, 1), prober=prober)

    def eject_p0(self):
        lease = self.successResultOf(self.pool.acquire("g", NORMAL))
        self.assertEqual(lease.provider_id, "p0")
        lease.report("provider_unreachable", "down")
        lease.release()

    def health(self, index=0):
        return self.pool.snapshot()["providers"][index]

    def test_probe_returns_before_cooldown(self):
        """
        Probes every interval while ejected; the first that passes returns
        the provider (long before the 30 s cooldown), and probing stops.
        """
        self.eject_p0()
        self.answers = [False, True]
        self.clock.advance(5)
        self.assertEqual(self.health()["health"], "ejected")
        self.clock.advance(5)
        self.assertEqual(self.health()["health"], "ok")
        self.assertEqual(self.health()["probes"], {"failed": 1, "passed": 1})
        self.clock.advance(60)
        self.assertEqual(self.probed, ["p0", "p0"])
        self.assertEqual(self.successResultOf(self.pool.acquire("g", NORMAL)).provider_id, "p0")

    def test_cannot_be_probed(self):
        """
        A provider that cannot be probed (C{None}) waits for its cooldown.
        """
        self.eject_p0()
        self.answers = [None]
        self.clock.advance(29)
        self.assertEqual(self.probed, ["p0"])
        self.assertEqual(self.health()["health"], "ejected")
        self.clock.advance(1)
        self.assertEqual(self.health()["health"], "ok")

    def test_cooldown_stops_probes(self):
        """
        After the cooldown the provider is on trial: no more probes.
        """
        self.eject_p0()
        self.answers = [False] * 10
        self.clock.pump([5] * 12)
        self.assertEqual(len(self.probed), 5)
        self.assertEqual(self.health()["health"], "ok")
