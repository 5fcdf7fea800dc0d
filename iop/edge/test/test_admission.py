"""
Work taken in bounded batches per reactor turn (L{iop.edge.admission}),
in order, and shed with 503 C{overloaded} beyond the bound of waiting
work.
"""

import copy
from typing import Any

from twisted.internet.defer import CancelledError
from twisted.trial.unittest import SynchronousTestCase

from iop.edge.admission import ADMIT_PER_TURN
from iop.edge.errors import ServiceError
from iop.edge.spec import RunSpec
from iop.edge.tenants import Tenant, Ticket
from iop.testing.edge import EDGE_YAML, EdgeHarness, Recorder

BURST = 3 * ADMIT_PER_TURN + 5


def roomy(max_waiting=None):
    data: dict[str, Any] = copy.deepcopy(EDGE_YAML)
    data["nodes"][0]["adapters"][0]["max_concurrency"] = 1000
    data["nodes"][0]["providers"][0]["capacity"]["normal"] = 1000
    if max_waiting is not None:
        data["limits"] = {"max_waiting": max_waiting}
    return data


def spec(i):
    return RunSpec(messages=[{"role": "user", "content": str(i)}], adapter="echo", node="n1")


class AdmissionTests(SynchronousTestCase):
    def test_burst_placed_in_batches_in_order(self):
        """
        A burst submitted in one reactor turn: only the first batch is
        placed in that turn; the rest follow, a batch per turn, and the
        Node receives every request in the order submitted.
        """
        edge = EdgeHarness(roomy())
        node, pump, _ = edge.register()
        results = [edge.service.submit(spec(i), Recorder().for_run) for i in range(BURST)]
        placed = [d for d in results if d.called]
        self.assertEqual(len(placed), ADMIT_PER_TURN)
        for _ in range(10):
            edge.clock.advance(0)
        self.assertTrue(all(d.called for d in results))
        pump.flush()
        texts = [r.messages[0].content for r in node.of("run_request")]
        self.assertEqual(texts, [str(i) for i in range(BURST)])

    def test_cancel_while_in_backlog(self):
        """
        Work cancelled while it waits in the backlog (its caller left) is
        never placed.
        """
        edge = EdgeHarness(roomy())
        node, pump, _ = edge.register()
        results = [edge.service.submit(spec(i), Recorder().for_run) for i in range(ADMIT_PER_TURN + 1)]
        results[-1].cancel()
        self.failureResultOf(results[-1], CancelledError)
        edge.clock.advance(0)
        pump.flush()
        self.assertEqual(len(node.of("run_request")), ADMIT_PER_TURN)

    def full(self):
        """
        An Edge at limits.max_waiting (2): one slot taken, two requests of
        the anonymous key waiting.
        """
        data = roomy(max_waiting=2)
        data["nodes"][0]["providers"][0]["capacity"]["normal"] = 1
        edge = EdgeHarness(data)
        edge.register()
        self.successResultOf(edge.service.submit(spec(0), Recorder().for_run))
        return edge, [edge.service.submit(spec(i), Recorder().for_run) for i in (1, 2)]

    def test_overloaded(self):
        """
        Beyond limits.max_waiting requests waiting at once, a new one is
        refused at once with 503 C{overloaded}.
        """
        edge, waiting = self.full()
        for d in waiting:
            self.assertNoResult(d)
        failure = self.failureResultOf(edge.service.submit(spec(3), Recorder().for_run), ServiceError)
        self.assertEqual((failure.value.kind, failure.value.code), ("unavailable", "overloaded"))
        for d in waiting:
            d.cancel()
            self.failureResultOf(d)

    def test_overloaded_by_one_key_others_still_wait(self):
        """
        A key that holds every place under limits.max_waiting cannot lock
        another key out: the newcomer takes that key's newest place, which
        is refused as a full queue.
        """
        edge, waiting = self.full()
        light = spec(3)
        light.caller = "light"
        newcomer = edge.service.submit(light, Recorder().for_run)
        self.assertNoResult(newcomer)
        self.assertNoResult(waiting[0])
        failure = self.failureResultOf(waiting[1], ServiceError)
        self.assertEqual(failure.value.code, "queue_full")
        for d in (waiting[0], newcomer):
            d.cancel()
            self.failureResultOf(d)

    def test_no_place_given_up_for_a_request_placement_refuses(self):
        """
        A newcomer that placement refuses (an adapter no node has) takes
        no other key's place: a key cannot turn others' work away with
        requests that never wait.
        """
        edge, waiting = self.full()
        nowhere = spec(3)
        nowhere.caller, nowhere.adapter, nowhere.node = "light", "nope", None
        failure = self.failureResultOf(edge.service.submit(nowhere, Recorder().for_run), ServiceError)
        self.assertEqual(failure.value.code, "model_not_found")
        for d in waiting:
            self.assertNoResult(d)
            d.cancel()
            self.failureResultOf(d)

    def test_no_place_given_up_for_a_request_served_at_once(self):
        """
        A newcomer that finds room at once (on another node) takes no other
        key's place: the bound is on waiting work, and it never waits.
        """
        edge, waiting = self.full()
        edge.register("tok-2")
        elsewhere = spec(3)
        elsewhere.caller, elsewhere.node = "light", "n2"
        self.successResultOf(edge.service.submit(elsewhere, Recorder().for_run))
        for d in waiting:
            self.assertNoResult(d)
            d.cancel()
            self.failureResultOf(d)

    def test_over_the_bound_in_the_backlog_takes_a_place_at_once(self):
        """
        A newcomer that will wait in the admission backlog (this turn's
        placements are spent) is waiting work already: it takes the
        crowding key's newest place as it arrives, so the backlog never
        holds more than the bound allows.
        """
        edge, waiting = self.full()
        edge.service.intake.admission._placed_this_turn = ADMIT_PER_TURN
        light = spec(3)
        light.caller = "light"
        newcomer = edge.service.submit(light, Recorder().for_run)
        self.assertNoResult(newcomer)
        self.assertEqual(self.failureResultOf(waiting[1], ServiceError).value.code, "queue_full")
        for d in (waiting[0], newcomer):
            d.cancel()
            self.failureResultOf(d)

    def test_no_place_given_up_for_a_refused_request(self):
        """
        A newcomer refused for itself (over its key's budget, a background
        run that cannot be one) takes no other key's place.
        """
        edge, waiting = self.full()
        thrifty = spec(3)
        thrifty.tenant = Tenant("light", tokens_per_minute=100)
        edge.service.budgets.reserve(Ticket(thrifty.tenant, 100))  # the budget is all held
        failure = self.failureResultOf(edge.service.submit(thrifty, Recorder().for_run), ServiceError)
        self.assertEqual(failure.value.code, "token_budget_exceeded")
        background = spec(4)
        background.caller, background.background, background.runs = "light", True, False
        failure = self.failureResultOf(edge.service.submit(background, Recorder().for_run), ServiceError)
        self.assertEqual(failure.value.code, "invalid_background")
        for d in waiting:
            self.assertNoResult(d)
            d.cancel()
            self.failureResultOf(d)
