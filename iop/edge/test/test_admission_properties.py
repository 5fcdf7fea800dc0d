"""
The Edge's ledger against the Node's gate, under random interleavings:
pooled and direct work, releases, timeouts and cancels, over a config that
passed validation. Every lease the pool grants is also taken from a model
of the Node's capacity gate (one counter per adapter, limit
C{max_concurrency}); the gate must never refuse.
"""

import copy

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from iop.config import ConfigError, Section
from iop.edge.config import parse
from iop.edge.pool import NORMAL, ProviderPool

ADAPTERS = ("shared", "solo", "bare")


def edge_yaml(limits, capacities):
    """
    One node: C{shared} named by two providers, C{solo} by one, C{bare}
    by none (its implicit resource serves direct work); two model groups.
    """
    (a_normal, a_long), (b_normal, b_long), (c_normal, c_long) = capacities
    return {
        "listen": {"nodes": "tcp:0", "http": "tcp:0"},
        "nodes": [
            {
                "id": "n1",
                "token": "t",
                "adapters": [
                    {"name": name, "type": "echo", "max_concurrency": limit}
                    for name, limit in zip(ADAPTERS, limits, strict=True)
                ],
                "providers": [
                    {"id": "p1", "adapter": "shared", "capacity": {"normal": a_normal, "long": a_long}},
                    {"id": "p2", "adapter": "shared", "capacity": {"normal": b_normal, "long": b_long}},
                    {"id": "p3", "adapter": "solo", "capacity": {"normal": c_normal, "long": c_long}},
                ],
            }
        ],
        "model_groups": [
            {
                "name": "g1",
                "providers": [{"node": "n1", "provider": "p1"}, {"node": "n1", "provider": "p3"}],
                "queue_timeout_sec": 3,
                "long_threshold_chars": 10,
            },
            {"name": "g2", "providers": [{"node": "n1", "provider": "p2"}], "queue_timeout_sec": 2},
        ],
    }


class GateMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.pool = None
        self.held = []
        self.waiting = []

    @initialize(
        limits=st.tuples(*(st.integers(1, 3) for _ in ADAPTERS)),
        capacities=st.tuples(*(st.tuples(st.integers(0, 2), st.integers(0, 1)) for _ in range(3))),
    )
    def set_up(self, limits, capacities):
        try:
            config = parse(Section(copy.deepcopy(edge_yaml(limits, capacities)), "", "edge.yaml"))
        except ConfigError:
            # Refused at load: such a config never reaches the pool.
            self.pool = None
            return
        self.clock = Clock()
        self.limits = dict(zip(ADAPTERS, limits, strict=True))
        self.pool = ProviderPool(self.clock, config.providers(), config.model_groups, 4)
        self.pool.node_ready("n1", 1)
        self.gate = dict.fromkeys(ADAPTERS, 0)
        self.held = []
        self.waiting = []

    def granted(self, lease):
        # What the Node's gate does with the work the Edge admitted.
        assert self.gate[lease.adapter] < self.limits[lease.adapter], (lease, self.gate)
        self.gate[lease.adapter] += 1
        self.held.append(lease)
        return lease

    def track(self, d):
        d.addCallback(self.granted)
        d.addErrback(lambda f: None)  # timeouts, cancels, no candidate: nothing admitted
        self.waiting.append(d)

    @rule(group=st.sampled_from(["g1", "g2"]), chars=st.sampled_from([1, 50]))
    def pooled(self, group, chars):
        if self.pool is not None:
            self.track(self.pool.acquire(group, self.pool.classify(group, chars)))

    @rule(adapter=st.sampled_from(ADAPTERS))
    def direct(self, adapter):
        if self.pool is not None:
            self.track(self.pool.acquire_direct("n1", adapter, NORMAL))

    @rule(data=st.data())
    def release(self, data):
        if self.pool is not None and self.held:
            lease = self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))
            # The Node frees the gate slot before the terminal reaches the Edge.
            self.gate[lease.adapter] -= 1
            lease.release()

    @rule(data=st.data())
    def cancel(self, data):
        pending = [d for d in self.waiting if not d.called]
        if self.pool is not None and pending:
            pending[data.draw(st.integers(0, len(pending) - 1))].cancel()

    @rule(seconds=st.sampled_from([0.5, 1, 3]))
    def time_passes(self, seconds):
        if self.pool is not None:
            self.clock.advance(seconds)

    @invariant()
    def ledger_matches_gate(self):
        if self.pool is not None:
            counted: dict[str, int] = {}
            for lease in self.pool.active_leases():
                counted[lease.adapter] = counted.get(lease.adapter, 0) + 1
            assert counted == {a: n for a, n in self.gate.items() if n}, (counted, self.gate)


class GateTests(SynchronousTestCase):
    def test_gate_never_refuses_admitted_work(self):
        """
        Under any interleaving of pooled and direct work over a validated
        config, every lease the Edge grants fits the Node's gate, and the
        Edge's ledger and the gate count the same work.
        """
        run_state_machine_as_test(
            GateMachine, settings=settings(max_examples=150, stateful_step_count=40, deadline=None)
        )
