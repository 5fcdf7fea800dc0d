"""
The HTTP surfaces in memory: a real twisted.web resource tree in front of
the real Edge service, driven by treq's StubTreq, with a scripted Node on
an in-memory wire.
"""

import copy
import json
from typing import Any, cast

from treq.testing import StubTreq
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.http import HTTPChannel, Request

from iop.edge.flow import STALL_TIMEOUT_SEC, ReceiveWindow
from iop.edge.http.common import Call
from iop.edge.http.openai import ChunkRenderer
from iop.protocols import messages
from iop.testing.edge import EDGE_YAML, EdgeHarness

BASE = "http://edge.invalid"


class SurfaceTests(SynchronousTestCase):
    def setUp(self):
        self.edge = EdgeHarness()
        self.node, self.pump, _ = self.edge.register()
        assert self.edge.site is not None
        # (StubTreq's request functions are set on it at run time.)
        self.http: Any = StubTreq(self.edge.site.resource)

    def post(self, path, body, raw=None, headers=None):
        data = raw if raw is not None else json.dumps(body).encode()
        return self.http.post(BASE + path, data=data, headers=headers or {b"content-type": [b"application/json"]})

    def answer(self, *events, usage=None, error=None):
        """
        Reply to the last RunRequest with the given (type, text) events.
        """
        self.pump.flush()
        run_id = self.node.of("run_request")[-1].run_id
        for seq, (kind, text) in enumerate(events, 1):
            message = messages.run_event(run_id=run_id, seq=seq, type=kind, text=text)
            if kind in ("complete", "error") and usage is not None:
                message.usage.CopyFrom(usage)
            if kind == "error" and error is not None:
                message.error.CopyFrom(error)
            self.node.connection.send(message)
        self.pump.flush()
        self.http.flush()

    def result(self, d):
        response = self.successResultOf(d)
        body = self.successResultOf(response.content())
        return response.code, response.headers, body

    def test_non_streaming_completion(self):
        """
        A non-streamed completion is one chat.completion with the joined
        text and OpenAI usage; the breakdown appears only when reported.
        """
        d = self.post("/v1/chat/completions", {"model": "echo", "messages": [{"role": "user", "content": "hi you"}]})
        usage = messages.usage(input_tokens=2, output_tokens=2, cached_input_tokens=0)
        self.answer(("start", ""), ("delta", "hi "), ("delta", "you"), ("complete", ""), usage=usage)
        code, _, body = self.result(d)
        reply = json.loads(body)
        self.assertEqual(code, 200)
        self.assertEqual(reply["object"], "chat.completion")
        self.assertEqual(reply["choices"][0]["message"], {"role": "assistant", "content": "hi you"})
        self.assertEqual(reply["usage"]["total_tokens"], 4)
        self.assertEqual(reply["usage"]["prompt_tokens_details"], {"cached_tokens": 0})
        self.assertNotIn("completion_tokens_details", reply["usage"])

    def test_streaming_chunks(self):
        """
        A streamed completion is chat.completion.chunk events: a role chunk,
        content chunks, a stop chunk, a usage chunk when asked, [DONE].
        """
        d = self.post(
            "/v1/chat/completions",
            {
                "model": "echo",
                "stream": True,
                "stream_options": {"include_usage": True},
                "messages": [{"role": "user", "content": "a"}],
            },
        )
        self.answer(
            ("start", ""),
            ("delta", "a"),
            ("reasoning_delta", "hm"),
            ("complete", ""),
            usage=messages.usage(input_tokens=1, output_tokens=1),
        )
        code, headers, body = self.result(d)
        self.assertEqual(code, 200)
        self.assertEqual(headers.getRawHeaders(b"content-type"), [b"text/event-stream"])
        payloads = [line[6:] for line in body.decode().split("\n") if line.startswith("data: ")]
        self.assertEqual(payloads[-1], "[DONE]")
        chunks = [json.loads(p) for p in payloads[:-1]]
        self.assertEqual(chunks[0]["choices"][0]["delta"]["role"], "assistant")
        self.assertEqual(chunks[1]["choices"][0]["delta"], {"content": "a"})
        self.assertEqual(chunks[2]["choices"][0]["delta"], {"reasoning_content": "hm"})
        self.assertEqual(chunks[3]["choices"][0]["finish_reason"], "stop")
        self.assertEqual(chunks[4]["choices"], [])
        self.assertEqual(chunks[4]["usage"]["completion_tokens"], 1)

    def test_stream_cut_by_drain_ends_with_terminal(self):
        """
        A stream still running when a drain ends gets an error event naming
        C{shutting_down} and then C{[DONE]}: an ending, never a cut.
        """
        d = self.post(
            "/v1/chat/completions", {"model": "echo", "stream": True, "messages": [{"role": "user", "content": "a"}]}
        )
        self.answer(("start", ""), ("delta", "a"))
        self.edge.service.stopService()
        self.edge.service.hurry()
        self.http.flush()
        code, _, body = self.result(d)
        self.assertEqual(code, 200)
        payloads = [line[6:] for line in body.decode().split("\n") if line.startswith("data: ")]
        self.assertEqual(payloads[-1], "[DONE]")
        self.assertEqual(json.loads(payloads[-2])["error"]["code"], "shutting_down")

    def test_request_during_drain_is503(self):
        """
        A request arriving on an open connection during a drain is answered
        503 C{shutting_down} and reaches no Node.
        """
        self.edge.service.stopService()
        d = self.post("/v1/chat/completions", {"model": "echo", "messages": [{"role": "user", "content": "a"}]})
        self.http.flush()
        code, _, body = self.result(d)
        self.assertEqual((code, json.loads(body)["error"]["code"]), (503, "shutting_down"))
        self.pump.flush()
        self.assertEqual(self.node.of("run_request"), [])

    def test_error_before_output_keeps_provider_status(self):
        """
        A run that fails before any output answers with the provider's HTTP
        status and an OpenAI error body.
        """
        d = self.post(
            "/v1/chat/completions", {"model": "echo", "stream": True, "messages": [{"role": "user", "content": "a"}]}
        )
        self.answer(("error", ""), error=messages.run_error(code="provider_error", message="slow down", status=429))
        code, _, body = self.result(d)
        self.assertEqual(code, 429)
        self.assertEqual(json.loads(body)["error"]["message"], "slow down")

    def test_capacity_exceeded_is429(self):
        """
        A Node refusing admitted work over its gate twice (the Edge places
        it again once) is a 429 for the caller.
        """
        d = self.post("/v1/chat/completions", {"model": "echo", "messages": [{"role": "user", "content": "a"}]})
        self.answer(("error", ""), error=messages.run_error(code="capacity_exceeded", message="full"))
        self.answer(("error", ""), error=messages.run_error(code="capacity_exceeded", message="full"))
        code, _, body = self.result(d)
        self.assertEqual((code, json.loads(body)["error"]["code"]), (429, "capacity_exceeded"))
        self.assertEqual(len(self.node.of("run_request")), 2)

    def test_session_refusals_are409(self):
        """
        A run refused for its session (another run of it in progress, or
        another key's) is the caller's conflict, a 409, not a back end
        failure, and is not placed again.
        """
        for code in ("session_busy", "session_owned"):
            d = self.post("/v1/chat/completions", {"model": "echo", "messages": [{"role": "user", "content": "a"}]})
            self.answer(("error", ""), error=messages.run_error(code=code, message="not this session"))
            status, _, body = self.result(d)
            self.assertEqual((status, json.loads(body)["error"]["code"]), (409, code))
        self.assertEqual(len(self.node.of("run_request")), 2)
        # A request the Node could not take as it is: the caller's, 400.
        d = self.post("/v1/chat/completions", {"model": "echo", "messages": [{"role": "user", "content": "a"}]})
        self.answer(("error", ""), error=messages.run_error(code="invalid_request", message="bad session id"))
        status, _, body = self.result(d)
        self.assertEqual((status, json.loads(body)["error"]["code"]), (400, "invalid_request"))
        self.assertEqual(len(self.node.of("run_request")), 3)

    def test_capacity_exceeded_placed_again(self):
        """
        The first C{capacity_exceeded} of admitted work is not the caller's
        problem: the Edge places it again (on the wire as a second attempt
        of the same work), and the second attempt's answer is what the
        caller gets.
        """
        d = self.post("/v1/chat/completions", {"model": "echo", "messages": [{"role": "user", "content": "a"}]})
        self.answer(("error", ""), error=messages.run_error(code="capacity_exceeded", message="full"))
        self.answer(("start", ""), ("delta", "a"), ("complete", ""))
        code, _, body = self.result(d)
        self.assertEqual(code, 200)
        self.assertEqual(json.loads(body)["choices"][0]["message"]["content"], "a")
        first, second = self.node.of("run_request")
        self.assertEqual(second.run_id, first.run_id + "-2")
        self.assertEqual(self.edge.service.pool.active_leases(), [])

    def test_bad_json(self):
        """
        Malformed JSON is a 400 with an OpenAI-style error; nothing is sent
        to the Node.
        """
        code, _, body = self.result(self.post("/v1/chat/completions", None, raw=b"{nope"))
        self.assertEqual(code, 400)
        error = json.loads(body)["error"]
        self.assertEqual((error["type"], error["code"]), ("invalid_request_error", "invalid_json"))
        self.pump.flush()
        self.assertEqual(self.node.of("run_request"), [])

    def test_missing_messages(self):
        """
        A completion without messages is a 400 naming the problem.
        """
        code, _, body = self.result(self.post("/v1/chat/completions", {"model": "echo"}))
        self.assertEqual(code, 400)
        self.assertIn("messages", json.loads(body)["error"]["message"])

    def test_unknown_model(self):
        """
        A model that names neither a group nor an adapter is a 404.
        """
        code, _, _ = self.result(
            self.post("/v1/chat/completions", {"model": "gpt-9", "messages": [{"role": "user", "content": "a"}]})
        )
        self.assertEqual(code, 404)

    def test_native_run_events(self):
        """
        POST /v1/runs streams one JSON per event with run_id and type, text
        on deltas and usage on the terminal.
        """
        d = self.post("/v1/runs", {"adapter": "echo", "node": "n1", "input": "x", "stream": True})
        self.answer(
            ("start", ""), ("delta", "x"), ("complete", ""), usage=messages.usage(input_tokens=1, output_tokens=1)
        )
        _, _, body = self.result(d)
        events = [json.loads(line[6:]) for line in body.decode().split("\n") if line.startswith("data: ")]
        self.assertEqual([e["type"] for e in events], ["start", "delta", "complete"])
        self.assertEqual(len({e["run_id"] for e in events}), 1)
        self.assertEqual(events[1]["text"], "x")
        self.assertEqual(events[2]["usage"], {"input_tokens": 1, "output_tokens": 1})

    def test_status_and_models(self):
        """
        The status lists every configured node; /v1/models lists groups and
        the ready node's adapters.
        """
        code, _, body = self.result(self.http.get(BASE + "/v1/status"))
        self.assertEqual([(n["id"], n["connected"]) for n in json.loads(body)["nodes"]], [("n1", True), ("n2", False)])
        code, _, body = self.result(self.http.get(BASE + "/v1/models"))
        self.assertEqual([m["id"] for m in json.loads(body)["data"]], ["grp", "echo"])

    def test_models_lists_an_adapter_one_ready_node_has(self):
        """
        With two ready nodes, an adapter that only one of them has can be
        placed by its name alone, so /v1/models lists it (and not the one
        both have).
        """
        data: dict[str, Any] = copy.deepcopy(EDGE_YAML)
        data["nodes"][1]["adapters"].append({"name": "solo", "type": "echo", "max_concurrency": 1})
        edge = EdgeHarness(data)
        edge.register()
        edge.register(token="tok-2")
        assert edge.site is not None
        http: Any = StubTreq(edge.site.resource)
        d = http.get(BASE + "/v1/models")
        edge.flush()
        body = self.successResultOf(self.successResultOf(d).content())
        self.assertEqual([m["id"] for m in json.loads(body)["data"]], ["grp", "solo"])

    def test_models_lists_only_what_can_be_served(self):
        """
        With two ready nodes an adapter name alone cannot be placed, so
        /v1/models lists only the model groups; one model is readable by id
        (slashes included), an unknown one is an OpenAI-style 404.
        """
        self.edge.register(token="tok-2")
        code, _, body = self.result(self.http.get(BASE + "/v1/models"))
        self.assertEqual([m["id"] for m in json.loads(body)["data"]], ["grp"])
        code, _, body = self.result(self.http.get(BASE + "/v1/models/grp"))
        self.assertEqual(
            (code, json.loads(body)), (200, {"id": "grp", "object": "model", "created": 0, "owned_by": "iop"})
        )
        code, _, body = self.result(self.http.get(BASE + "/v1/models/echo"))
        self.assertEqual((code, json.loads(body)["error"]["code"]), (404, "model_not_found"))
        code, _, body = self.result(self.http.get(BASE + "/v1/models/Qwen/Qwen3-8B"))
        self.assertIn("'Qwen/Qwen3-8B'", json.loads(body)["error"]["message"])

    def test_unknown_path_and_method(self):
        """
        Unknown paths are JSON 404s; a wrong method is a JSON 405.
        """
        code, _, body = self.result(self.http.get(BASE + "/v2/nothing"))
        self.assertEqual(code, 404)
        self.assertIn("error", json.loads(body))
        code, _, body = self.result(self.http.delete(BASE + "/v1/status"))
        self.assertEqual(code, 405)

    def test_admin_needs_key(self):
        """
        Node commands need an admin key.
        """
        code, _, body = self.result(self.post("/v1/nodes/n1/commands", {"command": "capabilities"}))
        self.assertEqual((code, json.loads(body)["error"]["code"]), (403, "admin_key_required"))

    def command(self, body):
        return self.post("/v1/nodes/n1/commands", body, headers={b"authorization": [b"Bearer admin"]})

    def node_answers(self, *responses):
        self.pump.flush()
        request = self.node.of("node_command_request")[-1]
        for response in responses:
            response.request_id = request.request_id
            self.node.connection.send(response)
        self.pump.flush()
        self.http.flush()
        return request

    def test_command_caller_mistake_is_400(self):
        """
        A command the Node reports as unknown is the caller's mistake: 400
        with the Node's code, not 502.
        """
        d = self.command({"command": "frobnicate"})
        self.node_answers(messages.command_error("", "unknown_command", "no command 'frobnicate'"))
        code, _, body = self.result(d)
        self.assertEqual((code, json.loads(body)["error"]["code"]), (400, "unknown_command"))

    def test_streamed_command_progress(self):
        """
        With C{"stream": true} a command answers text/event-stream: each
        progress update the Node reports as it comes, then one terminal.
        """
        d = self.command({"command": "ollama_pull", "adapter": "ollama", "args": {"model": "m"}, "stream": True})
        request = self.node_answers(
            messages.command_result("", '{"status": "pulling", "completed": 1, "total": 4}', progress=True),
            messages.command_result("", '{"status": "pulling", "completed": 4, "total": 4}', progress=True),
            messages.command_result("", '{"status": "success"}'),
        )
        self.assertTrue(request.stream)
        code, headers, body = self.result(d)
        self.assertEqual(headers.getRawHeaders(b"content-type"), [b"text/event-stream"])
        events = [json.loads(line[6:]) for line in body.decode().split("\n") if line.startswith("data: ")]
        self.assertEqual([e.get("completed") for e in events[:2]], [1, 4])
        self.assertEqual((events[-1]["done"], events[-1]["result"]), (True, {"status": "success"}))

    def streamed_pull(self) -> tuple[Any, Any, Any]:
        """
        Start a streamed model pull: @return: its response Deferred, the
        Edge's side of its HTTP request and the Node's command request.
        """
        requests: list[Any] = []
        router = cast(Any, self.edge.site.resource)
        router.observers = (lambda route, request: requests.append(request), *router.observers)
        d = self.command({"command": "ollama_pull", "adapter": "ollama", "args": {"model": "m"}, "stream": True})
        self.pump.flush()
        return d, requests[-1], self.node.of("node_command_request")[-1]

    def progress(self, request_id: str, completed: int) -> None:
        """
        The Node reports a model pull's progress.
        """
        update = f'{{"status": "pulling", "completed": {completed}, "total": 9}}'
        self.node.connection.send(messages.command_result(request_id, update, progress=True))
        self.pump.flush()
        self.http.flush()

    def test_streamed_command_progress_coalesced_while_paused(self) -> None:
        """
        While the caller's connection does not drain, a streamed command's
        progress updates are not queued for it: each supersedes the one
        before, and the latest is written once the connection drains.
        """
        d, request, command = self.streamed_pull()
        self.progress(command.request_id, 1)
        request.channel.pauseProducing()  # the caller's socket buffer is full
        for completed in (2, 3, 4):
            self.progress(command.request_id, completed)
        request.channel.resumeProducing()
        self.progress(command.request_id, 5)
        self.node_answers(messages.command_result("", '{"status": "success"}'))
        code, _, body = self.result(d)
        events = [json.loads(line[6:]) for line in body.decode().split("\n") if line.startswith("data: ")]
        self.assertEqual([e.get("completed") for e in events[:-1]], [1, 4, 5])
        self.assertEqual((events[-1]["done"], events[-1]["result"]), (True, {"status": "success"}))
        self.assertIsNone(request.producer)

    def test_streamed_command_caller_that_takes_nothing(self) -> None:
        """
        A caller whose connection stays undrained for the stall timeout is
        cut off, and its command is cancelled on the Node, as when it
        hangs up.
        """
        d, request, command = self.streamed_pull()
        self.progress(command.request_id, 1)
        transport = request.channel.transport
        request.channel.pauseProducing()
        self.edge.advance(STALL_TIMEOUT_SEC - 1)
        self.progress(command.request_id, 2)
        self.assertEqual(self.node.of("cancel_request"), [])
        self.edge.advance(2)
        self.http.flush()
        (cancel,) = self.node.of("cancel_request")
        self.assertEqual((cancel.kind, cancel.request_id), (messages.CANCEL_COMMAND, command.request_id))
        self.assertTrue(transport.disconnecting)
        self.failureResultOf(self.successResultOf(d).content())

    def test_command_stream_must_be_a_boolean(self):
        """
        C{"stream"} of a node command is a boolean: the string C{"false"}
        is a 400, not a stream.
        """
        code, _, body = self.result(self.command({"command": "capabilities", "stream": "false"}))
        self.assertEqual(code, 400)
        self.assertIn("stream", json.loads(body)["error"]["message"])
        self.assertEqual(self.node.of("node_command_request"), [])

    def test_terminate_unknown_session_is_404(self):
        """
        Terminating a session the adapter never knew answers
        C{terminated: false} with 404, not C{terminated: true}.
        """
        d = self.post("/v1/sessions/terminate", {"node": "n1", "adapter": "echo", "session_id": "ghost"})
        self.pump.flush()
        request = self.node.of("cancel_request")[-1]
        self.node.connection.send(
            messages.cancel_response(
                request_id=request.request_id, ok=False, code="unknown_session", reason="no session"
            )
        )
        self.pump.flush()
        self.http.flush()
        code, headers, body = self.result(d)
        answer = json.loads(body)
        self.assertEqual((code, answer["terminated"], answer["error"]["code"]), (404, False, "unknown_session"))
        # (An error answer of the Edge's own, like any: with a request id.)
        (request_id,) = headers.getRawHeaders(b"x-request-id")
        self.assertTrue(request_id.startswith(b"req-"), request_id)


class TerminateCallerTests(SynchronousTestCase):
    """
    C{POST /v1/sessions/terminate} tells the Node whose sessions the
    caller may end (docs/edge.md, "Isolation"): the Node decides.
    """

    def terminate_as(self, key, api_keys=None):
        """
        Start a run in session C{s1} and then terminate that session, both
        as C{key}: @return: C{(RunRequest.caller, CancelRequest.caller)}.
        """
        data = copy.deepcopy(EDGE_YAML)
        if api_keys is not None:
            data["api_keys"] = api_keys
        edge = EdgeHarness(data)
        node, pump, _ = edge.register()
        assert edge.site is not None
        http: Any = StubTreq(edge.site.resource)
        headers = {b"content-type": [b"application/json"]}
        if key is not None:
            headers[b"authorization"] = [b"Bearer " + key.encode()]
        for path, body in (
            ("/v1/runs", {"adapter": "echo", "input": "hi", "session_id": "s1"}),
            ("/v1/sessions/terminate", {"node": "n1", "adapter": "echo", "session_id": "s1"}),
        ):
            http.post(BASE + path, data=json.dumps(body).encode(), headers=headers)
            pump.flush()
        [run] = node.of("run_request")
        [cancel] = node.of("cancel_request")
        self.assertEqual((cancel.kind, cancel.session_id), (messages.TERMINATE_SESSION, "s1"))
        return run.caller, cancel.caller

    def test_caller_key(self):
        """
        A caller key's terminate names the key, the same owner name as its
        runs carry.
        """
        keys = [{"key": "k1", "name": "alice"}, {"key": "k2", "name": "bob"}]
        self.assertEqual(self.terminate_as("k1", keys), ("alice", "alice"))

    def test_admin_key(self):
        """
        An admin key's terminate names no caller: it may end any session.
        """
        self.assertEqual(self.terminate_as("admin", [{"key": "k1", "name": "alice"}])[1], "")

    def test_open_api(self):
        """
        On an open caller API everyone is one owner, C{anonymous}.
        """
        self.assertEqual(self.terminate_as(None), ("anonymous", "anonymous"))


class ChunkTemplateTests(SynchronousTestCase):
    def test_template_matches_json(self):
        """
        A delta rendered from the chunk template is byte for byte the JSON
        of the whole chunk, quotes, escapes and non-ASCII text included.
        """
        written = []

        class Request:
            def write(self, data):
                written.append(data)

            def setResponseCode(self, code):
                pass

            def setHeader(self, name, value):
                pass

        class CallStub:
            request = Request()
            gone = False

        renderer = ChunkRenderer(cast(Call, CallStub()), "run-abc", 'm"odel', 12, False)
        for key, text in (("content", 'hé"llo\n'), ("reasoning_content", "\u2028 x")):
            renderer._delta(key, text)
            self.assertEqual(written[-1], f"data: {json.dumps(renderer.chunk({key: text}))}\n\n".encode())


class RetriedWindowTests(SynchronousTestCase):
    """
    L{Call.use_producer} with a real HTTP channel: the window of a retried
    attempt takes the place of the one before on a response whose caller's
    connection may be paused already.
    """

    def test_window_registered_while_paused_is_paused(self) -> None:
        """
        twisted.web does not pause a producer registered while its
        transport is paused: the window of an attempt that continues a
        paused answer starts paused (granting nothing), and a caller that
        still takes nothing is cut off after the stall timeout.
        """
        clock = Clock()
        transport = StringTransport()
        channel = HTTPChannel()
        channel.makeConnection(transport)
        request: Any = Request(channel)
        call = Call(cast(Any, object()), request)
        sent: list[object] = []
        first = ReceiveWindow(sent.append, "run-1", 1000, clock)
        call.use_producer(first)
        channel.pauseProducing()  # the caller's socket buffer is full
        self.assertTrue(first.paused)
        first.close()  # the attempt failed; another one continues the answer

        second = ReceiveWindow(sent.append, "run-1", 1000, clock)
        call.use_producer(second)
        self.assertIs(request.producer, second)
        self.assertTrue(second.paused)
        second.received(1000)
        self.assertEqual(sent, [])  # no credit while the caller takes nothing
        clock.advance(STALL_TIMEOUT_SEC)
        self.assertTrue(transport.disconnecting)
