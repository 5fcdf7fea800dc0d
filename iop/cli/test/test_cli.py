"""
The command line's pieces that need no Edge: the event-stream reader, the
error lines and exit statuses, the tables, the pull progress reader, and
(against scripted answers, to cut streams at will) following a run with
resumption and tailing the events feed.
Commands against real daemons are in tests/test_cli.py.
"""

import hashlib
import http.client
import io
import json
import sys
from typing import Any, cast

from rich.console import Console
from twisted.trial.unittest import SynchronousTestCase

from iop.cli import render, sse, streams
from iop.cli.client import (
    AUTH,
    FAILED,
    NOT_FOUND,
    UNREACHABLE,
    UNSUPPORTED,
    USAGE,
    CLIError,
    EdgeClient,
    Response,
    answer_error,
)
from iop.cli.context import Context
from iop.cli.main import build_parser, main, run_list
from iop.cli.pull import ollama_adapter, show_progress


def error(message, code="x"):
    return json.dumps({"error": {"message": message, "code": code}}).encode()


class EventStreamTests(SynchronousTestCase):
    def test_fields_and_blank_line(self):
        """
        An event is dispatched at its blank line, with its id and name;
        several data lines join with newlines; comments are skipped; the id
        carries over to later events, as in a browser.
        """
        lines = [
            b": keepalive\n",
            b"id: 7\n",
            b"event: run\n",
            b'data: {"a":\n',
            b"data: 1}\n",
            b"\n",
            b"data: x\r\n",
            b"\r\n",
        ]
        events = list(sse.parse(lines))
        self.assertEqual(events, [sse.Event('{"a":\n1}', "7", "run"), sse.Event("x", "7", None)])

    def test_unfinished_event_dropped(self):
        """
        An event whose closing blank line never came is not dispatched.
        """
        self.assertEqual(list(sse.parse([b"data: 1\n", b"\n", b"data: 2\n"])), [sse.Event("1")])


class AnswerErrorTests(SynchronousTestCase):
    def test_classes(self):
        """
        Each answer class has its own exit status, and the line carries
        the Edge's own message.
        """
        cases = [
            (401, error("the API key is not valid"), AUTH, "IOP_API_KEY"),
            (403, error("this operation needs an admin API key"), AUTH, "IOP_ADMIN_KEY"),
            (404, error("no node 'x' is configured"), NOT_FOUND, "no node 'x'"),
            (404, error("no such endpoint: /v1/events", "not_found"), UNSUPPORTED, "does not serve GET /v1/events"),
            (405, error("GET is not allowed here"), UNSUPPORTED, "does not serve GET /v1/events"),
            (
                503,
                error("node n is not connected", "unavailable"),
                FAILED,
                "503: node n is not connected [unavailable]",
            ),
            (502, b"<html>bad gateway</html>", FAILED, "<html>bad gateway</html>"),
            (502, b"<html>\n  <h1>bad gateway</h1>\n</html>\n", FAILED, "<html> <h1>bad gateway</h1> </html>"),
        ]
        for status, body, code, words in cases:
            e = answer_error("GET", "/v1/events", status, body)
            self.assertEqual(e.exit_code, code, (status, body))
            self.assertIn(words, e.message)
            self.assertNotIn("\n", e.message)

    def test_admin_key_checked_before_sending(self):
        """
        An admin command without an admin key fails at once naming the
        option and the variable, without trying the Edge.
        """
        client = EdgeClient("http://127.0.0.1:1", api_key="k")
        e = self.assertRaises(CLIError, client.request, "GET", "/v1/events", admin=True)
        self.assertEqual(e.exit_code, AUTH)
        self.assertIn("--admin-key", e.message)

    def test_bad_edge_url(self):
        """
        An --edge that is not an HTTP address is a usage error.
        """
        self.assertEqual(self.assertRaises(CLIError, EdgeClient, "ftp://x").exit_code, USAGE)
        self.assertEqual(EdgeClient("edge:8080").base_url, "http://edge:8080")

    def test_bad_edge_port(self):
        """
        An --edge whose port is not a port, or that is not a URL at all, is
        a one-line usage error naming it (not a traceback when connecting).
        """
        for url in ("http://127.0.0.1:abc", "http://127.0.0.1:99999", "http://[::1", "http://127.0.0.1:0"):
            err = io.StringIO()
            self.assertEqual(main(["--edge", url, "status"], {}, io.StringIO(), err), USAGE, url)
            self.assertEqual(err.getvalue().count("\n"), 1, url)
            self.assertIn("--edge", err.getvalue())


class FakeConnection:
    def __init__(self):
        self.closed = False

    def close(self):
        self.closed = True


class FakeRaw:
    """
    The C{http.client} response of a 200 answer: its body, or a cut
    (C{IncompleteRead}) while it is read.
    """

    def __init__(self, body, content_type="application/json", cut=False):
        self.status = 200
        self.body = body
        self.content_type = content_type
        self.cut = cut

    def getheaders(self):
        return [("Content-Type", self.content_type)]

    def read(self):
        if self.cut:
            raise http.client.IncompleteRead(self.body, 100)
        return self.body


def answer(raw, connection=None):
    """
    The L{Response} of a 200 answer over fakes.
    """
    return Response(
        cast(http.client.HTTPConnection, connection or FakeConnection()), cast(http.client.HTTPResponse, raw)
    )


class BadAnswerTests(SynchronousTestCase):
    """
    A 200 answer the command line cannot read (not JSON, cut short, not
    the shape it reads) is one line on stderr and an exit status, never a
    traceback.
    """

    def iop(self, argv, raw):
        """
        Run C{iop argv} against an Edge answering C{raw}: its exit status
        and stderr, and whether the connection was closed.
        """
        connection = FakeConnection()
        self.patch(EdgeClient, "request", lambda self, method, path, **kwargs: answer(raw, connection))
        err = io.StringIO()
        code = main(argv, {}, io.StringIO(), err)
        self.assertEqual(err.getvalue().count("\n"), 1, err.getvalue())
        self.assertTrue(connection.closed)
        return code, err.getvalue()

    def test_status_not_json(self):
        """
        A 200 that is not JSON (a proxy's page, a wrong --edge) is a bad
        answer named with its content type and its start on one line.
        """
        code, err = self.iop(["status"], FakeRaw(b"<html>\n<body>hello</body>\n</html>", "text/html"))
        self.assertEqual(code, FAILED)
        self.assertIn("iop status: the Edge's answer is not JSON (text/html): <html> <body>hello</body>", err)

    def test_status_not_object(self):
        """
        A status that is JSON but not an object is a bad answer.
        """
        code, err = self.iop(["status"], FakeRaw(b"[1, 2]"))
        self.assertEqual(code, FAILED)
        self.assertIn("the Edge's status is not a JSON object: [1, 2]", err)

    def test_runs_cut(self):
        """
        A body cut short is as if no answer came: the Edge is unreachable.
        """
        code, err = self.iop(["runs"], FakeRaw(b'{"runs": [', cut=True))
        self.assertEqual(code, UNREACHABLE)
        self.assertIn("the Edge's answer was cut short", err)

    def test_runs_null(self):
        """
        A run history that is neither a list nor an object is a bad answer,
        with --json too.
        """
        for argv in (["runs"], ["runs", "--json"]):
            code, err = self.iop(argv, FakeRaw(b"null"))
            self.assertEqual(code, FAILED)
            self.assertIn("the Edge's run history is not a list of runs: null", err)

    def test_runs_of_a_node_not_asked(self):
        """
        A listing the Edge says is incomplete (a node it could not ask)
        says so on stderr, naming the node, and still succeeds.
        """
        connection = FakeConnection()
        raw = FakeRaw(b'{"runs": [{"id": "run-1", "status": "complete"}], "incomplete": ["node-1"]}')
        self.patch(EdgeClient, "request", lambda self, method, path, **kwargs: answer(raw, connection))
        out, err = io.StringIO(), io.StringIO()
        self.assertEqual(main(["runs"], {}, out, err), 0)
        self.assertIn("run-1", out.getvalue())
        self.assertIn("not listed: the runs stored on node-1 (not reachable now)", err.getvalue())

    def test_run_not_object(self):
        """
        One run that is not an object is a bad answer.
        """
        code, err = self.iop(["run", "run-1"], FakeRaw(b'"run-1"'))
        self.assertEqual(code, FAILED)
        self.assertIn('the run is not a JSON object: "run-1"', err)


class ArgumentTests(SynchronousTestCase):
    def test_globals_either_side_and_from_environment(self):
        """
        Global options come from the environment, and may be given before
        or after the command; the later one wins.
        """
        environ = {"IOP_EDGE": "http://e:1", "IOP_API_KEY": "k", "IOP_ADMIN_KEY": "a"}
        args = build_parser(environ).parse_args(["status"])
        self.assertEqual((args.edge, args.key, args.admin_key, args.json), ("http://e:1", "k", "a", False))
        args = build_parser(environ).parse_args(["--edge", "http://f:2", "nodes", "--json", "--key", "k2"])
        self.assertEqual((args.edge, args.key, args.json), ("http://f:2", "k2", True))

    def test_token_hash(self):
        """
        token-hash prints the SHA-256 of the token (the form edge.yaml's
        token_sha256 takes), and as JSON with --json.
        """
        out = io.StringIO()
        self.assertEqual(main(["token-hash", "s3cret"], {}, out, io.StringIO()), 0)
        self.assertEqual(out.getvalue(), hashlib.sha256(b"s3cret").hexdigest() + "\n")
        out = io.StringIO()
        main(["token-hash", "s3cret", "--json"], {}, out, io.StringIO())
        self.assertEqual(json.loads(out.getvalue()), {"sha256": hashlib.sha256(b"s3cret").hexdigest()})

    def test_bad_durations(self):
        """
        --timeout and --interval must be positive finite numbers of
        seconds: anything else is a usage error (exit 2) before any
        request, not a traceback from the socket or from sleeping.
        """
        for argv in (
            ["--timeout", "-1", "status"],
            ["--timeout", "0", "status"],
            ["--timeout", "nan", "status"],
            ["status", "--timeout", "inf"],
            ["status", "--watch", "--interval", "-1"],
            ["status", "--watch", "--interval", "0"],
        ):
            self.patch(sys, "stderr", io.StringIO())
            with self.assertRaises(SystemExit) as raised:
                build_parser({}).parse_args(argv)
            self.assertEqual(raised.exception.code, USAGE, argv)
        self.assertEqual(build_parser({}).parse_args(["--timeout", "2.5", "status"]).timeout, 2.5)

    def test_empty_run_id(self):
        """
        An empty run id is a usage error before any request (it would
        name the list of runs).
        """
        err = io.StringIO()
        self.assertEqual(main(["run", " "], {}, io.StringIO(), err), USAGE)
        self.assertIn("a run id is required", err.getvalue())

    def test_bad_args_json(self):
        """
        A node command's --args must be a JSON object: anything else is a
        one-line usage error before any request.
        """
        err = io.StringIO()
        code = main(
            ["node", "n", "command", "ollama_show", "--args", "[1]", "--admin-key", "a"], {}, io.StringIO(), err
        )
        self.assertEqual(code, USAGE)
        self.assertEqual(err.getvalue().count("\n"), 1)
        self.assertIn("--args must be a JSON object", err.getvalue())


STATUS = {
    "nodes": [
        {
            "id": "gpu-1",
            "connected": True,
            "connected_since": 1000.0,
            "in_flight": 2,
            "adapters": [{"name": "vllm", "type": "vllm", "max_concurrency": 8}],
            "providers": [
                {
                    "node": "gpu-1",
                    "id": "vllm",
                    "adapter": "vllm",
                    "status": "available",
                    "health": "ok",
                    "capacity": {"normal": 4, "long": 1},
                    "in_use": {"normal": 4, "long": 0},
                }
            ],
        },
        {"id": "gpu-2", "connected": False, "last_seen": 900.0, "in_flight": 0, "adapters": [], "providers": []},
        {"id": "gpu-3", "connected": False, "in_flight": 0, "adapters": [], "providers": []},
    ],
    "model_groups": [{"name": "qwen", "queued": 3}],
}


def text_of(renderable):
    out = io.StringIO()
    Console(file=out, width=160).print(renderable)
    return out.getvalue()


class RenderTests(SynchronousTestCase):
    def test_ages(self):
        """
        Durations read at a glance at every scale.
        """
        self.assertEqual(
            [render.age(s) for s in (-1, 42, 252, 7500, 300000)], ["0s", "42s", "4m 12s", "2h 05m", "3d 11h"]
        )

    def test_status_tables(self):
        """
        The status view names every node with its state and age (on the
        Edge's clock), every provider with in_use/capacity per class, and
        every model group's queue.
        """
        text = text_of(render.status_view(STATUS, now=1252.0))
        for words in ("gpu-1", "ready", "up 4m 12s", "vllm (vllm)", "4/4", "0/1"):
            self.assertIn(words, text)
        self.assertIn("last seen 5m 52s ago", text)
        self.assertIn("never connected", text)
        self.assertIn("qwen", text)

    def test_draining(self):
        """
        A connected node that announced a drain reads as draining.
        """
        self.assertEqual(render.node_state({"connected": True, "draining": True}), "draining")

    def test_run_list_shapes(self):
        """
        The run history answer may be a list or an object holding one.
        """
        self.assertEqual(run_list([{"id": 1}]), [{"id": 1}])
        self.assertEqual(run_list({"runs": [{"id": 2}]}), [{"id": 2}])
        self.assertEqual(run_list({"data": [{"id": 3}]}), [{"id": 3}])
        text = text_of(
            render.runs_table([{"id": "run-1", "status": "complete", "usage": {"input_tokens": 3, "output_tokens": 5}}])
        )
        self.assertIn("run-1", text)
        self.assertIn("3 in / 5 out", text)

    def test_run_ids_whole_on_a_narrow_terminal(self):
        """
        At 80 columns a run's id and status are shown whole, so the id can
        be copied into C{iop run ID}.
        """
        run_id = "run-" + "4f3a2b1c0d9e" * 2
        out = io.StringIO()
        run: dict[str, Any] = {"id": run_id, "status": "cancelled", "node": "gpu-node-1", "adapter": "ollama"}
        run.update(created_at=1764820000.0, ended_at=1764820100.0, usage={"input_tokens": 1234, "output_tokens": 5678})
        Console(file=out, width=80).print(render.runs_table([run]))
        self.assertIn(run_id, out.getvalue())
        self.assertIn("cancelled", out.getvalue())

    def test_run_list_not_runs(self):
        """
        Anything else, or runs that are not objects, is a bad answer.
        """
        for data in (None, "runs", [1], {"runs": ["run-1"]}):
            self.assertEqual(self.assertRaises(CLIError, run_list, data).exit_code, FAILED, data)


class PullProgressTests(SynchronousTestCase):
    def context(self, *argv):
        self.out, self.err = io.StringIO(), io.StringIO()
        args = build_parser({}).parse_args(["pull", "n1", "llama3.2", *argv])
        return Context(args, EdgeClient(), self.out, self.err)

    def events(self, *payloads):
        return [sse.Event(json.dumps(p)) for p in payloads]

    def test_streamed_progress(self):
        """
        Streamed Ollama progress lines (status, and completed/total per
        layer) feed the bars and end with the last status.
        """
        ctx = self.context()
        events = self.events(
            {"status": "pulling manifest"},
            {"status": "pulling abc", "digest": "sha256:abc", "total": 100, "completed": 10},
            {"status": "pulling abc", "digest": "sha256:abc", "total": 100, "completed": 100},
            {"status": "success"},
        )
        self.assertEqual(show_progress(ctx, events, "n1", "llama3.2"), 0)
        self.assertIn("pulled llama3.2 on n1: success", self.out.getvalue())
        self.assertIn("pulling manifest", self.err.getvalue())

    def test_streamed_error(self):
        """
        An error event ends the pull with a one-line failure.
        """
        ctx = self.context()
        e = self.assertRaises(
            CLIError,
            show_progress,
            ctx,
            self.events({"status": "pulling manifest"}, {"error": "no such model"}),
            "n1",
            "x",
        )
        self.assertEqual(e.exit_code, FAILED)
        self.assertIn("no such model", e.message)

    def test_json_lines(self):
        """
        With --json, each progress event is one JSON line on stdout.
        """
        ctx = self.context("--json")
        show_progress(ctx, self.events({"status": "a"}, {"status": "success"}), "n1", "x")
        self.assertEqual(
            [json.loads(line) for line in self.out.getvalue().splitlines()], [{"status": "a"}, {"status": "success"}]
        )

    def test_not_json_line(self):
        """
        A progress line that is not a JSON object ends the pull with a
        one-line failure.
        """
        ctx = self.context()
        for data in ("garbage", "[1]"):
            events = [*self.events({"status": "pulling manifest"}), sse.Event(data)]
            e = self.assertRaises(CLIError, show_progress, ctx, events, "n1", "x")
            self.assertEqual(e.exit_code, FAILED)
            self.assertIn("a line of the pull's progress stream is not", e.message)

    def test_status_not_object(self):
        """
        Finding the node's adapter in a status that is not an object is a
        bad answer.
        """
        ctx = self.context()
        ctx.client = FakeClient(answer(FakeRaw(b"[]")))
        e = self.assertRaises(CLIError, ollama_adapter, ctx, "n1")
        self.assertEqual(e.exit_code, FAILED)
        self.assertIn("the Edge's status is not a JSON object", e.message)


class FakeResponse:
    """
    A streamed answer: its events, then a cut (OSError) or the end.
    """

    def __init__(self, events, cut=False):
        self._events = events
        self.cut = cut

    def events(self):
        yield from self._events
        if self.cut:
            raise ConnectionResetError("cut")

    def close(self):
        pass


class FakeClient(EdgeClient):
    """
    Answers each request with the next scripted response (or raises the
    scripted CLIError), recording what was asked.
    """

    def __init__(self, *answers):
        super().__init__()
        self.answers = list(answers)
        self.requests = []

    def request(self, method, path, **kwargs):
        self.requests.append((method, path, kwargs))
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer


def run_event(seq, kind, **fields):
    return sse.Event(json.dumps({"run_id": "run-1", "type": kind, **fields}), id=str(seq))


class FollowTests(SynchronousTestCase):
    def setUp(self):
        self.patch(streams, "RESUME_DELAY_SEC", 0)
        self.out, self.err = io.StringIO(), io.StringIO()

    def context(self, client, *argv):
        args = build_parser({}).parse_args(["run", "run-1", "--follow", *argv])
        ctx = Context(args, EdgeClient(), self.out, self.err)
        ctx.client = client
        return ctx

    def test_resume_after_cut(self):
        """
        A stream cut before the terminal is resumed with Last-Event-ID set
        to the last id seen: the text is printed once, whole, and the
        command succeeds when the run completes.
        """
        client = FakeClient(
            FakeResponse([run_event(1, "start"), run_event(2, "delta", text="one ")], cut=True),
            CLIError("cannot reach", UNREACHABLE),
            FakeResponse([run_event(3, "delta", text="two"), run_event(4, "complete")]),
        )
        self.assertEqual(streams.follow_run(self.context(client), "/v1/runs/run-1"), 0)
        self.assertEqual(self.out.getvalue(), "one two\n")
        headers = [kwargs["headers"].get("last-event-id") for _, _, kwargs in client.requests]
        self.assertEqual(headers, [None, "2", "2"])
        self.assertEqual({path for _, path, _ in client.requests}, {"/v1/runs/run-1/events"})

    def test_failed_run(self):
        """
        A run that ends in error exits 1 naming the code and reason on
        stderr; with --json every event is one JSON line.
        """
        client = FakeClient(FakeResponse([run_event(1, "error", error={"code": "boom", "message": "it broke"})]))
        self.assertEqual(streams.follow_run(self.context(client, "--json"), "/p"), FAILED)
        self.assertEqual(json.loads(self.out.getvalue())["type"], "error")
        self.assertIn("boom: it broke", self.err.getvalue())

    def test_reasoning_ends_its_line(self):
        """
        Reasoning goes to stderr and is ended with its own line break
        before the answer begins, so the two never share a line.
        """
        client = FakeClient(
            FakeResponse(
                [
                    run_event(1, "reasoning_delta", text="thinking"),
                    run_event(2, "delta", text="answer"),
                    run_event(3, "complete"),
                ]
            )
        )
        self.assertEqual(streams.follow_run(self.context(client), "/p"), 0)
        self.assertEqual(self.err.getvalue(), "thinking\n")
        self.assertEqual(self.out.getvalue(), "answer\n")

    def test_error_string(self):
        """
        A terminal whose error is a bare string names it.
        """
        client = FakeClient(FakeResponse([run_event(1, "error", error="it broke")]))
        self.assertEqual(streams.follow_run(self.context(client), "/p"), FAILED)
        self.assertIn("run run-1 ended error: it broke", self.err.getvalue())

    def test_not_json_event(self):
        """
        An event that is not a JSON object ends the command with a
        one-line failure (not a resumption), after what came before it.
        """
        for data in ("not json", "null"):
            client = FakeClient(FakeResponse([run_event(1, "delta", text="one "), sse.Event(data, id="2")]))
            e = self.assertRaises(CLIError, streams.follow_run, self.context(client), "/p")
            self.assertEqual(e.exit_code, FAILED)
            self.assertIn("an event of the run's stream is not", e.message)
            self.assertEqual(len(client.requests), 1)
        self.assertEqual(self.out.getvalue(), "one one ")

    def test_first_connection_refused(self):
        """
        An Edge that cannot be reached before any event is not retried.
        """
        client = FakeClient(CLIError("cannot reach", UNREACHABLE))
        self.assertRaises(CLIError, streams.follow_run, self.context(client), "/p")
        self.assertEqual(len(client.requests), 1)


class EventsTests(SynchronousTestCase):
    def test_lines(self):
        """
        Each event of the feed is one line with its kind and its fields,
        ids first; --json passes the data through.
        """
        events = [
            sse.Event(
                json.dumps({"node": "gpu-1", "event": "disconnected", "reason": "heartbeat timeout"}), event="node"
            ),
            sse.Event(json.dumps({"type": "complete", "run_id": "run-9", "node": "gpu-1"}), event="run"),
        ]
        out = io.StringIO()
        args = build_parser({}).parse_args(["events", "--node", "gpu-1", "--admin-key", "a"])
        ctx = Context(args, EdgeClient(admin_key="a"), out, io.StringIO())
        ctx.client = client = FakeClient(FakeResponse(events))
        self.assertEqual(streams.tail_events(ctx, {"node": "gpu-1", "type": None}), 0)
        lines = out.getvalue().splitlines()
        self.assertIn("node event=disconnected node=gpu-1 reason=heartbeat timeout", lines[0])
        self.assertIn("run type=complete node=gpu-1 run_id=run-9", lines[1])
        method, path, kwargs = client.requests[0]
        self.assertEqual(
            (method, path, kwargs["admin"], kwargs["params"]["node"]), ("GET", "/v1/events", True, "gpu-1")
        )


def chunk(**fields):
    return sse.Event(json.dumps(fields))


class ChatTests(SynchronousTestCase):
    def setUp(self):
        self.out, self.err = io.StringIO(), io.StringIO()

    def chat(self, *events):
        args = build_parser({}).parse_args(["chat", "m", "hi"])
        ctx = Context(args, EdgeClient(), self.out, self.err)
        ctx.client = FakeClient(FakeResponse(list(events)))
        return streams.chat(ctx, "m", [{"role": "user", "content": "hi"}])

    def test_error_string(self):
        """
        A tunnelled error chunk whose error is a bare string (some
        providers' own) is a one-line failure naming it.
        """
        e = self.assertRaises(CLIError, self.chat, chunk(error="model overloaded"))
        self.assertEqual(e.exit_code, FAILED)
        self.assertEqual(e.message, "the completion failed: model overloaded")

    def test_not_json_chunk(self):
        """
        A chunk that is not a JSON object ends the completion with a
        one-line failure (rather than dropping it, and perhaps some of the
        answer, unseen), after the text that came before it.
        """
        for data, words in (("keep-alive", "is not JSON: keep-alive"), ("[1]", "is not a JSON object: [1]")):
            hello = chunk(choices=[{"delta": {"content": "hello"}}])
            e = self.assertRaises(CLIError, self.chat, hello, sse.Event(data), sse.Event("[DONE]"))
            self.assertEqual(e.exit_code, FAILED)
            self.assertEqual(e.message, "a chunk of the completion stream " + words)
        self.assertEqual(self.out.getvalue(), "hellohello")
