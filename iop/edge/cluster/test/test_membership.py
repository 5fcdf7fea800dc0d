"""
This Edge as a member of the cluster (L{iop.edge.cluster.membership}):
what it tells etcd is put again until it holds (its draining state, a
claim whose answer was lost), its view keeps the Edges that went while
its watch was down, a leave during a join stays a leave, an unexpected
error stops none of its loops, and a watch that stays open but delivers
nothing is found by the periodic re-list.
"""

import json
from collections.abc import Sequence
from typing import Any

from twisted.internet import defer
from twisted.internet.defer import Deferred
from twisted.logger import capturedLogs, formatEvent

from iop.edge.cluster.etcd import EtcdUnavailable, KeyValue
from iop.edge.cluster.membership import LOST, OK, RETRY_SEC, Membership
from iop.edge.cluster.test.support import ClusterCase
from iop.protocols import messages
from iop.testing.edge import EdgeHarness
from iop.testing.etcd import MemoryEtcdClient


class Held:
    """
    An etcd client whose calls named in C{held} wait until L{answer}: sent
    then (C{applied=False}), or applied at once and only their answer held.
    """

    def __init__(self, client: MemoryEtcdClient, *held: str, applied: bool = False) -> None:
        self.client = client
        self.held = set(held)
        self.applied = applied
        self.waiting: list[tuple[Deferred[Any], Any]] = []

    def __getattr__(self, name: str) -> Any:
        call = getattr(self.client, name)
        if name not in self.held:
            return call

        def held(*args: Any, **kwargs: Any) -> Deferred[Any]:
            d: Deferred[Any] = Deferred()
            answer = call(*args, **kwargs) if self.applied else None
            self.waiting.append((d, answer if self.applied else lambda: call(*args, **kwargs)))
            return d

        return held

    def answer(self) -> None:
        d, answer = self.waiting.pop(0)
        (answer if self.applied else answer()).chainDeferred(d)


def fail_once(client: Any, name: str, error: Exception, raises: bool = False) -> None:
    """
    The next call of C{client.name} fails with C{error} (or raises it).
    """
    real = getattr(client, name)

    def once(*args: Any, **kwargs: Any) -> Deferred[Any]:
        setattr(client, name, real)
        if raises:
            raise error
        return defer.fail(error)

    setattr(client, name, once)


class DrainingStateTests(ClusterCase):
    def test_drained_while_the_session_was_lost(self):
        """
        An Edge that starts draining while etcd does not answer (for less
        than its TTL) says so once the session is back.
        """
        membership = self.membership(self.a)
        self.client(self.a).cut()
        self.advance(1.5)
        self.assertEqual(membership.session, LOST)
        membership.start_draining()
        self.assertEqual(self.state_in_etcd("edge-a"), "up")
        self.client(self.a).heal()
        self.advance(1.5)
        self.assertEqual(membership.session, OK)
        self.assertEqual(self.state_in_etcd("edge-a"), "draining")
        self.assertEqual(self.states_seen(self.b)["edge-a"], "draining")

    def test_failed_put_is_tried_again(self):
        """
        A put of the draining state that fails (the session still ok) is
        tried again at the next keep-alive, until it lands.
        """
        membership = self.membership(self.a)
        client = self.client(self.a)
        client.reachable = False
        membership.start_draining()
        client.reachable = True
        self.assertEqual(membership.session, OK)
        self.assertEqual(self.state_in_etcd("edge-a"), "up")
        self.advance(1.5)
        self.assertEqual(self.state_in_etcd("edge-a"), "draining")
        puts = client.calls.count("put")
        self.advance(5)
        self.assertEqual(client.calls.count("put"), puts, "put again once it landed, and only then")

    def test_drained_while_joining(self):
        """
        Draining while the join's put is on its way: the join puts "up",
        then the draining state goes at once.
        """
        held = Held(self.etcd.client(), "put")
        c = self.edge("edge-c", etcd=held)
        membership = self.membership(c)
        membership.start_draining()
        held.answer()
        self.assertEqual(membership.session, OK)
        self.assertEqual(self.state_in_etcd("edge-c"), "up")
        self.assertEqual(len(held.waiting), 1, "the draining state is put")
        held.answer()
        self.assertEqual(self.state_in_etcd("edge-c"), "draining")


class ViewTests(ClusterCase):
    def test_left_while_the_watch_was_down(self):
        """
        An Edge that left while this Edge's watch was down is shown down
        once the view is listed again, and the Edge is told.
        """
        membership = self.membership(self.a)
        told: list[str] = []
        membership.on_gone = told.append
        self.client(self.a).cut()
        self.successResultOf(self.membership(self.b).leave())
        self.client(self.a).heal()
        self.advance(2)
        self.assertEqual(membership.session, OK)
        self.assertEqual(self.states_seen(self.a), {"edge-a": "up", "edge-b": "down"})
        self.assertEqual(told, ["edge-b"])

    def test_left_and_back_while_the_watch_was_down(self):
        """
        An Edge whose lease ended and which joined again under a new one
        while the watch was down is up, and the Edge is told it went.
        """
        membership = self.membership(self.a)
        told: list[str] = []
        membership.on_gone = told.append
        self.client(self.a).cut()
        b = self.membership(self.b)
        old = b.lease
        assert old is not None
        self.etcd.expire(old)
        self.advance(1.5)
        self.assertNotEqual(b.lease, old)
        self.assertIn("/iop/edges/edge-b", self.etcd.data)
        self.client(self.a).heal()
        self.advance(1.5)
        self.assertEqual(self.states_seen(self.a), {"edge-a": "up", "edge-b": "up"})
        self.assertEqual(told, ["edge-b"])

    def restart_b(self) -> Membership:
        """
        Edge B starts again (same id) while its old process, cut off from
        etcd, still has its lease: the new one puts C{edges/edge-b} over
        the old key under a new lease (the key's create revision stays).
        """
        old = self.membership(self.b)
        self.client(self.b).cut()
        new = Membership(old.spec, self.etcd.client(), self.clock)
        new.startService()
        self.assertEqual(new.session, OK)
        self.assertNotEqual(new.lease, old.lease)
        self.assertIn(old.lease, self.etcd.leases, "the old lease has not expired yet")
        return new

    def test_restarted_before_its_lease_expired(self):
        """
        An Edge that joins again under a new lease before its old one
        expired (its key put over, never deleted) is told gone, once: what
        was forwarded to its old process is not waited for.
        """
        told: list[str] = []
        self.membership(self.a).on_gone = told.append
        new = self.restart_b()
        self.assertEqual(told, ["edge-b"])
        self.advance(5)
        self.assertEqual(told, ["edge-b"])
        self.assertEqual(self.states_seen(self.a)["edge-b"], "up")
        self.successResultOf(new.leave())

    def test_restarted_while_the_watch_was_down(self):
        """
        The same restart while this Edge's watch was down is found when it
        lists the view again.
        """
        membership = self.membership(self.a)
        told: list[str] = []
        membership.on_gone = told.append
        self.client(self.a).cut()
        new = self.restart_b()
        self.client(self.a).heal()
        self.advance(1.5)
        self.assertEqual(membership.session, OK)
        self.assertEqual(told, ["edge-b"])
        self.successResultOf(new.leave())

    def test_gone_edge_told(self):
        """
        The watch seeing another Edge's key go tells the Edge, once.
        """
        told: list[str] = []
        self.membership(self.a).on_gone = told.append
        self.client(self.b).cut()
        self.advance(4)
        self.assertEqual(told, ["edge-b"])
        self.assertEqual(self.states_seen(self.a)["edge-b"], "down")


class LeaveWhileJoiningTests(ClusterCase):
    def test_leave_while_the_lease_is_asked(self):
        """
        A lease granted after the Edge left is revoked, and nothing is put
        under it nor kept alive.
        """
        held = Held(self.etcd.client(), "grant")
        c = self.edge("edge-c", etcd=held)
        membership = self.membership(c)
        self.successResultOf(membership.leave())
        leases = set(self.etcd.leases)
        held.answer()
        self.advance(10)
        self.assertNotIn("/iop/edges/edge-c", self.etcd.data)
        self.assertEqual(set(self.etcd.leases), leases)
        self.assertFalse(membership._keeper.running)
        self.assertIsNone(membership.lease)

    def test_leave_while_the_key_is_put(self):
        """
        Leaving while the answer of the join's put is on its way revokes
        the lease (and the key with it); the answer neither joins (no
        keep-alive, no "ok" session) nor tries again.
        """
        held = Held(self.etcd.client(), "put", applied=True)
        c = self.edge("edge-c", etcd=held)
        membership = self.membership(c)
        self.successResultOf(membership.leave())
        held.answer()
        self.advance(10)
        self.assertNotIn("/iop/edges/edge-c", self.etcd.data)
        self.assertFalse(membership._keeper.running)
        self.assertNotEqual(membership.session, OK)
        self.assertEqual(held.waiting, [])

    def test_leave_while_listing(self):
        """
        Leaving while the view is listed starts no watch.
        """
        held = Held(self.etcd.client(), "range")
        c = self.edge("edge-c", etcd=held)
        membership = self.membership(c)
        self.successResultOf(membership.leave())
        held.answer()
        self.assertIsNone(membership._watch)
        self.assertEqual(held.client.watches, [])


class LostClaimAnswerTests(ClusterCase):
    def lost_claim(self):
        """
        A's claim of n1 lands at etcd, and its answer is lost: the Node is
        refused (retryable) and the key is A's, under its lease.
        """
        self.client(self.a).lose_answers("create")
        node, _, _ = self.a.register("tok-1", ready=False)
        self.assertEqual(node.of("register_response")[0].code, messages.DUPLICATE_CONNECTION)
        kv = self.etcd.data["/iop/nodes/n1"]
        membership = self.membership(self.a)
        self.assertEqual(kv.lease, membership.lease)
        self.assertEqual(membership.claims, {})
        return kv

    def test_key_of_no_connection_deleted(self):
        """
        Once etcd answers again, the key is read back and deleted: the
        Node may register anywhere.
        """
        self.lost_claim()
        self.advance(1.5)
        self.assertNotIn("/iop/nodes/n1", self.etcd.data)
        self.assertEqual(self.membership(self.a).unsure, {})
        node, _, _ = self.b.register("tok-1")
        self.assertTrue(node.of("node_ready_response")[0].ready)

    def test_claimed_again_meanwhile(self):
        """
        A claim of the node that won meanwhile keeps the key (its own now).
        """
        self.lost_claim()
        client = self.client(self.a)
        real_range = client.range
        ranges: list[tuple[Deferred[Any], str]] = []

        def held_range(key: str, prefix: bool = False) -> Deferred[tuple[int, list[KeyValue]]]:
            if prefix:
                return real_range(key, prefix)
            d: Deferred[tuple[int, list[KeyValue]]] = Deferred()
            ranges.append((d, key))
            return d

        client.range = held_range  # type: ignore[method-assign]
        self.advance(1.5)
        self.assertEqual(self.membership(self.a).session, OK)
        [(d, key)] = ranges
        node, _, _ = self.a.register("tok-1")
        self.assertTrue(node.of("node_ready_response")[0].ready)
        claimed = self.etcd.data["/iop/nodes/n1"]
        real_range(key).chainDeferred(d)
        self.advance(1.5)
        self.assertEqual(self.etcd.data["/iop/nodes/n1"], claimed)
        self.assertEqual(self.membership(self.a).claims, {"n1": claimed.mod_revision})
        self.assertFalse(node.lost)

    def test_not_created(self):
        """
        A claim that did not land leaves nothing to undo: the key another
        Edge took meanwhile is left alone.
        """
        client = self.client(self.a)
        client.reachable = False
        self.a.register("tok-1", ready=False)
        client.reachable = True
        self.assertEqual(set(self.membership(self.a).unsure), {"n1"})
        node, _, _ = self.b.register("tok-1")
        self.advance(1.5)
        self.assertEqual(self.membership(self.a).unsure, {})
        self.assertEqual(json.loads(self.etcd.data["/iop/nodes/n1"].value)["edge"], "edge-b")
        self.assertFalse(node.lost)


class UnexpectedErrorTests(ClusterCase):
    def test_keep_alive_goes_on(self):
        """
        An unexpected error in a keep-alive is logged; the loop goes on
        (after RETRY_SEC) and the lease lives.
        """
        membership = self.membership(self.a)
        lease = membership.lease
        fail_once(self.client(self.a), "keepalive", RuntimeError("a bug"))
        self.advance(10)
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)
        self.assertTrue(membership._keeper.running)
        self.assertEqual((membership.lease, membership.voids, membership.session), (lease, 0, OK))
        self.assertEqual(self.etcd.data["/iop/edges/edge-a"].lease, lease)

    def test_load_goes_on(self):
        """
        An unexpected error in looking at the load is logged; the load is
        published after it.
        """
        membership = self.membership(self.a)
        load = membership.load
        assert load is not None
        calls: list[int] = []

        def broken_once() -> dict[str, Any] | None:
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("a bug")
            return load()

        membership.load = broken_once
        self.a.register("tok-1")
        self.advance(3)
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)
        self.assertIn("/iop/load/edge-a", self.etcd.data)
        self.assertIn("grp", json.loads(self.etcd.data["/iop/load/edge-a"].value)["groups"])

    def test_join_tried_again(self):
        """
        A join that fails unexpectedly (an answer it cannot read) is
        tried again after RETRY_SEC.
        """
        client = self.etcd.client()
        fail_once(client, "grant", KeyError("ID"))
        c = self.edge("edge-c", etcd=client)
        membership = self.membership(c)
        self.assertEqual(membership.session, LOST)
        self.assertEqual(len(self.flushLoggedErrors(KeyError)), 1)
        self.clock.advance(RETRY_SEC)
        self.assertEqual(membership.session, OK)
        self.assertIn("/iop/edges/edge-c", self.etcd.data)

    def test_watch_tried_again(self):
        """
        A listing whose handling fails unexpectedly is tried again after
        RETRY_SEC, and the view is built.
        """
        client = self.etcd.client()
        fail_once(client, "watch", RuntimeError("a bug"), raises=True)
        c = self.edge("edge-c", etcd=client)
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)
        self.clock.advance(RETRY_SEC)
        membership = self.membership(c)
        self.assertIsNotNone(membership._watch)
        self.assertEqual(set(membership.edges), {"edge-a", "edge-b", "edge-c"})

    def test_void_with_a_failing_callback(self):
        """
        An Edge whose lease expired joins again even when closing its Node
        links fails.
        """
        membership = self.membership(self.a)

        def broken(reason: str) -> None:
            raise RuntimeError("a bug")

        membership.on_void = broken
        self.client(self.a).cut()
        self.advance(4)
        self.client(self.a).heal()
        self.advance(2)
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)
        self.assertEqual((membership.voids, membership.session), (1, OK))
        self.assertIn("/iop/edges/edge-a", self.etcd.data)


class RelistTests(ClusterCase):
    """
    The view listed again every C{relist_sec} (30 by default).
    """

    def silence(self, harness: EdgeHarness) -> None:
        """
        The watch of C{harness} stays open and delivers nothing more (a
        stream stuck somewhere between etcd and the Edge).
        """
        for watch in self.client(harness).watches:
            self.etcd.watches.remove(watch)

    def silent_warnings(self, events: Sequence[dict[str, Any]]) -> list[str]:
        return [line for line in map(formatEvent, events) if "seems silent" in line]

    def test_silent_watch_found(self) -> None:
        """
        What a silent watch missed is found at the next re-list, as after a
        watch restart: an Edge that left is down (and told), one that
        joined is up, a changed state and a new claim are seen. Once the
        watch has shown nothing for a whole C{relist_sec} and a listing
        still finds a change, a warning says it seems silent and it is
        restarted: what comes next is seen at once.
        """
        d = self.edge("edge-d")
        membership = self.membership(self.a)
        told: list[str] = []
        membership.on_gone = told.append
        self.advance(0.5)
        self.silence(self.a)
        self.successResultOf(self.membership(d).leave())
        self.b.register("tok-1")
        self.membership(self.b).start_draining()
        c = self.edge("edge-c")
        self.advance(29)
        self.assertEqual(self.states_seen(self.a), {"edge-a": "up", "edge-b": "up", "edge-d": "up"})
        self.assertEqual((told, membership.owner("n1")), ([], None))
        self.advance(1)
        self.assertEqual(
            self.states_seen(self.a), {"edge-a": "up", "edge-b": "draining", "edge-c": "up", "edge-d": "down"}
        )
        self.assertEqual((told, membership.owner("n1")), (["edge-d"], "edge-b"))
        self.assertIn("edge-b", membership.loads)
        self.successResultOf(self.membership(c).leave())
        with capturedLogs() as events:
            self.advance(30)
        self.assertEqual(self.states_seen(self.a)["edge-c"], "down")
        self.assertEqual(told, ["edge-d", "edge-c"])
        [warning] = self.silent_warnings(events)
        self.assertIn("Edge edge-a", warning)
        self.advance(RETRY_SEC)
        self.edge("edge-e")
        self.assertEqual(self.states_seen(self.a)["edge-e"], "up")

    def test_live_watch_left_alone(self) -> None:
        """
        With a watch that delivers, the re-list reads the prefix and
        changes nothing: no warning, the same watch.
        """
        membership = self.membership(self.a)
        watch = membership._watch
        ranges = self.client(self.a).calls.count("range")
        self.b.register("tok-1")
        with capturedLogs() as events:
            self.advance(30)
        self.assertEqual(self.client(self.a).calls.count("range"), ranges + 1)
        self.assertEqual(self.silent_warnings(events), [])
        self.assertIs(membership._watch, watch)

    def test_event_on_its_way(self) -> None:
        """
        A listing that shows a change the watch has not delivered yet, from
        a watch that delivered something since the last re-list (it is
        alive: the event is on its way), is reconciled with no warning and
        the same watch.
        """
        membership = self.membership(self.a)
        watch = membership._watch
        self.advance(0.5)
        self.b.register("tok-1")
        self.assertEqual(membership.owner("n1"), "edge-b")
        self.silence(self.a)
        self.membership(self.b).start_draining()
        with capturedLogs() as events:
            self.advance(29.5)
        self.assertEqual(self.states_seen(self.a)["edge-b"], "draining")
        self.assertEqual(self.silent_warnings(events), [])
        self.assertIs(membership._watch, watch)

    def held_edge(self) -> tuple[EdgeHarness, Held]:
        """
        Edge C, whose listings wait for L{Held.answer} (each read when
        asked), its first one answered: its watch is live.
        """
        held = Held(self.etcd.client(), "range", applied=True)
        c = self.edge("edge-c", etcd=held)
        held.answer()
        self.assertIsNotNone(self.membership(c)._watch)
        return c, held

    def test_one_at_a_time(self) -> None:
        """
        A re-list still waiting for etcd is not overlapped: the ticks that
        come meanwhile are skipped, and the next one after it lists again.
        """
        c, held = self.held_edge()
        self.advance(120)
        self.assertEqual(len(held.waiting), 1)
        held.answer()
        self.advance(30)
        self.assertEqual(len(held.waiting), 1)

    def test_older_listing_dropped(self) -> None:
        """
        A listing the watch has shown newer events than (they came while it
        was on its way) is dropped: an Edge that joined meanwhile stays up,
        nobody is told it went, and the watch is not restarted.
        """
        c, held = self.held_edge()
        membership = self.membership(c)
        told: list[str] = []
        membership.on_gone = told.append
        self.advance(30)
        self.assertEqual(len(held.waiting), 1)
        self.edge("edge-e")
        watch = membership._watch
        with capturedLogs() as events:
            held.answer()
        self.assertEqual(self.states_seen(c)["edge-e"], "up")
        self.assertEqual((told, self.silent_warnings(events)), ([], []))
        self.assertIs(membership._watch, watch)

    def test_errors_stop_it_not(self) -> None:
        """
        A re-list that fails (unexpectedly: logged; etcd not answering)
        leaves the loop going: the next one finds what a silent watch
        missed.
        """
        client = self.client(self.a)
        fail_once(client, "range", RuntimeError("a bug"))
        self.advance(30)
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)
        fail_once(client, "range", EtcdUnavailable("etcd is not reachable"))
        self.advance(30)
        self.silence(self.a)
        self.successResultOf(self.membership(self.b).leave())
        self.assertEqual(self.states_seen(self.a)["edge-b"], "up")
        self.advance(30)
        self.assertEqual(self.states_seen(self.a)["edge-b"], "down")

    def test_stops_with_the_service(self) -> None:
        """
        Leaving stops the re-list; one on its way then changes nothing.
        """
        c, held = self.held_edge()
        membership = self.membership(c)
        self.advance(30)
        self.successResultOf(membership.stopService())
        self.assertFalse(membership._relister.running)
        with capturedLogs() as events:
            held.answer()
        self.advance(60)
        self.assertEqual((held.waiting, held.client.watches), ([], []))
        self.assertIsNone(membership._watch)
        self.assertEqual(self.silent_warnings(events), [])
