"""
Tests for caller keys as tenants: fair queueing, priorities and positions
in L{iop.edge.pool}, and token budgets in L{iop.edge.tenants}, on a
L{Clock}.
"""

from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from iop.edge.pool import (
    NORMAL,
    REPORT_INTERVAL_SEC,
    GroupMember,
    ModelGroupSpec,
    ProviderPool,
    ProviderSpec,
    QueueFull,
)
from iop.edge.tenants import DAY, BudgetExceeded, Tenant, Ticket, TokenBudgets, usage_tokens
from iop.run import CANCELLED, COMPLETE, ERROR


def make_pool(clock, slots=2, **group):
    pool = ProviderPool(
        clock,
        [ProviderSpec("n1", "p1", "a1", "echo", slots, 0)],
        [ModelGroupSpec("m", (GroupMember("n1", "p1", "t"),), **group)],
    )
    pool.node_ready("n1", 1)
    return pool


class Workload:
    """
    Tenants sending work to a pool on a clock: each request holds its
    lease for C{tokens / rate} seconds, then settles its ticket with the
    tokens it cost.
    """

    def __init__(self, pool, clock, rate=100.0):
        self.pool = pool
        self.clock = clock
        self.rate = rate
        self.served = {}
        self.waits = {}

    def submit(self, tenant, tokens, estimate=None, priority=None, provisional=None):
        ticket = Ticket(tenant, estimate if estimate is not None else tokens, priority, provisional=provisional)
        asked = self.clock.seconds()
        d = self.pool.acquire("m", NORMAL, ticket=ticket)

        def granted(lease):
            self.waits.setdefault(tenant.name, []).append(self.clock.seconds() - asked)

            def done():
                ticket.settle(tokens)
                self.served[tenant.name] = self.served.get(tenant.name, 0) + tokens
                lease.release()

            self.clock.callLater(tokens / self.rate, done)
            return lease

        return d.addCallback(granted)


class FairQueueTests(SynchronousTestCase):
    def test_light_tenant_not_behind_heavy_backlog(self):
        """
        A tenant with one request waits for the next free slot, not behind
        the 30 requests another tenant queued before it.
        """
        clock = Clock()
        pool = make_pool(clock, queue_timeout_sec=1000)
        work = Workload(pool, clock)
        heavy, light = Tenant("heavy"), Tenant("light")
        for _ in range(32):
            work.submit(heavy, 100)
        clock.advance(0.5)
        work.submit(light, 100)
        clock.advance(0.5)  # the first two heavy requests end: one slot goes to light
        self.assertEqual(work.waits["light"], [0.5])

    def test_huge_estimate_does_not_put_others_behind(self):
        """
        A request whose caller asks for 10**18 tokens (and uses 100)
        counts in the fair share for its provisional tokens (its input and
        at most limits.token_estimate, 1024, as the Edge's intake sets
        them), not its estimate: once it ends, another tenant waits at
        most for about that many of its tokens, not for 10**18.
        """
        clock = Clock()
        pool = make_pool(clock, slots=1, queue_timeout_sec=100_000)
        work = Workload(pool, clock)
        heavy, light = Tenant("heavy"), Tenant("light")
        work.submit(heavy, 100, estimate=10**18, provisional=100 + 1024)
        for _ in range(40):
            work.submit(heavy, 100)
        work.submit(light, 100)
        for _ in range(13):  # the huge one ends, having cost 100; then a slot a second
            clock.advance(1)
        self.assertEqual(len(work.waits.get("light", [])), 1)
        self.assertLessEqual(work.waits["light"][0], 12)

    def test_lone_tenant_uses_every_slot(self):
        """
        The line is work-conserving: one tenant alone gets every free slot.
        """
        clock = Clock()
        pool = make_pool(clock, slots=3)
        work = Workload(pool, clock)
        for _ in range(6):
            work.submit(Tenant("only"), 100)
        self.assertEqual(work.waits["only"], [0, 0, 0])
        clock.advance(1)
        self.assertEqual(work.waits["only"], [0, 0, 0, 1, 1, 1])

    def test_priority_served_first_never_preempting(self):
        """
        Waiting work of a higher priority goes first; work already running
        keeps its slot.
        """
        clock = Clock()
        pool = make_pool(clock, slots=1)
        work = Workload(pool, clock)
        work.submit(Tenant("low"), 100)
        work.submit(Tenant("low"), 100)
        work.submit(Tenant("vip", priority=5), 100)
        self.assertEqual(len(work.waits["low"]), 1)  # running, not preempted
        clock.advance(1)
        self.assertEqual(work.waits["vip"], [1])
        self.assertEqual(len(work.waits["low"]), 1)
        clock.advance(1)
        self.assertEqual(work.waits["low"], [0, 2])

    def test_priority_header_lowers_only(self):
        """
        A ticket may ask for less than its tenant's priority: it then waits
        behind the tenant's other work of a higher class.
        """
        clock = Clock()
        pool = make_pool(clock, slots=1)
        work = Workload(pool, clock)
        tenant = Tenant("t", priority=3)
        work.submit(tenant, 100)
        work.submit(tenant, 100, priority=0)
        work.submit(tenant, 100)
        clock.advance(1)
        clock.advance(1)
        clock.advance(1)
        self.assertEqual(work.waits["t"], [0, 1, 2])
        self.assertEqual([e["priority"] for e in pool.queued()], [])

    def test_estimate_reconciled(self):
        """
        A tenant is charged its estimate when served and the difference
        when its ticket is settled, so an overestimate does not cost it.
        """
        clock = Clock()
        pool = make_pool(clock, slots=1)
        work = Workload(pool, clock)
        work.submit(Tenant("a"), 10, estimate=1000)
        line = pool._queues["m"].waiters
        self.assertEqual(line.counter("a"), 1000)
        clock.advance(1)
        self.assertEqual(line.counter("a"), 10)

    @settings(max_examples=20, deadline=None)
    @given(
        weights=st.lists(st.integers(1, 3), min_size=2, max_size=3),
        sizes=st.lists(st.integers(50, 300), min_size=1, max_size=5),
        slots=st.integers(1, 3),
        arrival=st.floats(0.1, 50.0),
    )
    def test_fair_share_and_bounded_wait(self, weights, sizes, slots, arrival):
        """
        Backlogged tenants are served tokens within 10% of their weights'
        shares; a tenant that arrives with one request waits no more than
        one service time per other active tenant.
        """
        clock = Clock()
        pool = make_pool(clock, slots=slots, queue_timeout_sec=10_000)
        work = Workload(pool, clock, rate=1000.0)
        tenants = [Tenant(f"t{i}", weight=float(w)) for i, w in enumerate(weights)]
        longest = max(sizes) / work.rate
        sent = {t.name: 0 for t in tenants}

        def top_up():
            for tenant in tenants:
                while sent[tenant.name] - len(work.waits.get(tenant.name, ())) < 4:
                    work.submit(tenant, sizes[sent[tenant.name] % len(sizes)])
                    sent[tenant.name] += 1

        top_up()
        newcomer = Tenant("newcomer")
        clock.callLater(arrival, work.submit, newcomer, sizes[0])
        for _ in range(5000):
            clock.advance(0.02)
            top_up()
        self.assertEqual(len(work.waits["newcomer"]), 1)
        self.assertLessEqual(work.waits["newcomer"][0], len(tenants) * longest + 1e-9)
        busy = {t.name: work.served.get(t.name, 0) for t in tenants}
        total = sum(busy.values())
        for tenant in tenants:
            fair = tenant.weight / sum(t.weight for t in tenants)
            self.assertLess(abs(busy[tenant.name] / total - fair), 0.1 * fair)


class PositionTests(SynchronousTestCase):
    def test_positions_reported_until_served(self):
        """
        A waiter whose caller watches hears its position and an ETA from
        the measured drain rate at once and every interval, and nothing
        once it is served.
        """
        clock = Clock()
        pool = make_pool(clock, slots=1, queue_timeout_sec=100)
        work = Workload(pool, clock, rate=50.0)  # 100 tokens: 2 s each
        work.submit(Tenant("a"), 100)
        clock.advance(2)  # one lease held for 2 s: the drain rate is known
        work.submit(Tenant("a"), 100)
        heard = []
        ticket = Ticket(Tenant("b"), 100, on_queued=lambda position, eta: heard.append((position, eta)))
        pool.acquire("m", NORMAL, ticket=ticket)
        self.assertEqual(heard, [])
        clock.advance(0)
        self.assertEqual(heard, [(1, 2000)])
        self.assertEqual(ticket.waiting_since, 2.0)
        clock.advance(REPORT_INTERVAL_SEC)
        self.assertEqual(len(heard), 2)
        clock.advance(1)  # served now
        clock.advance(REPORT_INTERVAL_SEC * 3)
        self.assertEqual(len(heard), 2)
        self.assertIsNone(ticket.waiting_since)

    def test_queued_view(self):
        """
        The queue view lists waiters in fair order with their tenant,
        position and time waited, filtered by tenant on request.
        """
        clock = Clock()
        pool = make_pool(clock, slots=1, queue_timeout_sec=100)
        work = Workload(pool, clock)
        work.submit(Tenant("a"), 100)
        work.submit(Tenant("a"), 100)
        work.submit(Tenant("a"), 100)
        clock.advance(0.25)
        work.submit(Tenant("b"), 100)
        view = pool.queued()
        self.assertEqual([(e["key"], e["position"]) for e in view], [("b", 1), ("a", 2), ("a", 3)])
        self.assertEqual(view[1]["waited_ms"], 250)
        self.assertEqual([e["position"] for e in pool.queued("b")], [1])

    def test_positions_charge_what_the_line_charges(self):
        """
        Positions play the line forward charging each grant what the pool
        charges it (a huge C{max_tokens} counts at most the provisional
        estimate; work placed again after a failure is not charged
        again), so they are the order work is really served in.
        """
        clock = Clock()
        pool = make_pool(clock, slots=1, queue_timeout_sec=100)
        held: list = []
        pool.acquire("m", NORMAL).addCallback(held.append)
        served: list = []

        def submit(name, cost, provisional=None, charged=False):
            ticket = Ticket(Tenant(name), cost, provisional=provisional)
            ticket.charged = charged
            pool.acquire("m", NORMAL, ticket=ticket).addCallback(lambda lease: served.append((name, lease)))

        submit("huge", 10**18, provisional=100)
        submit("huge", 10**18, provisional=100)
        submit("plain", 150)
        submit("plain", 150)
        submit("again", 10**6, charged=True)
        submit("again", 10**6, charged=True)
        told = [e["key"] for e in sorted(pool.queued(), key=lambda e: (e["position"], e["key"]))]
        self.assertEqual(sorted(e["position"] for e in pool.queued()), [1, 2, 3, 4, 5, 6])
        held[0].release()
        while len(served) < 6:
            served[-1][1].release()
        self.assertEqual([name for name, _ in served], told)

    def test_retry_after_from_drain_rate(self):
        """
        A full queue's refusal says when to come back: how long the line
        ahead takes at the measured hold time.
        """
        clock = Clock()
        pool = make_pool(clock, slots=1, max_queue=2, queue_timeout_sec=100)
        work = Workload(pool, clock, rate=50.0)  # 100 tokens: 2 s each
        for _ in range(3):
            work.submit(Tenant("a"), 100)
        clock.advance(2)
        work.submit(Tenant("a"), 100)
        failure = self.failureResultOf(pool.acquire("m", NORMAL, ticket=Ticket(Tenant("a"), 100)), QueueFull)
        self.assertEqual(failure.value.retry_after, 6)

    def test_full_queue_shared_not_held_by_one_key(self):
        """
        A key that filled the queue cannot lock the others out: a newcomer
        takes the place of that key's newest waiter, until both hold about
        as many (then a newcomer is refused, whoever it is).
        """
        clock = Clock()
        pool = make_pool(clock, slots=1, max_queue=4, queue_timeout_sec=100)
        heavy, light = Tenant("heavy"), Tenant("light")
        pool.acquire("m", NORMAL, ticket=Ticket(heavy, 100))
        waits = [pool.acquire("m", NORMAL, ticket=Ticket(heavy, 100)) for _ in range(4)]
        self.failureResultOf(pool.acquire("m", NORMAL, ticket=Ticket(heavy, 100)), QueueFull)
        light_waits = [pool.acquire("m", NORMAL, ticket=Ticket(light, 100)) for _ in range(2)]
        for d in light_waits:
            self.assertNoResult(d)
        turned_away = [self.failureResultOf(d, QueueFull) for d in waits[2:]]
        self.assertIn("went to a key with fewer", str(turned_away[0].value))
        for d in waits[:2]:
            self.assertNoResult(d)
        self.failureResultOf(pool.acquire("m", NORMAL, ticket=Ticket(light, 100)), QueueFull)
        self.assertEqual(pool.waiting(), 4)

    def test_edge_bound_shared_not_held_by_one_key(self):
        """
        The same across every queue, for the Edge's bound on waiting work
        (C{make_room}): the key waiting most gives up its newest place.
        """
        clock = Clock()
        pool = make_pool(clock, slots=1, queue_timeout_sec=100)
        heavy = Tenant("heavy")
        pool.acquire("m", NORMAL, ticket=Ticket(heavy, 100))
        waits = [pool.acquire("m", NORMAL, ticket=Ticket(heavy, 100)) for _ in range(3)]
        self.assertTrue(pool.make_room("light"))
        self.failureResultOf(waits[2], QueueFull)
        self.assertEqual(pool.waiting(), 2)
        self.assertFalse(pool.make_room("heavy"))
        pool.acquire("m", NORMAL, ticket=Ticket(Tenant("light"), 100))
        self.assertFalse(pool.make_room("light"))


class BudgetTests(SynchronousTestCase):
    def test_reserve_settle_refill(self):
        """
        A request reserves its estimate; while reserved the budget holds
        less; settling spends what was reported; the bucket refills over
        the minute; over budget is refused with when to retry.
        """
        clock = Clock()
        budgets = TokenBudgets(clock.seconds)
        tenant = Tenant("t", tokens_per_minute=600)
        first = Ticket(tenant, 400)
        budgets.reserve(first)
        refused = self.assertRaises(BudgetExceeded, budgets.reserve, Ticket(tenant, 300))
        self.assertEqual(refused.code, "token_budget_exceeded")
        self.assertEqual(refused.retry_after, 10)  # 100 tokens short at 10 per second
        first.settle(100)  # it cost less than reserved
        budgets.reserve(Ticket(tenant, 300))
        self.assertEqual(budgets.remaining(tenant), {"minute": 200})
        clock.advance(30)  # refilled to the full 600, of which 300 reserved
        self.assertEqual(budgets.remaining(tenant), {"minute": 300})

    def test_day_budget_and_unbudgeted(self):
        """
        The day budget holds alongside the minute's; a key without budgets
        is never refused; an estimate above a whole budget reserves the
        whole budget rather than never fitting.
        """
        clock = Clock()
        budgets = TokenBudgets(clock.seconds)
        tenant = Tenant("t", tokens_per_minute=10_000, tokens_per_day=1000)
        ticket = Ticket(tenant, 5000)
        budgets.reserve(ticket)
        ticket.settle(1000)
        refused = self.assertRaises(BudgetExceeded, budgets.reserve, Ticket(tenant, 10))
        self.assertIn("tokens_per_day 1000", str(refused))
        for _ in range(3):
            budgets.reserve(Ticket(Tenant("free"), 10**9))

    def test_reload_resizes_without_refilling(self):
        """
        A budget changed by a reload keeps what was spent and what is
        reserved: a smaller budget is at most full, a larger one is not
        handed out whole.
        """
        clock = Clock()
        budgets = TokenBudgets(clock.seconds)
        spent = Ticket(Tenant("t", tokens_per_minute=1000), 900)
        budgets.reserve(spent)
        spent.settle(900)
        held = Ticket(Tenant("t", tokens_per_minute=1000), 50)
        budgets.reserve(held)
        self.assertEqual(budgets.remaining(Tenant("t", tokens_per_minute=1000)), {"minute": 50})
        self.assertRaises(BudgetExceeded, budgets.reserve, Ticket(Tenant("t", tokens_per_minute=1200), 100))
        self.assertEqual(budgets.remaining(Tenant("t", tokens_per_minute=1200)), {"minute": 50})
        budgets.reserve(Ticket(Tenant("t", tokens_per_minute=60), 10))  # 100 left, at most 60
        self.assertEqual(budgets.remaining(Tenant("t", tokens_per_minute=60)), {"minute": 0})
        held.settle(0)
        self.assertEqual(budgets.remaining(Tenant("t", tokens_per_minute=60)), {"minute": 50})

    def test_unreported_answer_costs_its_estimate(self):
        """
        Work that got a slot and ended complete or cancelled with no usage
        report spends its estimate (a caller who did not ask for usage, or
        hung up before it, cannot spend a budget for free); a failed answer
        or work that never got a slot spends nothing; a report is what it
        says.
        """
        clock = Clock()
        budgets = TokenBudgets(clock.seconds)
        tenant = Tenant("t", tokens_per_minute=1000)

        def spent(usage, status, granted=True):
            ticket = Ticket(tenant, 100)
            budgets.reserve(ticket)
            ticket.charged = granted
            before = budgets.remaining(tenant)["minute"] + 100
            ticket.settle_usage(usage, status)
            return before - budgets.remaining(tenant)["minute"]

        self.assertEqual(spent(None, COMPLETE), 100)
        self.assertEqual(spent(None, CANCELLED), 100)
        self.assertEqual(spent({}, COMPLETE), 100)
        self.assertEqual(spent(None, ERROR), 0)
        self.assertEqual(spent(None, CANCELLED, granted=False), 0)
        self.assertEqual(spent({"input_tokens": 3, "output_tokens": 4}, COMPLETE), 7)
        self.assertEqual(spent({"input_tokens": 0, "output_tokens": 0}, COMPLETE), 0)
        # A caller's cap on the answer (max_tokens 10**18) is its word:
        # unreported, it costs what is left when the answer is counted at
        # most limits.token_estimate.
        roomy = Tenant("roomy", tokens_per_minute=100_000)
        capped = Ticket(roomy, 10**18, provisional=150)
        budgets.reserve(capped)
        capped.charged = True
        capped.settle_usage(None, COMPLETE)
        self.assertEqual(budgets.remaining(roomy), {"minute": 100_000 - 150})

    def test_clock_stepping_back_takes_nothing(self):
        """
        A wall clock set back (an NTP step, a resumed VM) refills nothing
        for that while and takes nothing either: the budget is not emptied
        into debt for the day the clock went back.
        """
        clock = Clock()
        clock.advance(DAY)
        budgets = TokenBudgets(clock.seconds)
        tenant = Tenant("t", tokens_per_minute=600, tokens_per_day=10_000)
        self.assertEqual(budgets.remaining(tenant), {"minute": 600, "day": 10_000})
        clock.advance(-DAY)
        self.assertEqual(budgets.remaining(tenant), {"minute": 600, "day": 10_000})
        budgets.reserve(Ticket(tenant, 100))

    def test_remaining_of_the_budgets_it_has(self):
        """
        What is left is told of the budgets the key has now: a budget a
        reload made smaller is at most its new size, one it removed is not
        told; a budget not used yet is full.
        """
        budgets = TokenBudgets(Clock().seconds)
        self.assertEqual(budgets.remaining(Tenant("t", tokens_per_day=500)), {"day": 500})
        budgets.reserve(Ticket(Tenant("t", tokens_per_minute=1000), 10))
        self.assertEqual(budgets.remaining(Tenant("t", tokens_per_minute=1000)), {"minute": 990})
        self.assertEqual(budgets.remaining(Tenant("t", tokens_per_minute=100)), {"minute": 90})
        self.assertEqual(budgets.remaining(Tenant("t")), {})

    def test_settle_once(self):
        """
        A ticket settles once: a second settle (a late duplicate end)
        changes nothing.
        """
        clock = Clock()
        budgets = TokenBudgets(clock.seconds)
        tenant = Tenant("t", tokens_per_minute=100)
        ticket = Ticket(tenant, 50)
        budgets.reserve(ticket)
        ticket.settle(50)
        ticket.settle(50)
        self.assertEqual(budgets.remaining(tenant), {"minute": 50})

    def test_usage_tokens(self):
        """
        A usage report counts input plus output; no report counts nothing.
        """
        self.assertEqual(usage_tokens({"input_tokens": 3, "output_tokens": 4, "reasoning_tokens": 2}), 7)
        self.assertEqual(usage_tokens(None), 0)
