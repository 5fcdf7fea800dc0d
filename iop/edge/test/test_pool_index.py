"""
The pool's load-ordered placement index (L{iop.edge.pool._LoadIndex})
against the naive choice it replaces — a scan of every member for the
least loaded one with room, ties to the first listed — under random
leases, returns, Nodes going ready, draining and offline, and ejections.
"""

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from iop.edge.pool import CLASSES, GroupMember, HealthPolicy, ModelGroupSpec, ProviderPool, ProviderSpec

NODES = [f"n{i}" for i in range(6)]


def naive(pool, queue, klass):
    best = None
    for member in queue.members:
        resource = pool._resources[member.key]
        if resource.room(klass) > 0 and (best is None or resource.load(klass) < best.load(klass)):
            best = resource
    return best


class NodeLifecycle(RuleBasedStateMachine):
    """
    Rules for machines over a pool (C{self.pool}) whose providers are on
    L{NODES}: a Node going ready (a new generation), offline or draining.
    """

    pool: ProviderPool
    generation = 0

    @rule(node=st.sampled_from(NODES))
    def ready(self, node):
        self.generation += 1
        self.pool.node_ready(node, self.generation)

    @rule(node=st.sampled_from(NODES))
    def offline(self, node):
        # Offline already: generation 0 was never live, so this is stale.
        self.pool.node_disconnected(node, self.pool._by_node[node][0].generation or 0)

    @rule(node=st.sampled_from(NODES))
    def draining(self, node):
        self.pool.node_draining(node, self.pool._by_node[node][0].generation or 0)


class IndexMachine(NodeLifecycle):
    @initialize(capacities=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 2)), min_size=12, max_size=12))
    def set_up(self, capacities):
        providers = [
            ProviderSpec(NODES[i % len(NODES)], f"p{i}", "a", "echo", normal, long)
            for i, (normal, long) in enumerate(capacities)
        ]
        members = tuple(GroupMember(p.node_id, p.provider_id, "") for p in providers)
        self.clock = Clock()
        self.pool = ProviderPool(self.clock, providers, [ModelGroupSpec("g", members)], health=HealthPolicy(1, 5, 5))
        self.queue = self.pool._queues["g"]
        self.leases = []
        self.generation = 0
        for node in NODES:
            self.ready(node)

    @rule(klass=st.sampled_from(CLASSES))
    def lease(self, klass):
        d = self.pool.acquire("g", klass)
        d.addCallback(self.leases.append)
        d.addErrback(lambda failure: None)
        # Waiters left behind are cancelled, to keep the queue out of it.
        if not d.called:
            d.cancel()

    @rule(data=st.data())
    def release(self, data):
        if self.leases:
            self.leases.pop(data.draw(st.integers(0, len(self.leases) - 1))).release()

    @rule(data=st.data())
    def fail_one(self, data):
        if self.leases:
            self.leases[data.draw(st.integers(0, len(self.leases) - 1))].report("provider_unreachable", "refused")

    @rule()
    def time_passes(self):
        self.clock.advance(5)

    @invariant()
    def index_agrees(self):
        for klass in CLASSES:
            choice = self.queue.index(klass, self.pool._resources).best()
            expected = naive(self.pool, self.queue, klass)
            assert (choice[0] if choice else None) is expected, (klass, choice, expected)


class IndexTests(SynchronousTestCase):
    def test_index_agrees_with_naive_choice(self):
        """
        At every step, the index picks the same provider as a scan of every
        member would (least loaded with room, ties to the first listed).
        """
        run_state_machine_as_test(
            IndexMachine, settings=settings(max_examples=150, stateful_step_count=50, deadline=None)
        )
