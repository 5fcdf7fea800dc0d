"""
Tests for L{iop.edge.fairline}: priority classes, weighted fair share of
tokens across tenants, FIFO within a tenant, and positions.
"""

from dataclasses import dataclass, field
from itertools import count

from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from iop.edge.fairline import FairLine

_seq = count()


@dataclass(eq=False)
class W:
    tenant: str
    priority: int = 0
    weight: float = 1.0
    cost: int = 100
    seq: int = field(default_factory=lambda: next(_seq))
    kind: str = "x"


@dataclass(eq=False)
class Charged:
    """
    A waiter whose grant may not be recorded at all (C{charge} C{None}).
    """

    tenant: str
    priority: int = 0
    weight: float = 1.0
    charge: int | None = 100
    seq: int = field(default_factory=lambda: next(_seq))

    @property
    def cost(self) -> int | None:
        return self.charge


def charged_waiters(tenants, top_priority, weights, most):
    """
    Waiters as C{(tenant, priority, charge, weight)}: a charge of C{None}
    is work whose grant is not recorded (placed again, or settled).
    """
    return st.lists(
        st.tuples(
            st.sampled_from(tenants),
            st.integers(0, top_priority),
            st.one_of(st.none(), st.integers(0, 300)),
            st.sampled_from(weights),
        ),
        max_size=most,
    )


def charged_line(waiters) -> FairLine[Charged]:
    """
    A line of L{Charged} waiters drawn by L{charged_waiters}.
    """
    line: FairLine[Charged] = FairLine()
    for tenant, priority, charge, weight in waiters:
        line.add(Charged(tenant, priority=priority, charge=charge, weight=weight))
    return line


def serve(line, settle=True):
    """
    Serve the first waiter of the line's order, charging its cost; with
    C{settle}, its work also ends at once having cost its estimate.
    """
    waiter = next(line.order())
    line.remove(waiter)
    line.grant(waiter.tenant, waiter.weight, waiter.cost)
    if settle:
        line.settle(waiter.tenant, waiter.weight, waiter.cost, waiter.cost)
    return waiter


class FairLineTests(SynchronousTestCase):
    def test_fifo_for_one_tenant(self):
        """
        A lone tenant is served in arrival order: fairness only orders
        tenants against each other.
        """
        line: FairLine[W] = FairLine()
        waiters = [W("a") for _ in range(4)]
        for w in waiters:
            line.add(w)
        self.assertEqual([serve(line) for _ in range(4)], waiters)
        self.assertEqual(len(line), 0)

    def test_tenants_alternate(self):
        """
        Two tenants of equal weight with requests of equal cost take turns,
        however many the first one queued before the second came.
        """
        line: FairLine[W] = FairLine()
        for _ in range(5):
            line.add(W("heavy"))
        for _ in range(2):
            line.add(W("light"))
        self.assertEqual([serve(line).tenant for _ in range(5)], ["heavy", "light", "heavy", "light", "heavy"])

    def test_weights(self):
        """
        A tenant of weight 3 is served three requests for each one of a
        tenant of weight 1.
        """
        line: FairLine[W] = FairLine()
        for _ in range(8):
            line.add(W("big", weight=3.0))
            line.add(W("small", weight=1.0))
        served = [serve(line).tenant for _ in range(8)]
        self.assertEqual(served.count("big"), 6)
        self.assertEqual(served.count("small"), 2)

    def test_tokens_not_requests(self):
        """
        Shares are in tokens: a tenant whose requests cost 4 times as much
        gets a quarter as many of them served.
        """
        line: FairLine[W] = FairLine()
        for _ in range(10):
            line.add(W("costly", cost=400))
        for _ in range(10):
            line.add(W("cheap", cost=100))
        served = [serve(line).tenant for _ in range(10)]
        self.assertEqual(served.count("costly"), 2)
        self.assertEqual(served.count("cheap"), 8)

    def test_priority_first(self):
        """
        A higher class is served before any lower one, whatever the
        counters say.
        """
        line: FairLine[W] = FairLine()
        line.grant("vip", 1.0, 10_000)
        low = W("low", priority=0)
        high = W("vip", priority=5)
        line.add(low)
        line.add(high)
        self.assertIs(serve(line), high)
        self.assertIs(serve(line), low)

    def test_newcomer_cannot_bank_credit(self):
        """
        A tenant that was idle while another was served is lifted to the
        waiting tenants' lowest counter when it comes: it is served next
        (it was served least recently), but then takes turns instead of
        being owed everything it missed.
        """
        line: FairLine[W] = FairLine()
        for _ in range(10):
            line.add(W("heavy"))
        for _ in range(6):
            serve(line)
        for _ in range(4):
            line.add(W("late"))
        self.assertEqual(line.counter("late"), line.counter("heavy"))
        self.assertEqual([serve(line).tenant for _ in range(4)], ["late", "heavy", "late", "heavy"])

    def test_lift_within_its_class(self):
        """
        The lift that keeps a returning tenant from banking credit counts
        the tenants waiting in its own class: a backlog of another class
        (never served while this one is busy) does not hold the counter
        down, and a tenant that keeps a waiter parked in a low class is
        lifted all the same when it comes back to the busy one.
        """
        line: FairLine[W] = FairLine()
        line.add(W("batch", priority=-1))
        line.add(W("late", priority=-5))
        for _ in range(10):
            line.add(W("heavy"))
        for _ in range(6):
            serve(line)
        for _ in range(4):
            line.add(W("late"))
        line.add(W("fresh"))
        self.assertEqual(line.counter("late"), line.counter("heavy"))
        self.assertEqual(line.counter("fresh"), line.counter("heavy"))
        served = [serve(line).tenant for _ in range(6)]
        self.assertEqual(served, ["late", "fresh", "heavy", "late", "heavy", "late"])

    def test_refund(self):
        """
        Running work counts at its estimate; once settled, at what it
        cost (less: a refund), exactly, whatever the estimate's size.
        """
        line: FairLine[W] = FairLine()
        line.grant("a", 2.0, 1000)
        line.grant("a", 2.0, 10**18)
        self.assertEqual(line.counter("a"), 500.0 + 10**18 / 2.0)
        line.settle("a", 2.0, 10**18, 200)
        self.assertEqual(line.counter("a"), 600.0)
        line.settle("a", 2.0, 1000, 600)
        self.assertEqual(line.counter("a"), 400.0)

    def test_remove_anywhere(self):
        """
        A waiter that leaves from the middle is gone from the order and
        the count; empty tenants and classes leave no trace.
        """
        line: FairLine[W] = FairLine()
        a1, a2, b1 = W("a"), W("a", priority=1), W("b")
        for w in (a1, a2, b1):
            line.add(w)
        line.remove(a2)
        self.assertNotIn(a2, line)
        self.assertEqual(list(line.order()), [a1, b1])
        self.assertEqual(len(line), 2)
        self.assertEqual(sorted(line, key=lambda w: w.seq), [a1, b1])

    def test_positions_follow_the_order(self):
        """
        Positions play the order forward: 1 is served next, and each
        position is the place the waiter would be served in.
        """
        line: FairLine[W] = FairLine()
        waiters = [W("a"), W("a"), W("a"), W("b"), W("c", priority=1)]
        for w in waiters:
            line.add(w)
        positions = line.positions()
        expected = []
        while len(line):
            expected.append(serve(line))
        self.assertEqual(sorted(positions, key=positions.__getitem__), expected)
        self.assertEqual(sorted(positions.values()), [1, 2, 3, 4, 5])


class FirstProperties(SynchronousTestCase):
    @settings(max_examples=150, deadline=None)
    @given(
        steps=st.lists(
            st.tuples(
                st.sampled_from(["add", "add", "add", "serve", "leave"]),
                st.sampled_from("abc"),
                st.integers(0, 2),
                st.sampled_from("xyz"),
                st.integers(0, 300),
            ),
            max_size=60,
        ),
        usable=st.sets(st.sampled_from("xyz")),
    )
    def test_first_is_the_first_usable_of_the_order(self, steps, usable):
        """
        L{FairLine.first} picks what walking L{FairLine.order} for the
        first waiter of a usable kind would, however the line was filled,
        served and left, and whichever kinds can be served.
        """
        line: FairLine[W] = FairLine(lambda w: w.kind)
        for action, tenant, priority, kind, cost in steps:
            if action == "add":
                line.add(W(tenant, priority=priority, cost=cost, kind=kind))
            elif action == "serve" and len(line):
                serve(line, settle=cost % 2 == 0)
            elif action == "leave" and len(line):
                line.remove(sorted(line, key=lambda w: w.seq)[cost % len(line)])
            walked = next((w for w in line.order() if w.kind in usable), None)
            self.assertIs(line.first(lambda k: k in usable), walked)

    @settings(max_examples=150, deadline=None)
    @given(waiters=charged_waiters("abcd", 3, [1.0, 2.0, 3.0], 40), served=st.integers(0, 10))
    def test_positions_of_one_tenant(self, waiters, served):
        """
        A tenant's positions are those it has in the whole line's, whatever
        the classes, costs and weights, and whoever was served before.
        """
        line = charged_line(waiters)
        for _ in range(min(served, len(line))):
            waiter = next(line.order())
            line.remove(waiter)
            line.grant(waiter.tenant, waiter.weight, waiter.charge or 0)
        everyone = line.positions()
        for tenant in "abcd":
            mine = {w: p for w, p in everyone.items() if w.tenant == tenant}
            self.assertEqual(line.positions(tenant), mine)

    @settings(max_examples=150, deadline=None)
    @given(waiters=charged_waiters("abc", 1, [1.0, 3.0], 30), served=st.integers(0, 6))
    def test_positions_are_the_serving_order(self, waiters, served):
        """
        Positions are the order the line serves in when each grant charges
        what the waiter says it will (nothing recorded for C{None}), with
        zero costs, weights and classes mixed.
        """
        line = charged_line(waiters)

        def serve_charged() -> Charged:
            waiter = next(line.order())
            line.remove(waiter)
            if waiter.charge is not None:
                line.grant(waiter.tenant, waiter.weight, waiter.charge)
            return waiter

        for _ in range(min(served, len(line))):
            serve_charged()
        positions = line.positions()
        order = [serve_charged() for _ in range(len(line))]
        self.assertEqual(sorted(positions, key=positions.__getitem__), order)

    def test_first_asks_once_per_kind(self):
        """
        Whether a kind can be served is asked once for all its waiters.
        """
        line: FairLine[W] = FairLine(lambda w: w.kind)
        for i in range(300):
            line.add(W(f"t{i % 3}", kind="xy"[i % 2]))
        asked: list[object] = []

        def usable(kind: object) -> bool:
            asked.append(kind)
            return False

        self.assertIsNone(line.first(usable))
        self.assertEqual(sorted(asked), ["x", "y"])


class FairShareProperties(SynchronousTestCase):
    @settings(max_examples=40, deadline=None)
    @given(
        weights=st.lists(st.integers(1, 4), min_size=2, max_size=4),
        costs=st.lists(st.integers(50, 500), min_size=1, max_size=6),
    )
    def test_shares_follow_weights(self, weights, costs):
        """
        Tenants that all stay backlogged are served tokens in proportion to
        their weights, whatever their requests cost: each within two of
        the costliest requests of its share of the total (a fair queue
        lags by whole requests: a small share served a few large ones is
        off by more than 10% over a short run, and that is no unfairness).
        """
        line: FairLine[W] = FairLine()
        tenants = [f"t{i}" for i in range(len(weights))]
        served = dict.fromkeys(tenants, 0)
        backlog = dict.fromkeys(tenants, 0)
        turn = count()

        def top_up():
            for tenant, weight in zip(tenants, weights, strict=True):
                while backlog[tenant] < 3:
                    line.add(W(tenant, weight=float(weight), cost=costs[next(turn) % len(costs)]))
                    backlog[tenant] += 1

        top_up()
        for _ in range(60 * len(tenants)):
            waiter = serve(line)
            served[waiter.tenant] += waiter.cost
            backlog[waiter.tenant] -= 1
            top_up()
        total = sum(served.values())
        for tenant, weight in zip(tenants, weights, strict=True):
            fair = total * weight / sum(weights)
            self.assertLessEqual(
                abs(served[tenant] - fair), 2 * max(costs), f"{tenant}: {served[tenant]} against {fair:.0f}"
            )
