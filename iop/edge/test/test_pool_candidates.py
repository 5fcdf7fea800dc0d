"""
The pool's candidate counts (L{iop.edge.pool._LoadIndex.candidates} and
C{panic_candidates}) against the scan of every member they replace, under
random leases, returns, waiters, Nodes going ready, draining and offline,
ejections and readmissions, capacity changes and adapters coming and
going.
"""

from dataclasses import replace

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, rule, run_state_machine_as_test
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from iop.edge.pool import CLASSES, GroupMember, HealthPolicy, ModelGroupSpec, ProviderPool, ProviderSpec
from iop.edge.test.test_pool_index import NODES, NodeLifecycle

ADAPTERS = ("a", "b")
#: The adapter no provider names, whose implicit resource comes and goes.
LOOSE = "x"


def scanned(pool, queue, klass, panic):
    """
    The answer of a scan of every member: a live candidate, or (with
    C{panic}) an ejected one taking work.
    """
    resources = [pool._resources[m.key] for m in queue.members]
    return any(r.candidate(klass) or (panic and r.panic_candidate(klass)) for r in resources)


class CandidateMachine(NodeLifecycle):
    @initialize(
        capacities=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 1)), min_size=8, max_size=8),
        priorities=st.lists(st.integers(0, 1), min_size=8, max_size=8),
    )
    def set_up(self, capacities, priorities):
        self.providers = [
            ProviderSpec(NODES[i % len(NODES)], f"p{i}", ADAPTERS[i % 2], "echo", normal, long)
            for i, (normal, long) in enumerate(capacities)
        ]
        members = tuple(
            GroupMember(p.node_id, p.provider_id, "", priority)
            for p, priority in zip(self.providers, priorities, strict=True)
        )
        # A group of some of them, one listed twice.
        some = (members[1], members[2], replace(members[1], target="other"), members[5])
        self.clock = Clock()
        self.pool = ProviderPool(
            self.clock,
            self.providers,
            [ModelGroupSpec("g", members, queue_timeout_sec=3), ModelGroupSpec("h", some, queue_timeout_sec=3)],
            health=HealthPolicy(1, 5, 20, 0),
        )
        self.leases = []
        self.generation = 0
        for node in NODES:
            self.ready(node)

    def keep(self, d, cancel):
        d.addCallback(self.leases.append)
        d.addErrback(lambda failure: None)
        if cancel and not d.called:
            d.cancel()

    @rule(group=st.sampled_from(("g", "h")), klass=st.sampled_from(CLASSES), cancel=st.booleans())
    def lease(self, group, klass, cancel):
        self.keep(self.pool.acquire(group, klass), cancel)

    @rule(
        node=st.sampled_from(NODES),
        adapter=st.sampled_from((*ADAPTERS, LOOSE)),
        klass=st.sampled_from(CLASSES),
        cancel=st.booleans(),
    )
    def lease_direct(self, node, adapter, klass, cancel):
        try:
            d = self.pool.acquire_direct(node, adapter, klass)
        except KeyError:
            return
        self.keep(d, cancel)

    @rule(data=st.data())
    def release(self, data):
        if self.leases:
            self.leases.pop(data.draw(st.integers(0, len(self.leases) - 1))).release()

    @rule(data=st.data(), answered=st.booleans())
    def report(self, data, answered):
        # One failure ejects; an answer readmits at once.
        if self.leases:
            lease = self.leases[data.draw(st.integers(0, len(self.leases) - 1))]
            lease.report(None if answered else "provider_unreachable", "refused")

    @rule(index=st.integers(0, 7), normal=st.integers(0, 2), long=st.integers(0, 1))
    def reload_capacity(self, index, normal, long):
        spec = self.pool._resources[self.providers[index].key].spec
        self.pool.update_capacity(replace(spec, capacity_normal=normal, capacity_long=long))

    @rule(node=st.sampled_from(NODES), normal=st.integers(0, 2), present=st.booleans())
    def loose_adapter(self, node, normal, present):
        specs = [ProviderSpec(node, f"{LOOSE}-implicit", LOOSE, "echo", normal, 0, implicit=True)] if present else []
        self.pool.set_implicit(node, specs)

    @rule(seconds=st.sampled_from((1, 5, 20)))
    def time_passes(self, seconds):
        self.clock.advance(seconds)

    @invariant()
    def counts_agree(self):
        pool = self.pool
        for queue in pool._queues.values():
            for klass in CLASSES:
                for panic in (False, True):
                    expected = scanned(pool, queue, klass, panic)
                    answer = pool._has_candidate(queue, queue.members, klass, panic)
                    assert answer == expected, (queue.name, klass, panic, answer, expected)
                    # The filtered path (a copy of the members) scans them.
                    assert pool._has_candidate(queue, tuple(m for m in queue.members), klass, panic) == expected
                # The choice made with the counts is the one a scan makes
                # (whether there is one; which one where no member is
                # listed twice: the index ranks such a member by its last
                # place, the scan by its first).
                best = pool._best(queue, queue.members, klass)
                filtered = pool._best(queue, tuple(m for m in queue.members), klass)
                keys = {m.key for m in queue.members}
                assert (best is None) == (filtered is None), (queue.name, klass, best, filtered)
                if len(keys) == len(queue.members):
                    assert (best and best[0]) is (filtered and filtered[0]), (queue.name, klass, best, filtered)
                index = queue.index(klass, pool._resources)
                assert index.candidates == sum(pool._resources[k].candidate(klass) for k in keys)
                assert index.panic_candidates == sum(pool._resources[k].panic_candidate(klass) for k in keys)


class CandidateCountTests(SynchronousTestCase):
    def test_counts_agree_with_scan(self):
        """
        At every step, whether a queue has a live (or panic) candidate
        for a class is answered by its counts as a scan of every member
        would answer it, and they count exactly the members that are.
        """
        run_state_machine_as_test(
            CandidateMachine, settings=settings(max_examples=200, stateful_step_count=60, deadline=None)
        )
