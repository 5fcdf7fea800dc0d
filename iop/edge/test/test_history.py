"""
Run history (L{iop.edge.history}) of runs that moved between attempts —
placed again before their first byte, or continued after a cut — read
back and listed once the Edge forgot them or while it holds them: with
in-memory Nodes' stores, and through the whole gateway in memory.
"""

import json
from typing import Any, cast

from twisted.internet import defer
from twisted.internet.task import Clock
from twisted.logger import capturedLogs
from twisted.trial.unittest import SynchronousTestCase

from iop.edge.bus import EventBus
from iop.edge.errors import ServiceError
from iop.edge.history import RUN_GET_PAGES, RunHistory
from iop.edge.runs import RUN, RunBook
from iop.edge.test.test_runs import Reader, Stores, play
from iop.run import DELTA, ERROR, START, RunEventData, RunFailure, Usage
from iop.testing import gateway as gateway_module
from iop.testing.edge import edge_config
from iop.testing.gateway import Gateway
from iop.testing.node import ManualAdapter


class Link:
    def __init__(self, node_id):
        self.node_id = node_id


class Registry:
    """
    Every configured node is ready but those C{down}.
    """

    def __init__(self, down):
        self.down = down

    def ready_link(self, node_id):
        return None if node_id in self.down else Link(node_id)

    def ready_links(self):
        return [Link(n) for n in ("n1", "n2") if n not in self.down]


class Commands:
    """
    The Nodes' C{run_get} (from L{Stores}) and C{run_list} (their rows,
    newest first, filtered as a Node does).
    """

    def __init__(self, stores):
        self.stores = stores
        self.listed: dict[str, list[dict[str, Any]]] = {"n1": [], "n2": []}

    def command(self, node_id, name, adapter, args):
        if node_id in self.stores.down:
            return defer.fail(ServiceError("unavailable", f"node {node_id} is not connected"))
        if name == "run_get":
            d = self.stores.fetch(args["run_id"], node_id, args["after"])
            return d.addCallback(lambda found: found[1])
        rows = self.listed[node_id] + [row for (node, _), row in self.stores.rows.items() if node == node_id]
        if args.get("status"):
            rows = [row for row in rows if row["status"] == args["status"]]
        rows.sort(key=lambda row: row.get("started_at") or 0, reverse=True)
        return defer.succeed(
            {"runs": [{k: v for k, v in row.items() if k != "output"} for row in rows[: args["limit"]]]}
        )


class Cluster:
    def node_target(self, node_id):
        return None


class HistoryTestCase(SynchronousTestCase):
    def setUp(self):
        self.clock = Clock()
        self.stores = Stores()
        self.commands = Commands(self.stores)
        self.book = RunBook(self.clock, EventBus(self.clock), None, max_bytes=100_000, max_age_sec=60)
        fakes: tuple[Any, Any, Any] = (Registry(self.stores.down), self.commands, Cluster())
        self.history = RunHistory(lambda: edge_config(), self.book, *fakes)
        self.book.fetch = self.history.fetch_run

    def forget(self):
        self.clock.advance(61)
        self.assertIsNone(self.book.get("r1"))

    def listed(self, **filters):
        return [
            (r["id"], r["node"], r["status"]) for r in self.successResultOf(self.history.list_runs(**filters))["runs"]
        ]


class PagedCommands(Commands):
    """
    Nodes whose C{run_get} answers hold at most C{page} events (an
    answer must fit in one frame), saying C{more_events} when some are
    left out, and the output only while it fits.
    """

    def __init__(self, stores, page, output_fills=False):
        super().__init__(stores)
        self.page = page
        #: Whether the output takes all of an answer that holds it.
        self.output_fills = output_fills
        self.run_gets: list[int] = []

    def command(self, node_id, name, adapter, args):
        d = super().command(node_id, name, adapter, args)
        if name != "run_get":
            return d
        self.run_gets.append(args["after"])

        def paged(answer):
            events = answer["events"]
            run = dict(answer["run"])
            if args.get("output", True) is False:
                del run["output"]
            elif self.output_fills:
                return {"run": dict(run, output_truncated=True), "events": [], "more_events": True}
            if len(events) <= self.page:
                return dict(answer, run=run)
            run = dict(run, output="", output_truncated=True) if "output" in run else run
            return {"run": run, "events": events[: self.page], "more_events": True}

        return d.addCallback(paged)


class PagedReadBackTests(HistoryTestCase):
    def setUp(self):
        super().setUp()
        self.paged = PagedCommands(self.stores, page=2)
        self.history.commands = cast(Any, self.paged)

    def test_events_read_page_by_page(self):
        """
        A store whose answer cannot hold every event is asked again after
        the last event it gave: a reader resuming a forgotten run gets
        every event, each once, in order.
        """
        record = play(self.book, self.stores, [("n1", ["a ", "b ", "c ", "d ", "e "])])
        seqs = [seq for seq, _ in record.log]
        self.forget()
        reader = Reader(0)
        self.successResultOf(self.history.follow("r1", 0, reader.write, reader.end))
        self.assertEqual((reader.seqs, reader.ended), (seqs, 1))
        self.assertEqual(self.paged.run_gets, [0, 2, 4, 6])

    def test_output_that_fills_an_answer(self):
        """
        A first answer the run's output filled (no room for one event) is
        asked again without the output: the events still come, and pages
        after the first never ask for the output again.
        """
        self.paged.output_fills = True
        record = play(self.book, self.stores, [("n1", ["a ", "b ", "c "])])
        seqs = [seq for seq, _ in record.log]
        self.forget()
        reader = Reader(0)
        self.successResultOf(self.history.follow("r1", 0, reader.write, reader.end))
        self.assertEqual(reader.seqs, seqs)
        self.assertEqual(self.paged.run_gets[:2], [0, 0])

    def test_pages_bounded(self):
        """
        At most RUN_GET_PAGES answers are read for one run: what they hold
        is given, and the output read back says it is partial.
        """
        words = [f"w{i} " for i in range(4 * RUN_GET_PAGES)]
        play(self.book, self.stores, [("n1", words)])
        self.forget()
        run = self.successResultOf(self.history.get_run("r1"))
        self.assertEqual(len(self.paged.run_gets), RUN_GET_PAGES)
        self.assertTrue(run["output_partial"])
        self.assertTrue(run["output"].startswith("w0 w1 "))


class ReadBackTests(HistoryTestCase):
    def test_continued_run_read_back_whole(self):
        """
        A run that failed on n1 before its first byte, was cut on n2 and
        continued on n1, once forgotten, reads back with the text its
        caller got of both answering attempts (not what n2 went on with
        after the cut), the last attempt's status, and the earlier start;
        the attempt that gave the caller nothing is not even asked.
        """
        plan = [("n1", []), ("n2", ["a ", "b "]), ("n1", ["c ", "d "])]
        record = play(self.book, self.stores, plan)
        whole = record.output()
        self.forget()
        run = self.successResultOf(self.history.get_run("r1"))
        self.assertEqual((run["id"], run["output"], run["status"], run["node"]), ("r1", whole, "complete", "n1"))
        self.assertEqual(run["created_at"], 1.0)
        self.assertNotIn("output_partial", run)
        self.assertEqual([(wire_id, node) for wire_id, node, _ in self.stores.asked], [("r1-2", "n2"), ("r1-3", "n1")])

    def test_held_run_with_a_short_log(self):
        """
        A run the Edge holds whose log lost its first events reads its
        output from every attempt's store, the rest from its record.
        """
        self.book.max_bytes = 200
        record = play(self.book, self.stores, [("n1", ["a" * 100]), ("n2", ["b" * 100, "c" * 100])])
        self.assertFalse(record.complete_log)
        run = self.successResultOf(self.history.get_run("r1"))
        self.assertEqual(run["output"], "a" * 100 + "b" * 100 + "c" * 100)

    def test_resume_point_in_the_callers_numbering(self):
        """
        Last-Event-ID in the continuation asks its node after the
        continuation's own seq, and the events come back numbered as the
        caller had them.
        """
        play(self.book, self.stores, [("n1", ["a ", "b "]), ("n2", ["c ", "d "])])
        self.forget()
        reader = Reader(5)
        self.successResultOf(self.history.follow("r1", 5, reader.write, reader.end))
        self.assertEqual((reader.seqs, reader.texts, reader.ended), ([6, 7], ["d ", ""], 1))
        # (From one before the resume point: a terminal there is told again.)
        self.assertEqual(self.stores.asked, [("r1-2", "n2", 1)])

    def test_attempt_that_cannot_be_read(self):
        """
        With the first attempt's node down, the output is what the
        continuation has, said to be partial (and logged); with the last
        one's down, there is no telling how the run went: it is not read
        as the earlier attempt's.
        """
        play(self.book, self.stores, [("n1", ["a ", "b "]), ("n2", ["c ", "d "])])
        self.forget()
        self.stores.down.add("n1")
        with capturedLogs() as logged:
            run = self.successResultOf(self.history.get_run("r1"))
        self.assertEqual((run["output"], run["output_partial"], run["status"]), ("c d ", True, "complete"))
        self.assertEqual([e["log_level"].name for e in logged], ["warn"])
        self.assertIn("r1 on n1", logged[0]["why"])
        self.stores.down.clear()
        self.stores.down.add("n2")
        failure = self.failureResultOf(self.history.get_run("r1"), ServiceError)
        self.assertEqual(failure.value.kind, "unavailable")


class ListingTests(HistoryTestCase):
    def test_retried_run_listed_once_as_it_ended(self):
        """
        A run that failed on n1 before its first byte and completed on n2
        as r1-2 is listed once, as r1, complete: while the Edge holds it
        and once it forgot it; never as the failed attempt, nor as an r1-2
        its caller never heard of.
        """
        play(self.book, self.stores, [("n1", []), ("n2", ["a "])])
        self.assertEqual(self.listed(), [("r1", "n2", "complete")])
        self.forget()
        self.assertEqual(self.listed(), [("r1", "n2", "complete")])
        self.assertEqual(self.listed(status="error"), [])
        self.assertEqual(self.listed(node_id="n1"), [])
        self.assertEqual(self.listed(node_id="n2"), [("r1", "n2", "complete")])

    def test_the_edges_status_whatever_the_filter(self):
        """
        A run the Edge holds is listed with its status only: a status
        filter does not bring back a Node's other version of it.
        """
        record = self.book.open("r1", RUN, node="n1")
        self.book.event(record, RunEventData(START), 1)
        self.book.event(record, RunEventData(ERROR, error=RunFailure("node_disconnected", "gone")))
        self.commands.listed["n1"].append({"run_id": "r1", "kind": RUN, "status": "cancelled", "started_at": 1.0})
        self.assertEqual(self.listed(), [("r1", "n1", "error")])
        self.assertEqual(self.listed(status="cancelled"), [])
        self.assertEqual(self.listed(status="error"), [("r1", "n1", "error")])

    def test_held_run_hides_every_attempts_row(self):
        """
        While the Edge holds a run in flight, no Node's row of any of its
        attempts is listed beside it.
        """
        self.book.open("r1", RUN, node="n1")
        self.book.open("r1", RUN, node="n2", wire_id="r1-2")
        self.commands.listed["n1"].append({"run_id": "r1", "kind": RUN, "status": "error", "started_at": 1.0})
        self.commands.listed["n2"].append({"run_id": "r1-2", "kind": RUN, "status": "running", "started_at": 2.0})
        self.assertEqual(self.listed(), [("r1", "n2", "running")])
        self.assertEqual(self.listed(status="error"), [])

    def test_forgotten_runs_by_the_wire_id_convention(self):
        """
        Of a run the Edge knows nothing of any more, the rows of its
        attempts (C{<id>-<n>}) are listed once, under its id, as the latest
        attempt listed has it, from its earliest start.
        """
        rows = {
            "n1": [
                {"run_id": "run-aa", "kind": RUN, "status": "error", "started_at": 1.0},
                {"run_id": "run-aa-3", "kind": RUN, "status": "complete", "started_at": 3.0},
                {"run_id": "run-123", "kind": RUN, "status": "complete", "started_at": 4.0},
            ],
            "n2": [{"run_id": "run-aa-2", "kind": RUN, "status": "error", "started_at": 2.0}],
        }
        self.commands.listed.update(rows)
        listed = self.successResultOf(self.history.list_runs())["runs"]
        self.assertEqual(
            [(r["id"], r["node"], r["status"], r["created_at"]) for r in listed],
            [("run-123", "n1", "complete", 4.0), ("run-aa", "n1", "complete", 1.0)],
        )


def sse(body):
    """
    The events of an SSE body as C{(id, payload)}.
    """
    events = []
    for block in body.decode().split("\n\n"):
        event_id, data = None, None
        for line in block.split("\n"):
            if line.startswith("id: "):
                event_id = int(line[4:])
            elif line.startswith("data: "):
                data = json.loads(line[6:])
        if data is not None:
            events.append((event_id, data))
    return events


def gateway_config(continuation):
    """
    One node with two hand-played normalized providers: C{main} prefers
    C{a}, then C{b} (which can continue a cut answer when
    C{continuation}); finished runs are forgotten after 5 seconds.
    """
    adapters = [{"name": n, "type": "ollama", "max_concurrency": 2, "base_url": "http://p.invalid"} for n in "ab"]
    adapters[1]["continuation"] = continuation
    return {
        "listen": {"nodes": "tcp:0", "http": "tcp:0"},
        "admin_keys": ["admin"],
        "run_log": {"max_age_sec": 5},
        "nodes": [
            {
                "id": "n1",
                "token": "tok-1",
                "adapters": adapters,
                "providers": [{"id": n, "adapter": n, "capacity": {"normal": 2}} for n in "ab"],
            }
        ],
        "model_groups": [
            {
                "name": "main",
                "providers": [
                    {"node": "n1", "provider": "a", "target": "m-a"},
                    {"node": "n1", "provider": "b", "target": "m-b", "priority": 1},
                ],
            }
        ],
    }


class GatewayTests(SynchronousTestCase):
    """
    The starter, the dispatch and the run book number a continued run's
    events the same way: once the Edge forgot it, the Node's store gives
    back what the caller got, under the caller's ids.
    """

    def start(self, continuation):
        self.patch(gateway_module, "GATEWAY_TYPES", {"ollama": ManualAdapter})
        self.gateway = Gateway(gateway_config(continuation))
        self.node = self.gateway.node()

    def emit(self, adapter, *events):
        ((run, emit, done),) = self.node.adapter(adapter).runs[-1:]
        for event in events:
            emit(event)
            self.gateway.flush()
        return run, done

    def read(self, path, headers=None):
        code, _, body = self.successResultOf(self.gateway.read(self.gateway.get(path, headers)))
        self.assertEqual(code, 200)
        return body

    def test_continued_run_after_eviction(self):
        self.start(continuation=True)
        d = self.gateway.post("/v1/runs", {"model": "main", "input": "hi", "stream": True})
        cut = RunEventData(ERROR, usage=Usage(5, 2), error=RunFailure("incomplete", "the stream stalled"))
        first, _ = self.emit(
            "a", RunEventData(START), RunEventData(DELTA, text="one "), RunEventData(DELTA, text="two "), cut
        )
        second, done = self.emit(
            "b", RunEventData(START), RunEventData(DELTA, text="three "), RunEventData(DELTA, text="four")
        )
        done.callback(None)
        self.gateway.flush()
        self.assertEqual(second.run_id, first.run_id + "-2")
        run_id = first.run_id
        streamed = sse(self.successResultOf(self.gateway.read(d))[2])
        self.assertEqual([event_id for event_id, _ in streamed], [1, 2, 3, 5, 6, 7])
        self.gateway.advance(6)
        self.assertIsNone(self.gateway.service.runs.get(run_id))

        run = json.loads(self.read(f"/v1/runs/{run_id}"))
        self.assertEqual((run["id"], run["status"], run["output"]), (run_id, "complete", "one two three four"))
        for after in [0] + [event_id for event_id, _ in streamed]:
            replayed = sse(self.read(f"/v1/runs/{run_id}/events", {"Last-Event-ID": str(after)}))
            # (Resumed at the terminal, a reader is told it again.)
            tail = [(i, (p["type"], p.get("text"))) for i, p in streamed if i > after or i == streamed[-1][0]]
            self.assertEqual([(i, (p["type"], p.get("text"))) for i, p in replayed], tail)
        listed = json.loads(self.read("/v1/runs"))["runs"]
        self.assertEqual([(r["id"], r["status"]) for r in listed], [(run_id, "complete")])

    def test_retried_run_after_eviction(self):
        self.start(continuation=False)
        d = self.gateway.post("/v1/runs", {"model": "main", "input": "hi", "stream": True})
        first, _ = self.emit("a", RunEventData(ERROR, error=RunFailure("provider_unreachable", "down")))
        second, done = self.emit("b", RunEventData(START), RunEventData(DELTA, text="whole"))
        done.callback(None)
        self.gateway.flush()
        self.assertEqual(second.run_id, first.run_id + "-2")
        run_id = first.run_id
        self.successResultOf(self.gateway.read(d))
        self.gateway.advance(6)
        self.assertIsNone(self.gateway.service.runs.get(run_id))
        listed = json.loads(self.read("/v1/runs"))["runs"]
        self.assertEqual([(r["id"], r["status"]) for r in listed], [(run_id, "complete")])
        self.assertEqual(json.loads(self.read("/v1/runs?status=error"))["runs"], [])
        run = json.loads(self.read(f"/v1/runs/{run_id}"))
        self.assertEqual((run["status"], run["output"], run["adapter"]), ("complete", "whole", "b"))
