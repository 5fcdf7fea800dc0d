"""
Stopping the Edge drains it: queued waiters, runs in flight, pending
commands and Node links each end exactly once, with a terminal, and every
lease comes back. Also the Node's own draining notice and the wire
version check at registration.
"""

from twisted.trial.unittest import SynchronousTestCase

from iop.edge.errors import ServiceError
from iop.edge.spec import RunSpec
from iop.protocols import messages
from iop.protocols.wire import WIRE_VERSION
from iop.run import CANCELLED, SHUTTING_DOWN
from iop.testing.edge import EdgeHarness, Recorder


def pooled():
    return RunSpec(messages=[{"role": "user", "content": "x"}], model="grp")


class OneNodeTestCase(SynchronousTestCase):
    """
    An Edge with node C{n1} ready.
    """

    def setUp(self):
        self.edge = EdgeHarness()
        self.service = self.edge.service
        self.node, self.pump, _ = self.edge.register(token="tok-1")


class EdgeDrainTests(OneNodeTestCase):
    def start_run(self):
        recorder = Recorder()
        run_id = self.successResultOf(self.service.submit(pooled(), recorder.for_run))
        self.pump.flush()
        return run_id, recorder

    def reply(self, run_id, *types):
        for seq, kind in enumerate(types, 1):
            self.node.connection.send(messages.run_event(run_id=run_id, seq=seq, type=kind))
        self.pump.flush()

    def test_queued_waiter_gets_shutting_down(self):
        """
        A request waiting in the queue when the drain begins fails at once
        with C{shutting_down} (a 503 kind), not at its queue timeout.
        """
        self.start_run()
        waiting = self.service.submit(pooled(), Recorder().for_run)
        self.assertNoResult(waiting)
        self.service.stopService()
        failure = self.failureResultOf(waiting, ServiceError)
        self.assertEqual((failure.value.kind, failure.value.code), ("unavailable", SHUTTING_DOWN))

    def test_new_work_refused(self):
        """
        Once draining, submit refuses new work with C{shutting_down} and
        takes no lease; node commands are refused the same way.
        """
        self.service.stopService()
        failure = self.failureResultOf(self.service.submit(pooled(), Recorder().for_run), ServiceError)
        self.assertEqual(failure.value.code, SHUTTING_DOWN)
        self.assertEqual(self.service.pool.active_leases(), [])
        failure = self.failureResultOf(self.service.command("n1", "capabilities"), ServiceError)
        self.assertEqual(failure.value.code, SHUTTING_DOWN)

    def test_inflight_run_finishes_within_grace(self):
        """
        A run in flight keeps streaming during the drain; the stop waits for
        its terminal, then closes the Node link. The Node was told the Edge
        is draining.
        """
        run_id, recorder = self.start_run()
        stopped = self.service.stopService()
        self.pump.flush()
        (notice,) = self.node.of("edge_draining")
        self.assertEqual(notice.grace_sec, 30.0)
        self.assertNoResult(stopped)
        self.reply(run_id, "start", "delta", "complete")
        self.successResultOf(stopped)
        self.assertEqual(recorder.types(), ["start", "delta", "complete"])
        self.assertEqual(self.service.pool.active_leases(), [])
        self.assertTrue(self.node.lost)

    def test_grace_ends_run_with_terminal(self):
        """
        A run that outlives C{shutdown_grace_sec} ends with one C{cancelled}
        terminal (code C{shutting_down}) to its caller, the Node is asked to
        cancel it, its lease returns, and the stop completes.
        """
        run_id, recorder = self.start_run()
        stopped = self.service.stopService()
        self.edge.advance(29)
        self.assertNoResult(stopped)
        self.edge.advance(1)
        self.successResultOf(stopped)
        self.assertEqual(recorder.types(), [CANCELLED])
        self.assertEqual(recorder.events[0].error.code, SHUTTING_DOWN)
        self.assertEqual([c.run_id for c in self.node.of("cancel_request")], [run_id])
        self.assertEqual(self.service.pool.active_leases(), [])
        self.assertEqual(len(self.service.inflight), 0)
        self.reply(run_id, "cancelled")
        self.assertEqual(recorder.types(), [CANCELLED])

    def test_hurry_ends_at_once(self):
        """
        A second stop signal (L{EdgeService.hurry}) ends the drain without
        waiting for the grace.
        """
        _, recorder = self.start_run()
        stopped = self.service.stopService()
        self.assertNoResult(stopped)
        self.service.hurry()
        self.pump.flush()
        self.successResultOf(stopped)
        self.assertEqual(recorder.types(), [CANCELLED])

    def test_pending_command_fails_when_drain_ends(self):
        """
        A node command still unanswered when the drain ends fails once with
        C{shutting_down}; an answer arriving later is ignored.
        """
        pending = self.service.command("n1", "capabilities")
        self.pump.flush()
        stopped = self.service.stopService()
        self.assertNoResult(pending)
        self.service.hurry()
        self.successResultOf(stopped)
        failure = self.failureResultOf(pending, ServiceError)
        self.assertEqual(failure.value.code, SHUTTING_DOWN)
        request = self.node.of("node_command_request")[0]
        self.node.connection.send(messages.command_result(request.request_id, ""))
        self.pump.flush()

    def test_stop_twice_same_deferred_result(self):
        """
        Stopping an Edge that is already draining changes nothing: the same
        drain goes on.
        """
        self.start_run()
        first = self.service.stopService()
        second = self.service.stopService()
        self.assertIs(first, second)

    def test_version_one_node_not_told_draining(self):
        """
        A Node that predates wire version 2 is never sent C{EdgeDraining}
        (it would not know the message).
        """
        old, _, _ = self.edge.register(token="tok-2", wire_version=0)
        self.service.stopService()
        self.edge.flush()
        self.assertEqual(old.of("edge_draining"), [])
        self.assertEqual(len(self.node.of("edge_draining")), 1)


class NodeDrainingTests(OneNodeTestCase):
    def test_draining_node_takes_no_new_leases(self):
        """
        After C{NodeDraining}, the node's providers show C{draining} and
        take no new lease: with no other provider live, a pooled request
        fails at once as unavailable instead of being sent there.
        """
        self.node.connection.send(messages.node_draining(grace_sec=30, reason="stopping"))
        self.pump.flush()
        status = self.service.status()
        self.assertEqual(status["nodes"][0]["providers"][0]["status"], "draining")
        self.assertTrue(status["nodes"][0]["draining"])
        failure = self.failureResultOf(self.service.submit(pooled(), Recorder().for_run), ServiceError)
        self.assertEqual(failure.value.kind, "unavailable")
        self.assertEqual(self.node.of("run_request"), [])

    def test_draining_node_work_still_ends(self):
        """
        Work already on a draining node keeps its lease until its terminal,
        which returns it as usual.
        """
        recorder = Recorder()
        run_id = self.successResultOf(self.service.submit(pooled(), recorder.for_run))
        self.node.connection.send(messages.node_draining(grace_sec=30))
        self.pump.flush()
        self.assertEqual(len(self.service.pool.active_leases()), 1)
        self.node.connection.send(messages.run_event(run_id=run_id, seq=1, type="complete"))
        self.pump.flush()
        self.assertEqual(recorder.types(), ["complete"])
        self.assertEqual(self.service.pool.active_leases(), [])

    def test_waiter_moves_to_other_provider(self):
        """
        A waiter whose group still has another live provider keeps waiting
        and is served there.
        """
        other, other_pump, _ = self.edge.register(token="tok-2")
        first = self.successResultOf(self.service.submit(pooled(), Recorder().for_run))
        second = self.successResultOf(self.service.submit(pooled(), Recorder().for_run))
        waiting = self.service.submit(pooled(), Recorder().for_run)
        self.node.connection.send(messages.node_draining(grace_sec=30))
        self.pump.flush()
        self.assertNoResult(waiting)
        dispatch = self.service.inflight.get(first)
        assert dispatch is not None
        on_n2 = first if dispatch.link.node_id == "n2" else second
        other.connection.send(messages.run_event(run_id=on_n2, seq=1, type="complete"))
        other_pump.flush()
        run_id = self.successResultOf(waiting)
        dispatch = self.service.inflight.get(run_id)
        assert dispatch is not None
        self.assertEqual(dispatch.link.node_id, "n2")


class WireVersionTests(SynchronousTestCase):
    def test_incompatible_version_refused(self):
        """
        A Node declaring a wire version this Edge does not serve is refused
        with C{INCOMPATIBLE_VERSION}, a reason naming both versions, and
        the connection is closed.
        """
        edge = EdgeHarness()
        node, _, _ = edge.register(ready=False, wire_version=99)
        (response,) = node.of("register_response")
        self.assertFalse(response.accepted)
        self.assertEqual(response.code, messages.INCOMPATIBLE_VERSION)
        self.assertIn("wire version 99", response.reason)
        self.assertTrue(node.lost)

    def test_absent_version_is_one(self):
        """
        A Node that sends no version (it predates versioning) is served as
        version 1, and the answer carries the Edge's own version.
        """
        edge = EdgeHarness()
        node, _, _ = edge.register(ready=False, wire_version=0)
        (response,) = node.of("register_response")
        self.assertTrue(response.accepted)
        self.assertEqual(response.wire_version, WIRE_VERSION)
        owner = edge.service.registry.owner("n1")
        assert owner is not None
        self.assertEqual(owner.wire_version, 1)


class TakenBackDuringDrainTests(SynchronousTestCase):
    """
    A background run a Node reports while the Edge drains (the Node
    registered before the stop and got ready after it) is left to its
    Node like every other such run: neither waited for nor cancelled.
    """

    def test_left_to_its_node(self):
        """
        The run is not resumed here, takes no lease, and holds the drain
        up no longer than the work already in flight.
        """
        edge = EdgeHarness()
        other, other_pump, _ = edge.register(token="tok-2")
        recorder = Recorder()
        run_id = self.successResultOf(edge.service.submit(pooled(), recorder.for_run))
        edge.flush()
        node, pump, _ = edge.register(ready=False)
        stopped = edge.service.stopService()
        node.connection.send(messages.run_reconcile([messages.reconciled_run("run-x", "echo", "t1", "running", 3, "")]))
        node.connection.send(messages.ready_request(node_id="n1"))
        pump.flush()
        self.assertEqual(node.of("run_resume"), [])
        self.assertEqual(len(edge.service.pool.active_leases()), 1)  # (the run on n2)
        other.connection.send(messages.run_event(run_id=run_id, seq=1, type="complete"))
        other_pump.flush()
        self.successResultOf(stopped)
        self.assertEqual(node.of("cancel_request"), [])
        self.assertEqual(edge.service.pool.active_leases(), [])
        self.assertIsNone(edge.service.runs.get("run-x"))
