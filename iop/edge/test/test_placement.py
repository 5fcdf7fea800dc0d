"""
Placement order and leases for every kind of placement, on the in-memory
Edge: an explicit node (with or without a model group), the group's pool,
the single-node fallback; direct work counts in C{in_use} and queues.
"""

import copy
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from iop.edge.errors import ServiceError
from iop.edge.spec import RunSpec
from iop.protocols import messages
from iop.testing.edge import EDGE_YAML, EdgeHarness, Recorder


def spec(**kwargs):
    return RunSpec(messages=[{"role": "user", "content": "x"}], **kwargs)


class PlacementTests(SynchronousTestCase):
    def setUp(self):
        data: dict[str, Any] = copy.deepcopy(EDGE_YAML)
        data["model_groups"].append({"name": "only1", "providers": [{"node": "n1", "provider": "p1", "target": "o1"}]})
        self.edge = EdgeHarness(data)
        self.service = self.edge.service
        self.n1, self.pump1, _ = self.edge.register(token="tok-1")
        self.n2, self.pump2, _ = self.edge.register(token="tok-2")

    def submit(self, **kwargs):
        return self.service.submit(spec(**kwargs), Recorder().for_run)

    def in_use(self):
        return {
            (p["node"], p["id"]): p["in_use"]["normal"] for n in self.service.status()["nodes"] for p in n["providers"]
        }

    def finish(self, node, pump, run_id):
        node.wire.send(messages.run_event(run_id=run_id, seq=1, type="complete"))
        pump.flush()

    def test_explicit_node_with_group(self):
        """
        A model group and an explicit node: only the group's provider on
        that node is a candidate (with its target), even when another node
        of the group is less loaded.
        """
        run_id = self.successResultOf(self.submit(model="grp", node="n2"))
        self.edge.flush()
        (request,) = self.n2.of("run_request")
        self.assertEqual((request.run_id, request.target), (run_id, "t2"))
        waiting = self.submit(model="grp", node="n2")
        self.assertNoResult(waiting)
        self.assertEqual(self.n1.of("run_request"), [])

    def test_explicit_node_without_group_member(self):
        """
        An explicit node where the model group has no provider is a 404
        naming both.
        """
        failure = self.failureResultOf(self.submit(model="only1", node="n2"), ServiceError)
        self.assertEqual(failure.value.kind, "not_found")
        self.assertIn("only1", failure.value.message)
        self.assertIn("n2", failure.value.message)

    def test_direct_work_holds_a_lease(self):
        """
        Work sent to an adapter by name on a node takes a lease on that
        adapter's provider: it shows in C{in_use}, and pooled work then goes
        elsewhere instead of overfilling the back end.
        """
        run_id = self.successResultOf(self.submit(adapter="echo", node="n1"))
        self.assertEqual(self.in_use()[("n1", "p1")], 1)
        pooled = self.successResultOf(self.submit(model="grp"))
        dispatch = self.service.inflight.get(pooled)
        assert dispatch is not None
        self.assertEqual(dispatch.link.node_id, "n2")
        self.edge.flush()
        self.finish(self.n1, self.pump1, run_id)
        self.assertEqual(self.in_use()[("n1", "p1")], 0)

    def test_direct_work_queues_when_full(self):
        """
        Direct work on a full adapter waits in that adapter's queue and
        starts when the slot comes back; it is not sent to the Node early.
        """
        first = self.successResultOf(self.submit(adapter="echo", node="n1"))
        waiting = self.submit(adapter="echo", node="n1")
        self.assertNoResult(waiting)
        self.edge.flush()
        self.assertEqual(len(self.n1.of("run_request")), 1)
        self.finish(self.n1, self.pump1, first)
        second = self.successResultOf(waiting)
        self.edge.flush()
        self.assertEqual([r.run_id for r in self.n1.of("run_request")], [first, second])

    def test_direct_queue_times_out(self):
        """
        Direct work waits at most C{direct_queue_timeout_sec}, then fails as
        busy (429), like a model group's waiter.
        """
        self.successResultOf(self.submit(adapter="echo", node="n1"))
        waiting = self.submit(adapter="echo", node="n1")
        self.edge.advance(30)
        failure = self.failureResultOf(waiting, ServiceError)
        self.assertEqual((failure.value.kind, failure.value.code), ("busy", "queue_timeout"))

    def test_several_nodes_need_a_name(self):
        """
        An adapter name with several ready nodes and no node named is a 400.
        """
        failure = self.failureResultOf(self.submit(adapter="echo"), ServiceError)
        self.assertEqual(failure.value.kind, "invalid")

    def test_single_node_fallback_leases(self):
        """
        With one ready node, an adapter name alone places there, with a
        lease.
        """
        self.n2.transport.loseConnection()
        self.edge.flush()
        self.successResultOf(self.submit(adapter="echo"))
        self.assertEqual(self.in_use()[("n1", "p1")], 1)


class UnknownNameTests(SynchronousTestCase):
    """
    A name that is no model group: 404 when no node has such an adapter,
    however many nodes are ready; 503 when its nodes are not ready; 400
    only when several ready nodes have it.
    """

    def setUp(self):
        data: dict[str, Any] = copy.deepcopy(EDGE_YAML)
        data["nodes"][0]["adapters"].append({"name": "solo", "type": "echo", "max_concurrency": 1})
        self.edge = EdgeHarness(data)
        self.service = self.edge.service

    def refusal(self, name):
        failure = self.failureResultOf(self.service.submit(spec(adapter=name), Recorder().for_run), ServiceError)
        return failure.value.kind, failure.value.code

    def test_unknown_name_is_404(self):
        """
        Not an adapter of any configured node: 404 C{model_not_found} with
        no node, one or two ready.
        """
        self.assertEqual(self.refusal("nope"), ("not_found", "model_not_found"))
        self.edge.register(token="tok-1")
        self.assertEqual(self.refusal("nope"), ("not_found", "model_not_found"))
        self.edge.register(token="tok-2")
        self.assertEqual(self.refusal("nope"), ("not_found", "model_not_found"))

    def test_adapter_whose_nodes_are_offline(self):
        """
        An adapter only nodes that are not ready have: 503, also while
        another node is ready.
        """
        self.assertEqual(self.refusal("solo"), ("unavailable", "unavailable"))
        self.edge.register(token="tok-2")
        self.assertEqual(self.refusal("solo"), ("unavailable", "unavailable"))

    def test_ambiguous_only_on_several_nodes(self):
        """
        An adapter of two ready nodes is a 400; one only one of them has is
        placed there.
        """
        self.edge.register(token="tok-1")
        self.edge.register(token="tok-2")
        self.assertEqual(self.refusal("echo"), ("invalid", "model_not_found"))
        run_id = self.successResultOf(self.service.submit(spec(adapter="solo"), Recorder().for_run))
        dispatch = self.service.inflight.get(run_id)
        assert dispatch is not None
        self.assertEqual(dispatch.link.node_id, "n1")
