"""
Where a request goes (L{iop.edge.cluster.load}): what is on a node
already (its runs, their readers and cancels, its commands) goes to the
Edge that owns it while that Edge is up or draining; new work goes only
to an Edge that is up.
"""

from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from iop.edge.cluster.load import forward_target, group_owner, node_target
from iop.edge.cluster.test.support import ClusterCase
from iop.edge.spec import RunSpec
from iop.testing.edge import Recorder, edge_config


class View:
    edge_id = "edge-a"

    def __init__(self, state: str) -> None:
        self.edges: dict[str, dict[str, Any]] = {
            "edge-a": {"advertise": "http://a", "state": "up"},
            "edge-b": {"advertise": "http://b", "state": state},
        }
        self.loads: dict[str, dict[str, Any]] = {}

    def owner(self, node_id: str) -> str | None:
        return "edge-b" if node_id == "n1" else None


class Registry:
    def ready_link(self, node_id: str) -> None:
        return None


class TargetTests(SynchronousTestCase):
    def test_node_at_a_draining_edge(self) -> None:
        """
        A request about a node whose Edge drains goes there; new work for
        that node does not.
        """
        registry: Any = Registry()
        forward = node_target(View("draining"), registry, "n1")
        self.assertEqual((forward.edge_id, forward.url) if forward else None, ("edge-b", "http://b"))
        spec = RunSpec(messages=[{"role": "user", "content": "x"}], adapter="echo", node="n1")
        pool: Any = None
        self.assertIsNone(forward_target(View("draining"), registry, pool, spec))
        forward = forward_target(View("up"), registry, pool, spec)
        self.assertEqual(forward.edge_id if forward else None, "edge-b")

    def test_group_owner_up_only(self) -> None:
        """
        A group's nodes owned by a draining Edge send no new work there.
        """
        group = edge_config().model_groups[0]
        self.assertEqual(group_owner(View("up"), group), ("edge-b", "http://b"))
        self.assertIsNone(group_owner(View("draining"), group))

    def test_node_at_an_edge_down(self) -> None:
        """
        An owner whose state is neither up nor draining is no target.
        """
        registry: Any = Registry()
        self.assertIsNone(node_target(View("down"), registry, "n1"))


class DrainingOwnerTests(ClusterCase):
    def test_moved_run_read_and_cancelled_at_its_draining_owner(self) -> None:
        """
        A background run whose Node went from A to B is still B's while B
        drains: read there, cancelled there (not ended at A).
        """
        spec = RunSpec(messages=[{"role": "user", "content": "x"}], adapter="echo", node="n1", background=True)
        _, pump, edge_protocol = self.a.register("tok-1")
        run_id = self.successResultOf(self.a.service.submit(spec, Recorder().for_run))
        edge_protocol.transport.loseConnection()
        pump.flush()
        self.b.register("tok-1")
        self.cluster(self.b).start_draining()
        self.assertEqual(self.states_seen(self.a)["edge-b"], "draining")
        forward = self.a.service.history.held_elsewhere(run_id)
        self.assertEqual(forward.edge_id if forward is not None else None, "edge-b")
        self.assertFalse(self.a.service.cancel(run_id))
        record = self.a.service.runs.get(run_id)
        self.assertEqual(record.status if record is not None else None, "running")
