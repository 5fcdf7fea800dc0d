"""
The run book (L{iop.edge.runs}): records, the bounded log, followers that
replay then follow, and — property-based — that every reader gets each
event after its resume point exactly once, in order, whatever the
interleaving of new events, readers joining and leaving, and answers from
the Node's store.
"""

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.internet import defer
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from iop.edge import runs as runs_module
from iop.edge.bus import EventBus
from iop.edge.errors import ServiceError
from iop.edge.runs import RUN, TUNNEL, RunBook
from iop.edge.spec import RunSpec
from iop.run import COMPLETE, DELTA, ERROR, START, RunEventData, RunFailure, Usage
from iop.testing.edge import EdgeHarness, Recorder


def event(seq, last):
    if seq == 1:
        return RunEventData(START)
    if seq == last:
        return RunEventData(COMPLETE, usage=Usage(1, last - 2))
    return RunEventData(DELTA, text=f"w{seq} ")


class FakeNode:
    """
    A Node's store for one run: every event emitted so far (the Node
    stores each before the Edge sees it). Fetches are answered when the
    test says so, with what the store holds at that moment.
    """

    def __init__(self, run_id, last):
        self.run_id = run_id
        self.last = last
        self.stored = 0
        self.pending = []

    def fetch(self, run_id, node_id, after):
        d: defer.Deferred[tuple[str, dict[str, Any]]] = defer.Deferred()
        self.pending.append((after, d))
        return d

    def answer(self, index=0):
        after, d = self.pending.pop(index)
        events = []
        for seq in range(after + 1, self.stored + 1):
            e = event(seq, self.last)
            payload = {"seq": seq, "type": e.type}
            if e.text:
                payload["text"] = e.text
            events.append(payload)
        d.callback(("n1", {"run": {"run_id": self.run_id, "kind": RUN, "status": "running"}, "events": events}))


class Reader:
    def __init__(self, after):
        self.after = after
        self.seqs = []
        self.texts = []
        self.ended = 0
        self.follower = None
        self.failed = None

    def write(self, seq, payload):
        self.seqs.append(seq)
        self.texts.append(payload.get("text", ""))

    def end(self):
        self.ended += 1


class RunBookTests(SynchronousTestCase):
    def setUp(self):
        self.clock = Clock()
        self.bus = EventBus(self.clock)
        self.published: list[tuple[str, dict[str, Any]]] = []
        self.bus.subscribe(lambda topic, payload: self.published.append((topic, payload)), ["run", "tunnel"])
        self.book = RunBook(self.clock, self.bus, max_bytes=1024, max_age_sec=60, max_runs=2)

    def test_record_and_bus(self):
        """
        A run's record follows its events; the bus gets its start and
        terminal (with the labels the metrics need), not its deltas.
        """
        record = self.book.open("r1", RUN, node="n1", adapter="echo", model="m", provider="p", caller="alice")
        for seq in range(1, 5):
            self.book.event(record, event(seq, 4), seq)
        self.clock.advance(0)
        self.assertEqual(record.status, "complete")
        self.assertEqual(record.output(), "w2 w3 ")
        self.assertEqual([p["type"] for _, p in self.published], ["start", "complete"])
        terminal = self.published[-1][1]
        self.assertEqual(
            {k: terminal[k] for k in ("run_id", "node", "model_group", "provider", "key", "seq")},
            {"run_id": "r1", "node": "n1", "model_group": "m", "provider": "p", "key": "alice", "seq": 4},
        )

    def test_repeats_dropped_and_made_up_events_numbered(self):
        """
        An event at or below the last seq is a repeat and is dropped; one
        the Edge makes up takes the next number; nothing after a terminal.
        """
        record = self.book.open("r1", RUN)
        self.book.event(record, event(1, 9), 1)
        self.book.event(record, event(2, 9), 2)
        self.book.event(record, event(2, 9), 2)
        self.book.event(record, RunEventData(ERROR, error=RunFailure("node_disconnected", "gone")))
        self.book.event(record, event(3, 9), 3)
        self.assertEqual([seq for seq, _ in record.log], [1, 2, 3])
        self.assertEqual(record.error, {"code": "node_disconnected", "message": "gone"})

    def test_for_wire(self):
        """
        A record is found by the id its latest attempt has on the wire as
        well as by its own; an earlier attempt's id no longer leads to it
        once the next one opens, and nothing does once it is evicted.
        """
        record = self.book.open("r1", RUN, wire_id="r1-2")
        self.assertIs(self.book.for_wire("r1-2"), record)
        self.assertIs(self.book.for_wire("r1"), record)
        self.book.open("r1", RUN, wire_id="r1-3")
        self.assertIsNone(self.book.for_wire("r1-2"))
        self.assertIs(self.book.for_wire("r1-3"), record)
        self.book.event(record, RunEventData(COMPLETE))
        self.clock.advance(61)
        self.assertIsNone(self.book.for_wire("r1-3"))

    def test_log_bound_and_eviction(self):
        """
        The log keeps at most max_bytes (oldest events go); at most
        max_runs finished runs stay, and none past max_age_sec.
        """
        record = self.book.open("r1", RUN)
        for seq in range(1, 40):
            self.book.event(record, RunEventData(DELTA, text="x" * 100), seq)
        self.assertFalse(record.complete_log)
        self.assertLessEqual(record.log_bytes, 1024)
        self.assertEqual(record.log[-1][0], 39)
        self.assertEqual(record.first_seq, 40 - len(record.log))
        for run_id in ("a", "b", "c"):
            done = self.book.open(run_id, RUN, node="n1")
            self.book.event(done, RunEventData(COMPLETE))
        self.assertIsNone(self.book.get("a"))
        self.assertEqual(self.book.locate("a"), ("n1", "a"))
        self.assertIsNotNone(self.book.get("c"))
        self.clock.advance(61)
        self.assertIsNone(self.book.get("c"))
        self.assertIsNotNone(self.book.get("r1"))

    def test_follow_past_the_log_without_a_store(self):
        """
        With no Node store to ask (no C{fetch}), a reader resuming before
        the oldest event still in memory gets what the log still holds and
        follows on live.
        """
        record = self.book.open("r1", RUN)
        for seq in range(1, 40):
            self.book.event(record, RunEventData(DELTA, text="x" * 100), seq)
        written: list[int] = []
        follower = self.successResultOf(
            self.book.follow("r1", 0, lambda seq, payload: written.append(seq), lambda: None)
        )
        self.book.event(record, RunEventData(COMPLETE), 40)
        self.assertEqual(written, list(range(40 - len(record.log), 41)))
        self.assertTrue(follower.closed)

    def test_tunnel(self):
        """
        A tunnel publishes its start and its end with usage; it has no
        events to follow.
        """
        record = self.book.open("t1", TUNNEL, node="n1")
        self.book.started(record)
        self.book.tunnel_ended(record, "complete", {"input_tokens": 1, "output_tokens": 2})
        self.clock.advance(0)
        self.assertEqual([(t, p["type"]) for t, p in self.published], [("tunnel", "start"), ("tunnel", "end")])
        self.assertEqual(self.published[-1][1]["usage"], {"input_tokens": 1, "output_tokens": 2})
        failure = self.failureResultOf(self.book.follow("t1", 0, Reader(0).write, Reader(0).end), ServiceError)
        self.assertEqual(failure.value.code, "not_a_run")

    def test_unknown_without_fetch(self):
        """
        With no Node to ask, an unknown run is not found.
        """
        self.failureResultOf(self.book.follow("nope", 0, Reader(0).write, Reader(0).end), ServiceError)

    def test_fetch_failure_falls_back_to_memory(self):
        """
        When the Node cannot fill a gap, the reader gets what the Edge
        still has (and the rest live) rather than nothing.
        """
        node = FakeNode("r1", 50)
        self.book.fetch = lambda *a: defer.fail(ServiceError("unavailable", "node n1 is not connected"))
        record = self.book.open("r1", RUN, node="n1")
        for seq in range(1, 40):
            self.book.event(record, event(seq, node.last), seq)
        reader = Reader(0)
        self.successResultOf(self.book.follow("r1", 0, reader.write, reader.end))
        self.assertEqual(reader.seqs, [seq for seq, _ in record.log])
        self.book.event(record, event(40, node.last), 40)
        self.assertEqual(reader.seqs[-1], 40)

    def test_store_history_then_what_only_the_edge_holds(self):
        """
        After the Node's store answers, the events only the Edge's log
        holds follow its history: a terminal the Edge made up itself (a
        cancel the Node never confirmed), and events past what a lagging
        store has.
        """
        node = FakeNode("r1", 50)
        node.stored = 10
        self.book.fetch = node.fetch
        record = self.book.open("r1", RUN, node="n1")
        for seq in range(1, 21):
            self.book.event(record, RunEventData(DELTA, text="x" * 100), seq)
        self.book.event(record, RunEventData(ERROR, error=RunFailure("cancelled", "not confirmed")))
        self.assertGreater(record.first_seq, 11)
        reader = Reader(0)
        self.book.follow("r1", 0, reader.write, reader.end)
        node.answer()
        self.assertEqual(reader.seqs[:10], list(range(1, 11)))
        self.assertEqual(reader.seqs[-1], 21)
        self.assertEqual(reader.seqs[10:], [seq for seq, _ in record.log])
        self.assertEqual(reader.ended, 1)


class ReplayThenFollowProperties(SynchronousTestCase):
    """
    Every reader gets exactly the events after its resume point, in seq
    order, once each, and ends once, after the terminal (which one resumed
    at it gets again).
    """

    @settings(max_examples=300, deadline=None)
    @given(
        st.integers(min_value=2, max_value=40),
        st.sampled_from([1024, 2048, 100_000]),
        st.integers(min_value=0, max_value=2),
        st.lists(st.tuples(st.sampled_from(["emit", "join", "answer", "leave"]), st.integers(0, 1000)), max_size=80),
    )
    def test_interleavings(self, last, max_bytes, max_runs, steps):
        clock = Clock()
        node = FakeNode("r1", last)
        book = RunBook(clock, EventBus(clock), node.fetch, max_bytes=max_bytes, max_age_sec=1e9, max_runs=max_runs)
        record = book.open("r1", RUN, node="n1")
        readers, left = [], []
        emitted = 0

        def emit():
            nonlocal emitted
            emitted += 1
            node.stored = emitted
            # A long text, so that small logs drop events.
            e = event(emitted, last)
            if e.type == DELTA:
                e = RunEventData(DELTA, text=e.text + "." * 150)
            book.event(record, e, emitted)

        def join(after):
            reader = Reader(after)
            d = book.follow("r1", after, reader.write, reader.end)
            d.addCallbacks(lambda f: setattr(reader, "follower", f), lambda f: setattr(reader, "failed", f))
            readers.append(reader)

        for action, number in steps:
            if action == "emit" and emitted < last:
                emit()
            elif action == "join":
                join(number % (last + 1))
            elif action == "answer" and node.pending:
                node.answer(number % len(node.pending))
            elif action == "leave" and readers:
                reader = readers[number % len(readers)]
                if reader.follower is not None and reader not in left:
                    book.unfollow("r1", reader.follower)
                    left.append(reader)
        while emitted < last:
            emit()
        while node.pending:
            node.answer()

        for reader in readers:
            self.assertIsNone(reader.failed)
            # (A reader at the terminal is told it again.)
            expected = list(range(reader.after + 1, last + 1)) or [last]
            if reader in left:
                self.assertEqual(reader.seqs, expected[: len(reader.seqs)])
                continue
            self.assertEqual(reader.seqs, expected)
            self.assertEqual(reader.ended, 1)
            for seq, text in zip(reader.seqs, reader.texts, strict=True):
                want = event(seq, last).text
                self.assertTrue(text.startswith(want) if want else text == "")


class OlderNodeTests(SynchronousTestCase):
    def test_background_run_ends_with_a_version_3_link(self):
        """
        A Node of wire version 3 cannot keep runs across a lost link: its
        background runs end node_disconnected with the link, and it is
        never sent a RunResume.
        """
        harness = EdgeHarness()
        node, pump, _ = harness.register("tok-1", wire_version=3)
        recorder = Recorder()
        spec = RunSpec(messages=[{"role": "user", "content": "x"}], adapter="echo", node="n1", background=True)
        run_id = self.successResultOf(harness.service.submit(spec, recorder.for_run))
        node.transport.loseConnection()
        pump.flush()
        record = harness.service.runs.get(run_id)
        assert record is not None and record.error is not None
        self.assertEqual((record.status, record.error["code"]), ("error", "node_disconnected"))
        self.assertEqual(harness.service.inflight.detached_on("n1"), [])
        self.assertEqual(node.of("run_resume"), [])


class Stores:
    """
    The Nodes' stores, by node and wire id: every event each attempt
    emitted under its own seq (also those the Edge never passed on), and
    a row; C{down} nodes cannot be asked.
    """

    def __init__(self):
        self.events: dict[tuple[str, str], list[dict[str, Any]]] = {}
        self.rows: dict[tuple[str, str], dict[str, Any]] = {}
        self.down: set[str] = set()
        self.asked: list[tuple[str, str | None, int]] = []

    def add(self, node, wire_id, events, status="complete", started_at=0.0):
        self.events[(node, wire_id)] = events
        output = "".join(e.get("text", "") for e in events if e["type"] == DELTA)
        self.rows[(node, wire_id)] = {
            "run_id": wire_id,
            "kind": RUN,
            "status": status,
            "started_at": started_at,
            "output": output,
        }

    def fetch(self, wire_id, node_id, after):
        self.asked.append((wire_id, node_id, after))
        if node_id in self.down:
            return defer.fail(ServiceError("unavailable", f"node {node_id} is not connected"))
        for (node, wire), events in self.events.items():
            if wire == wire_id and node_id in (None, node):
                found = {"run": self.rows[(node, wire)], "events": [e for e in events if e["seq"] > after]}
                return defer.succeed((node, found))
        return defer.fail(ServiceError("not_found", f"no run {wire_id}", code="run_not_found"))


def play(book, stores, plan):
    """
    Run C{r1} through its attempts as the starter and the dispatch do:
    C{plan} is a list of C{(node, words)}; an attempt before the last is
    cut after its words (none: it failed before any output, and the next
    one is placed again from 0), its Node going on with a word the caller
    never gets; a continuation's start is not passed on and its events
    are numbered after the caller's last. @return: the record.
    """
    record = None
    continuing = False
    for index, (node, words) in enumerate(plan):
        wire_id = "r1" if index == 0 else f"r1-{index + 1}"
        record = book.open("r1", RUN, node=node, wire_id=wire_id)
        base = record.last_seq if continuing else 0
        last = index == len(plan) - 1
        stored: list[dict[str, Any]] = [] if (not words and not last) else [{"seq": 1, "type": START}]
        for word in words:
            stored.append({"seq": len(stored) + 1, "type": DELTA, "text": word})
        caller_gets = list(stored)
        if last:
            stored.append({"seq": len(stored) + 1, "type": COMPLETE})
            caller_gets = list(stored)
        else:
            if words:
                stored.append({"seq": len(stored) + 1, "type": DELTA, "text": "never-seen "})
            stored.append({"seq": len(stored) + 1, "type": ERROR})
        stores.add(node, wire_id, stored, "complete" if last else "error", started_at=float(index))
        for e in caller_gets:
            if continuing and e["type"] == START:
                continue
            data = RunEventData(e["type"], text=e.get("text", ""))
            book.event(record, data, base + e["seq"])
        continuing = continuing or bool(words)
    assert record is not None
    return record


class AttemptTests(SynchronousTestCase):
    def setUp(self):
        self.clock = Clock()
        self.stores = Stores()
        self.book = RunBook(self.clock, EventBus(self.clock), self.stores.fetch, max_age_sec=60)

    def test_attempts_from_the_callers_last_seq(self):
        """
        A new node or wire id for a record that was placed is its next
        attempt, numbered from the caller's last seq (what the starter
        gives the continuation's C{seq_base}); an attempt placed again
        before any output starts from 0; a queued record placed, or opened
        again where it is, is still one attempt.
        """
        record = self.book.open("r1", RUN, status="queued")
        self.book.open("r1", RUN, node="n1", wire_id="r1")
        self.book.open("r1", RUN, node="n1", wire_id="r1")
        self.assertEqual(record.attempts, [("n1", "r1", 0)])
        self.book.open("r1", RUN, node="n2", wire_id="r1-2")
        for seq in range(1, 4):
            self.book.event(record, event(seq, 9), seq)
        self.book.open("r1", RUN, node="n1", wire_id="r1-3")
        self.assertEqual(record.attempts, [("n1", "r1", 0), ("n2", "r1-2", 0), ("n1", "r1-3", 3)])
        self.assertEqual(self.book.locate("r1"), ("n1", "r1-3"))

    def test_forgotten_run_keeps_its_attempts_bounded(self):
        """
        Once its record is gone the book still knows a run's attempts —
        those its caller got events of, and the last — for at most
        WHERE_SIZE runs.
        """
        self.patch(runs_module, "WHERE_SIZE", 2)
        play(self.book, self.stores, [("n1", []), ("n2", ["a "]), ("n1", ["b "])])
        self.clock.advance(61)
        self.assertIsNone(self.book.get("r1"))
        self.assertEqual(self.book.attempts("r1"), [("n2", "r1-2", 0), ("n1", "r1-3", 2)])
        for run_id in ("a", "b"):
            self.book.event(self.book.open(run_id, RUN, node="n1"), RunEventData(COMPLETE))
        self.assertEqual(self.book.attempts("r1"), [(None, "r1", 0)])
        self.assertEqual(self.book.attempts("b"), [("n1", "b", 0)])

    def test_listed_as(self):
        """
        A Node's row is listed under the run id its caller knows, only for
        the last attempt of a run the book remembers, never for one it
        holds; a run it knows nothing of goes by the wire-id convention.
        """
        record = self.book.open("run-x", RUN, node="n1")
        self.book.event(record, RunEventData(START), 1)
        self.book.open("run-x", RUN, node="n2", wire_id="run-x-2")
        self.assertIsNone(self.book.listed_as("n2", "run-x-2"))
        self.assertIsNone(self.book.listed_as("n1", "run-x"))
        self.book.event(record, RunEventData(COMPLETE), 3)
        self.clock.advance(61)
        self.assertEqual(self.book.listed_as("n2", "run-x-2"), ("run-x", 2))
        self.assertIsNone(self.book.listed_as("n1", "run-x"))
        self.assertIsNone(self.book.listed_as("n1", "run-x-2"))
        self.assertEqual(self.book.listed_as("n1", "run-y-3"), ("run-y", 3))
        self.assertEqual(self.book.listed_as("n1", "run-y"), ("run-y", 1))

    def test_forgotten(self):
        """
        An attempt of a run that ended here is forgotten once its record
        is gone (not while it is held), by its wire id on its own node
        only; a run the book never knew is not.
        """
        record = self.book.open("run-x", RUN, node="n1")
        self.book.event(record, RunEventData(START), 1)
        self.book.open("run-x", RUN, node="n2", wire_id="run-x-2")
        self.book.event(record, RunEventData(COMPLETE), 2)
        self.assertFalse(self.book.forgotten("n2", "run-x-2"))
        self.clock.advance(61)
        self.assertTrue(self.book.forgotten("n2", "run-x-2"))
        self.assertTrue(self.book.forgotten("n1", "run-x"))
        self.assertFalse(self.book.forgotten("n1", "run-x-2"))
        self.assertFalse(self.book.forgotten("n1", "run-y"))

    def test_split_wire_id(self):
        """
        C{<id>-<n>} (n >= 2) is attempt n of a run id C{<prefix>-<token>};
        anything else is a first attempt under its own id.
        """
        cases = {
            "run-ab12-2": ("run-ab12", 2),
            "run-ab12-17": ("run-ab12", 17),
            "run-ab12": ("run-ab12", 1),
            "run-123456": ("run-123456", 1),
            "run-ab12-1": ("run-ab12-1", 1),
            "run-ab12-02": ("run-ab12-02", 1),
            "x-2": ("x-2", 1),
        }
        self.assertEqual({wire_id: runs_module.split_wire_id(wire_id) for wire_id in cases}, cases)

    def test_resume_across_attempts_after_eviction(self):
        """
        A forgotten run that was continued is read from each attempt's
        store, C{after} in that attempt's numbering, its events in the
        caller's: attempt 1 up to where the continuation took over (not
        the word its Node went on with, nor its error), the continuation
        after it, its start left out.
        """
        record = play(self.book, self.stores, [("n1", ["a ", "b "]), ("n2", ["c ", "d "])])
        seqs = [seq for seq, _ in record.log]
        self.assertEqual(seqs, [1, 2, 3, 5, 6, 7])
        self.clock.advance(61)
        reader = Reader(0)
        self.successResultOf(self.book.follow("r1", 0, reader.write, reader.end))
        self.assertEqual((reader.seqs, "".join(reader.texts), reader.ended), (seqs, "a b c d ", 1))
        self.stores.asked.clear()
        reader = Reader(5)
        self.successResultOf(self.book.follow("r1", 5, reader.write, reader.end))
        self.assertEqual((reader.seqs, reader.ended), ([6, 7], 1))
        # (From one before the resume point: a terminal there is told again.)
        self.assertEqual(self.stores.asked, [("r1-2", "n2", 1)])

    def test_unreadable_attempt_leaves_a_gap(self):
        """
        When an attempt's node cannot be asked, the reader gets what the
        others have, in its numbering, rather than another attempt's
        events in its place.
        """
        play(self.book, self.stores, [("n1", ["a ", "b "]), ("n2", ["c ", "d "])])
        self.clock.advance(61)
        self.stores.down.add("n1")
        reader = Reader(0)
        self.successResultOf(self.book.follow("r1", 0, reader.write, reader.end))
        self.assertEqual((reader.seqs, reader.ended), ([5, 6, 7], 1))
        self.stores.down = {"n2"}
        reader = Reader(0)
        self.successResultOf(self.book.follow("r1", 0, reader.write, reader.end))
        self.assertEqual((reader.seqs, reader.ended), ([1, 2, 3], 1))
        self.stores.down = {"n1", "n2"}
        self.failureResultOf(self.book.follow("r1", 0, reader.write, reader.end), ServiceError)


class ReadAcrossAttemptsProperties(SynchronousTestCase):
    """
    However a run moved between attempts (placed again before any output,
    continued after a cut, on one node or another), a reader resuming
    anywhere gets exactly the events its caller had after that point,
    whether the Edge still holds the run (its log cut short) or forgot it.
    """

    @settings(max_examples=200, deadline=None)
    @given(
        st.lists(
            st.tuples(st.sampled_from(["n1", "n2"]), st.lists(st.sampled_from(["a ", "bb ", "c" * 90]), max_size=4)),
            min_size=1,
            max_size=4,
        ),
        st.sampled_from([256, 100_000]),
        st.booleans(),
    )
    def test_every_resume_point(self, plan, max_bytes, forget):
        clock = Clock()
        stores = Stores()
        book = RunBook(clock, EventBus(clock), stores.fetch, max_bytes=max_bytes, max_age_sec=60)
        whole = Reader(0)
        book.open("r1", RUN)
        book.follow("r1", 0, whole.write, whole.end)
        record = play(book, stores, plan)
        self.assertEqual(whole.ended, 1)
        if forget:
            clock.advance(61)
            self.assertIsNone(book.get("r1"))
        for after in range(record.last_seq + 1):
            reader = Reader(after)
            self.successResultOf(book.follow("r1", after, reader.write, reader.end))
            pairs = list(zip(whole.seqs, whole.texts, strict=True))
            # (One resumed at the terminal is told it again.)
            tail = [(seq, text) for seq, text in pairs if seq > after] or pairs[-1:]
            self.assertEqual(list(zip(reader.seqs, reader.texts, strict=True)), tail)
            self.assertEqual(reader.ended, 1)
