"""
Runs that outlive their caller, through the whole gateway in memory
(L{iop.testing.gateway}): background runs, reading runs back, replaying
and following a run's events with exact resumption, and the Node's store
answering once the Edge has forgotten a run.
"""

import copy
import json
from typing import cast

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.test.requesthelper import DummyRequest

from iop.edge.bus import EventBus
from iop.edge.http.api import EdgeAPI
from iop.edge.http.native import EventFeed
from iop.edge.http.request import EdgeRequest
from iop.run import COMPLETE, DELTA, START, RunEventData, Usage
from iop.testing.gateway import GATEWAY_YAML, Gateway

TEXT = "one two three four five six"


def config(**run_log):
    data = copy.deepcopy(GATEWAY_YAML)
    if run_log:
        data["run_log"] = run_log
    return data


def sse(body):
    """
    The events of an SSE body as C{(id, payload)}, comments skipped.
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


class GatewayRunsTestCase(SynchronousTestCase):
    run_log: dict = {}

    def setUp(self):
        self.gateway = Gateway(config(**self.run_log))
        self.node = self.gateway.node()

    def result(self, d):
        return self.successResultOf(self.gateway.read(d))

    def json(self, d):
        code, _, body = self.result(d)
        return code, json.loads(body)

    def run_id(self, request):
        return request.responseHeaders.getRawHeaders(b"x-iop-run-id")[0].decode()

    def in_use(self, provider):
        providers = self.gateway.service.status()["nodes"][0]["providers"]
        return {p["id"]: p["in_use"]["normal"] for p in providers}[provider]

    def manual_run(self, index=-1):
        return self.node.adapter("llm").runs[index]


class CollectedTests(GatewayRunsTestCase):
    def test_names_where_it_ran(self):
        """
        A run answered as one JSON document (C{"stream": false}) names the
        node, provider and model that served it, beside its text.
        """
        d = self.gateway.post("/v1/runs", {"model": "talk", "input": "hello there", "stream": False})
        self.gateway.advance(1)
        code, answer = self.json(d)
        self.assertEqual(code, 200)
        self.assertEqual(
            (answer["status"], answer["text"], answer["node"], answer["provider"], answer["model"]),
            ("complete", "hello there", "n1", "echo", "talk"),
        )


class BackgroundTests(GatewayRunsTestCase):
    def test_survives_its_caller(self):
        """
        A streamed background run whose caller disconnects goes on to its
        end, holding its lease meanwhile; C{GET /v1/runs/{id}} then gives
        the whole text, the usage and the status.
        """
        self.gateway.post("/v1/runs", {"model": "talk", "input": TEXT, "stream": True, "background": True})
        self.gateway.advance(0.25)
        request = self.gateway.requests[0]
        run_id = self.run_id(request)
        self.gateway.hang_up(request)
        self.assertEqual(self.in_use("echo"), 1)
        self.gateway.advance(2)
        self.assertEqual(self.in_use("echo"), 0)
        code, run = self.json(self.gateway.get(f"/v1/runs/{run_id}"))
        self.assertEqual(code, 200)
        self.assertEqual((run["id"], run["status"], run["output"]), (run_id, "complete", TEXT))
        self.assertEqual(run["usage"], {"input_tokens": 6, "output_tokens": 6})
        self.assertEqual((run["node"], run["adapter"], run["model"], run["background"]), ("n1", "echo", "talk", True))
        self.assertIsNotNone(run["ended_at"])
        self.assertIsNone(run["error"])

    def test_window_opens_wide_when_the_caller_leaves(self):
        """
        A streamed background run whose caller left is not held back by
        flow control: its window opens wide, so the Node sends on however
        much the run says.
        """
        self.gateway.post("/v1/runs", {"model": "big", "input": "hi", "stream": True, "background": True})
        run, emit, done = self.manual_run()
        emit(RunEventData(START))
        self.gateway.flush()
        self.gateway.hang_up(self.gateway.requests[0])
        big = "x" * 300_000
        for _ in range(4):
            emit(RunEventData(DELTA, text=big))
        emit(RunEventData(COMPLETE))
        done.callback(None)
        self.gateway.flush()
        record = self.gateway.service.runs.get(run.run_id)
        assert record is not None
        self.assertEqual((record.status, record.last_seq), ("complete", 6))

    def test_foreground_still_cancelled(self):
        """
        A run that is not in the background still ends when its caller
        leaves: it is cancelled on the Node and its record says so.
        """
        self.gateway.post("/v1/runs", {"model": "talk", "input": TEXT, "stream": True})
        self.gateway.advance(0.25)
        request = self.gateway.requests[0]
        run_id = self.run_id(request)
        self.gateway.hang_up(request)
        self.gateway.advance(1)
        code, run = self.json(self.gateway.get(f"/v1/runs/{run_id}"))
        self.assertEqual(run["status"], "cancelled")
        self.assertEqual(self.in_use("echo"), 0)

    def test_not_streamed_is_202(self):
        """
        C{"background": true, "stream": false} answers 202 at once with
        the run (running when there was room, queued when not; its
        C{Location} is the run); a queued one starts when room appears,
        and cancelling a queued one ends it cancelled without running.
        """
        ids = []
        for _ in range(4):
            code, headers, body = self.result(
                self.gateway.post("/v1/runs", {"model": "big", "input": "hi", "stream": False, "background": True})
            )
            self.assertEqual(code, 202)
            run = json.loads(body)
            self.assertEqual(headers.getRawHeaders(b"location"), [f"/v1/runs/{run['id']}".encode()])
            ids.append(run["id"])
        statuses = [self.json(self.gateway.get(f"/v1/runs/{i}"))[1]["status"] for i in ids]
        self.assertEqual(statuses, ["running", "running", "queued", "queued"])
        self.assertEqual(len(self.node.adapter("llm").runs), 2)
        self.assertEqual(self.json(self.gateway.post(f"/v1/runs/{ids[3]}/cancel", {}))[0], 200)
        _, emit, done = self.manual_run(0)
        emit(RunEventData(COMPLETE))
        done.callback(None)
        self.gateway.flush()
        statuses = [self.json(self.gateway.get(f"/v1/runs/{i}"))[1]["status"] for i in ids]
        self.assertEqual(statuses, ["complete", "running", "running", "cancelled"])
        self.assertEqual(len(self.node.adapter("llm").runs), 3)

    def test_202_refusal_is_an_error(self):
        """
        A background run that cannot even wait (an unknown model) is an
        error answer, not a 202.
        """
        code, body = self.json(
            self.gateway.post("/v1/runs", {"model": "nope", "input": "x", "stream": False, "background": True})
        )
        self.assertEqual(code, 404)

    def test_openai_background_header(self):
        """
        On the OpenAI surface, C{x-iop-background: true} makes a background
        run: a normalized run even on a tunnel provider, named in the
        C{x-iop-run-id} header, that outlives its caller.
        """
        self.gateway.http.post(
            "http://edge.invalid/v1/chat/completions",
            json={"model": "big", "stream": True, "messages": [{"role": "user", "content": "hi"}]},
            headers={"x-iop-background": "true"},
        )
        self.gateway.flush()
        self.assertEqual(self.node.adapter("llm").tunnels, [])
        run, emit, done = self.manual_run()
        request = self.gateway.requests[-1]
        self.assertEqual(self.run_id(request), run.run_id)
        emit(RunEventData(START))
        emit(RunEventData(DELTA, text="still here"))
        self.gateway.flush()
        self.gateway.hang_up(request)
        self.assertEqual(self.node.adapter("llm").cancelled, [])
        emit(RunEventData(COMPLETE, usage=Usage(1, 2)))
        done.callback(None)
        self.gateway.flush()
        _, answer = self.json(self.gateway.get(f"/v1/runs/{run.run_id}"))
        self.assertEqual((answer["status"], answer["output"]), ("complete", "still here"))


class FollowTests(GatewayRunsTestCase):
    def start(self):
        self.gateway.post("/v1/runs", {"model": "big", "input": "hi", "stream": False, "background": True})
        run, emit, done = self.manual_run()
        return run.run_id, emit, done

    def test_replay_then_follow(self):
        """
        C{/events} replays what happened, then follows live events until
        the terminal; each event has its C{id: <seq>}.
        """
        run_id, emit, done = self.start()
        emit(RunEventData(START))
        emit(RunEventData(DELTA, text="a"))
        self.gateway.flush()
        d = self.gateway.get(f"/v1/runs/{run_id}/events")
        emit(RunEventData(DELTA, text="b"))
        emit(RunEventData(COMPLETE))
        done.callback(None)
        self.gateway.flush()
        code, headers, body = self.result(d)
        self.assertEqual(headers.getRawHeaders(b"content-type"), [b"text/event-stream"])
        events = sse(body)
        self.assertEqual([i for i, _ in events], [1, 2, 3, 4])
        self.assertEqual([e["type"] for _, e in events], ["start", "delta", "delta", "complete"])
        self.assertEqual([e["seq"] for _, e in events], [1, 2, 3, 4])

    def test_resume(self):
        """
        A reader that reconnects with C{Last-Event-ID} (or C{?after=})
        gets exactly the events after it: none twice, none missing.
        """
        run_id, emit, done = self.start()
        emit(RunEventData(START))
        for word in ("a", "b", "c"):
            emit(RunEventData(DELTA, text=word))
        self.gateway.flush()
        resumed = self.gateway.get(f"/v1/runs/{run_id}/events", headers={"last-event-id": "2"})
        after = self.gateway.get(f"/v1/runs/{run_id}/events?after=3")
        emit(RunEventData(DELTA, text="d"))
        emit(RunEventData(COMPLETE))
        done.callback(None)
        self.gateway.flush()
        self.assertEqual([e.get("text") for _, e in sse(self.result(resumed)[2])], ["b", "c", "d", None])
        self.assertEqual([i for i, _ in sse(self.result(after)[2])], [4, 5, 6])
        whole = sse(self.result(self.gateway.get(f"/v1/runs/{run_id}/events?after=0"))[2])
        self.assertEqual("".join(e.get("text", "") for _, e in whole), "abcd")

    def test_bad_resume_point(self):
        """
        A resume point that is not a seq (negative, or past the 64-bit
        seqs the wire and the Node's store carry) is a 400; an unknown run
        a 404.
        """
        run_id, emit, done = self.start()
        self.assertEqual(self.json(self.gateway.get(f"/v1/runs/{run_id}/events?after=x"))[0], 400)
        self.assertEqual(self.json(self.gateway.get(f"/v1/runs/{run_id}/events?after={2**63}"))[0], 400)
        for header in ("-3", str(2**63)):
            bad = self.gateway.get(f"/v1/runs/{run_id}/events", headers={"last-event-id": header})
            self.assertEqual(self.json(bad)[0], 400)
        self.assertEqual(self.json(self.gateway.get("/v1/runs/run-nope/events"))[0], 404)
        self.assertEqual(self.json(self.gateway.get("/v1/runs/run-nope"))[0], 404)

    def test_native_stream_has_ids(self):
        """
        The stream of C{POST /v1/runs} carries the same ids, so a caller
        cut off there can resume from C{/events}.
        """
        d = self.gateway.post("/v1/runs", {"model": "talk", "input": "x y", "stream": True})
        self.gateway.advance(1)
        events = sse(self.result(d)[2])
        self.assertEqual([i for i, _ in events], [1, 2, 3, 4])
        self.assertEqual([e["seq"] for _, e in events], [1, 2, 3, 4])


class ForgottenTests(GatewayRunsTestCase):
    """
    The Edge keeps no finished run (C{max_runs: 0}): the Node's store
    answers.
    """

    run_log = {"max_runs": 0}

    def test_read_back_from_the_node(self):
        """
        A finished run the Edge no longer has is read from its Node's
        store: the same status, output and events.
        """
        d = self.gateway.post("/v1/runs", {"model": "talk", "input": TEXT, "stream": True})
        self.gateway.advance(2)
        run_id = self.run_id(self.gateway.requests[0])
        self.assertIsNone(self.gateway.service.runs.get(run_id))
        self.result(d)
        code, run = self.json(self.gateway.get(f"/v1/runs/{run_id}"))
        self.assertEqual(code, 200)
        self.assertEqual((run["status"], run["output"], run["node"], run["adapter"]), ("complete", TEXT, "n1", "echo"))
        events = sse(self.result(self.gateway.get(f"/v1/runs/{run_id}/events", headers={"last-event-id": "5"}))[2])
        self.assertEqual([i for i, _ in events], [6, 7, 8])
        self.assertEqual(events[-1][1]["type"], "complete")

    def test_list(self):
        """
        C{GET /v1/runs} merges what the Edge holds (a queued background
        run) with the Node's store, newest first, filtered and limited.
        """
        for _ in range(2):
            self.gateway.post("/v1/runs", {"model": "talk", "input": "x", "stream": True})
        self.gateway.advance(1)
        for _ in range(3):
            self.gateway.post("/v1/runs", {"model": "big", "input": "x", "stream": False, "background": True})
            self.gateway.clock.advance(0.1)
        code, answer = self.json(self.gateway.get("/v1/runs?limit=10"))
        self.assertEqual(code, 200)
        statuses = [r["status"] for r in answer["runs"]]
        self.assertEqual(sorted(statuses), ["complete", "complete", "queued", "running", "running"])
        self.assertEqual(answer["runs"][0]["status"], "queued")
        self.assertNotIn("incomplete", answer)
        _, complete = self.json(self.gateway.get("/v1/runs?status=complete&node=n1&limit=1"))
        self.assertEqual([r["status"] for r in complete["runs"]], ["complete"])
        self.assertEqual(self.json(self.gateway.get("/v1/runs?node=ghost"))[0], 404)
        self.assertEqual(self.json(self.gateway.get("/v1/runs?status=lost"))[0], 400)
        self.assertEqual(self.json(self.gateway.get("/v1/runs?limit=0"))[0], 400)


class TruncatedLogTests(GatewayRunsTestCase):
    """
    The Edge keeps at most 1 KiB of a run's events: the Node's store fills
    in the rest, in order, while the run goes on.
    """

    run_log = {"max_bytes": 1024}

    def test_fill_from_the_node(self):
        """
        A reader from the start of a long, still running run gets the
        early events from the Node's store and the live ones behind them;
        the run's output is whole too.
        """
        self.gateway.post("/v1/runs", {"model": "big", "input": "hi", "stream": False, "background": True})
        run, emit, done = self.manual_run()
        emit(RunEventData(START))
        words = [f"{i:03d}" + "x" * 60 + " " for i in range(40)]
        for word in words[:30]:
            emit(RunEventData(DELTA, text=word))
        self.gateway.flush()
        record = self.gateway.service.runs.get(run.run_id)
        assert record is not None
        self.assertFalse(record.complete_log)
        d = self.gateway.http.get(f"http://edge.invalid/v1/runs/{run.run_id}/events")
        # Live events arrive while the Edge is still asking the Node.
        for word in words[30:]:
            emit(RunEventData(DELTA, text=word))
        self.gateway.flush()
        emit(RunEventData(COMPLETE))
        done.callback(None)
        self.gateway.flush()
        events = sse(self.result(d)[2])
        self.assertEqual([i for i, _ in events], list(range(1, 43)))
        self.assertEqual("".join(e.get("text", "") for _, e in events), "".join(words))
        _, answer = self.json(self.gateway.get(f"/v1/runs/{run.run_id}"))
        self.assertEqual(answer["output"], "".join(words))


class FeedService:
    def __init__(self, clock, bus):
        self.clock = clock
        self.bus = bus


class EventsFeedTests(SynchronousTestCase):
    def setUp(self):
        self.clock = Clock()
        self.bus = EventBus(self.clock)
        self.request = DummyRequest([b""])
        # DummyRequest drives only pull producers; the feed is a push one.
        self.patch(self.request, "registerProducer", lambda producer, streaming: None)

    def feed(self, types=frozenset(), node=None, deltas=False):
        # The feed reads only the Edge's clock and bus, and uses only what a
        # DummyRequest has of an EdgeRequest.
        service = cast(EdgeAPI, FeedService(self.clock, self.bus))
        return EventFeed(service, cast(EdgeRequest, self.request), types, node, deltas)

    def events(self):
        return sse_named(b"".join(self.request.written))

    def test_topics_filters_and_deltas(self):
        """
        Each event is one SSE event named by its topic; C{type} keeps
        topics or event types, C{node} one node's; deltas only when asked.
        """
        self.feed(types=frozenset({"tunnel", "disconnected"}), node="n1")
        self.bus.publish("run", {"run_id": "r1", "node": "n1", "type": "start"})
        self.bus.publish("tunnel", {"run_id": "t1", "node": "n1", "type": "end", "status": "complete"})
        self.bus.publish("tunnel", {"run_id": "t2", "node": "n2", "type": "start"})
        self.bus.node_event("n1", "disconnected", reason="gone")
        self.bus.publish("run_delta", {"run_id": "r1", "node": "n1", "type": "delta", "text": "x"})
        self.clock.advance(0)
        self.assertEqual(
            [(name, data.get("run_id") or data.get("event")) for name, data in self.events()],
            [("tunnel", "t1"), ("node", "disconnected")],
        )

    def test_deltas(self):
        """
        With deltas asked for, every delta of every run is in the feed.
        """
        self.feed(deltas=True)
        self.bus.publish("run_delta", {"run_id": "r1", "node": "n1", "type": "delta", "text": "x"})
        self.clock.advance(0)
        self.assertEqual([name for name, _ in self.events()], ["run_delta"])

    def test_slow_reader_drops_and_is_told(self):
        """
        While the reader's connection is paused, events are dropped and
        counted; the next one is preceded by the count. The subscription
        ends with the request.
        """
        feed = self.feed()
        feed.pauseProducing()
        for n in range(3):
            self.bus.publish("run", {"run_id": f"r{n}", "type": "start"})
        self.clock.advance(0)
        feed.resumeProducing()
        self.bus.publish("run", {"run_id": "r9", "type": "start"})
        self.clock.advance(0)
        self.assertEqual(
            [(n, d.get("dropped") or d["run_id"]) for n, d in self.events()], [("dropped", 3), ("run", "r9")]
        )
        self.request.finish()
        self.assertFalse(self.bus.wants("run"))

    def test_keepalive(self):
        """
        An idle feed sends a comment every 15 s.
        """
        self.feed()
        self.clock.advance(16)
        self.assertIn(b": keepalive\n\n", b"".join(self.request.written))


class EventsEndpointTests(GatewayRunsTestCase):
    def test_admin_only(self):
        """
        The feed needs an admin key.
        """
        self.assertEqual(self.json(self.gateway.get("/v1/events"))[0], 403)


def sse_named(body):
    events = []
    for block in body.decode().split("\n\n"):
        name, data = None, None
        for line in block.split("\n"):
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
        if data is not None:
            events.append((name, data))
    return events


class LostLinkTests(GatewayRunsTestCase):
    """
    A background run survives its Node's link being lost: the Node keeps
    it running, reports it when it is back, the Edge takes it back with a
    lease of the new generation, and the run's events are whole.
    """

    def start(self, background=True):
        self.gateway.post("/v1/runs", {"model": "big", "input": "hi", "stream": False, "background": background})
        run, emit, done = self.manual_run()
        emit(RunEventData(START))
        emit(RunEventData(DELTA, text="one "))
        self.gateway.flush()
        return run.run_id, emit, done

    def cut(self):
        self.node.session.close()
        self.gateway.flush()

    def test_taken_back(self):
        """
        Events the run produced while its link was down are replayed when
        the Node is back; a reader from the start gets every event once,
        in order; the lease is held again while it runs and back after.
        """
        run_id, emit, done = self.start()
        self.cut()
        self.assertEqual(self.in_use("llm"), 0)
        self.assertEqual(self.json(self.gateway.get(f"/v1/runs/{run_id}"))[1]["status"], "running")
        emit(RunEventData(DELTA, text="two "))
        emit(RunEventData(DELTA, text="three "))
        self.assertEqual(self.node.adapter("llm").cancelled, [])
        self.gateway.advance(1)
        self.node.reconnect(self.gateway)
        self.assertTrue(self.gateway.service.status()["nodes"][0]["connected"])
        self.assertEqual(self.in_use("llm"), 1)
        reader = self.gateway.get(f"/v1/runs/{run_id}/events")
        emit(RunEventData(DELTA, text="four"))
        emit(RunEventData(COMPLETE, usage=Usage(1, 4)))
        done.callback(None)
        self.gateway.flush()
        events = sse(self.result(reader)[2])
        self.assertEqual([i for i, _ in events], [1, 2, 3, 4, 5, 6])
        self.assertEqual("".join(e.get("text", "") for _, e in events), "one two three four")
        _, run = self.json(self.gateway.get(f"/v1/runs/{run_id}"))
        self.assertEqual((run["status"], run["output"]), ("complete", "one two three four"))
        self.assertEqual(self.in_use("llm"), 0)

    def test_ended_while_away(self):
        """
        A run that ended while its link was down is reported ended: the
        Edge gets the rest of its events, terminal included, and takes no
        lease for it.
        """
        run_id, emit, done = self.start()
        self.cut()
        emit(RunEventData(DELTA, text="two"))
        emit(RunEventData(COMPLETE))
        done.callback(None)
        self.node.reconnect(self.gateway)
        self.assertEqual(self.in_use("llm"), 0)
        _, run = self.json(self.gateway.get(f"/v1/runs/{run_id}"))
        self.assertEqual((run["status"], run["output"]), ("complete", "one two"))

    def test_foreground_ends(self):
        """
        A run that is not in the background still ends with its link, on
        both sides.
        """
        run_id, emit, done = self.start(background=False)
        self.cut()
        self.assertEqual(self.node.adapter("llm").cancelled, [run_id])
        _, run = self.json(self.gateway.get(f"/v1/runs/{run_id}"))
        self.assertEqual((run["status"], run["error"]["code"]), ("error", "node_disconnected"))

    def test_not_back_in_time(self):
        """
        A Node that does not come back within reattach_timeout_sec: the run
        ends node_disconnected on the Edge; when the Node does come back
        and reports it, the Edge has it cancelled there.
        """
        run_id, emit, done = self.start()
        self.cut()
        self.gateway.clock.advance(121)
        _, run = self.json(self.gateway.get(f"/v1/runs/{run_id}"))
        self.assertEqual((run["status"], run["error"]["code"]), ("error", "node_disconnected"))
        self.node.reconnect(self.gateway)
        self.assertEqual(self.node.adapter("llm").cancelled, [run_id])
        self.assertEqual(self.in_use("llm"), 0)

    def test_cancelled_while_away(self):
        """
        Cancelling a run whose Node is away ends it at once; the Node is
        told when it is back.
        """
        run_id, emit, done = self.start()
        self.cut()
        self.assertEqual(self.json(self.gateway.post(f"/v1/runs/{run_id}/cancel", {}))[0], 200)
        _, run = self.json(self.gateway.get(f"/v1/runs/{run_id}"))
        self.assertEqual(run["status"], "cancelled")
        self.node.reconnect(self.gateway)
        self.assertEqual(self.node.adapter("llm").cancelled, [run_id])

    def test_node_restarted(self):
        """
        A Node that comes back without the run (it restarted) ends it
        node_restarted.
        """
        run_id, emit, done = self.start()
        self.cut()
        self.node.context.detached.take(run_id)
        self.node.reconnect(self.gateway)
        _, run = self.json(self.gateway.get(f"/v1/runs/{run_id}"))
        self.assertEqual((run["status"], run["error"]["code"]), ("error", "node_restarted"))

    def test_new_edge_adopts(self):
        """
        A Node that reconnects to an Edge that never heard of its
        background run (the Edge restarted): the run is taken on record
        there, with a lease and under the caller key it belongs to, and its
        whole text comes back from the Node's store.
        """
        run_id, emit, done = self.start()
        self.cut()
        other = Gateway(config(**self.run_log))
        self.node.reconnect(other)
        providers = other.service.status()["nodes"][0]["providers"]
        self.assertEqual({p["id"]: p["in_use"]["normal"] for p in providers}["llm"], 1)
        emit(RunEventData(DELTA, text="two"))
        emit(RunEventData(COMPLETE))
        done.callback(None)
        other.flush()
        _, _, body = self.successResultOf(other.read(other.get(f"/v1/runs/{run_id}")))
        run = json.loads(body)
        self.assertEqual((run["status"], run["output"], run["background"]), ("complete", "one two", True))
        record = other.service.runs.get(run_id)
        assert record is not None
        self.assertEqual(record.caller, "anonymous")

    def test_edge_drain_hands_runs_back(self):
        """
        A stopping Edge does not cancel or wait for background runs: it
        hands them back to their Node, which keeps them for the next Edge.
        """
        run_id, emit, done = self.start()
        stopped = self.gateway.service.stopService()
        self.gateway.flush()
        self.successResultOf(stopped)
        self.assertEqual(self.node.adapter("llm").cancelled, [])
        self.assertIn(run_id, self.node.context.detached)
