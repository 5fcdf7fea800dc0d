"""
Tests for L{iop.adapters.ollama}: the native NDJSON chat stream and the
model commands.
"""

import json
from typing import Any

from twisted.internet import defer, reactor
from twisted.trial.unittest import TestCase
from zope.interface.verify import verifyObject

from iop.adapters import streams
from iop.adapters.interface import IAdapter, NotSupported, RunInput, TunnelInput
from iop.adapters.ollama import OllamaAdapter, _ollama_message
from iop.adapters.streams import ProviderError
from iop.adapters.test.providers import Events, Routes, Script, moment, serve
from iop.run import INCOMPLETE, RunFailure, Usage
from iop.testing.tunnels import TunnelRecorder


def line(content="", thinking=None, **extra):
    message = {"role": "assistant", "content": content}
    if thinking is not None:
        message["thinking"] = thinking
    data = {"model": "qwen3", "created_at": "1970-01-01T00:00:00Z", "message": message, "done": False}
    data.update(extra)
    return json.dumps(data).encode() + b"\n"


DONE = line(done=True, done_reason="stop", prompt_eval_count=11, eval_count=5)


class OllamaTests(TestCase):
    def adapter(self, routes):
        adapter = OllamaAdapter("ollama", 1, {"base_url": serve(self, Routes(routes))}, reactor)
        self.addCleanup(adapter.stop)
        return adapter

    def test_capabilities(self):
        """
        Ollama is no tunnel target: tunnel raises NotSupported; it lists
        the model commands.
        """
        adapter = OllamaAdapter("ollama", 1, {"base_url": "http://127.0.0.1:1"}, reactor)
        self.assertTrue(verifyObject(IAdapter, adapter))
        self.assertFalse(adapter.capabilities().tunnel)
        self.assertIn("ollama_pull", adapter.capabilities().commands)
        self.assertRaises(NotSupported, adapter.tunnel, TunnelInput("t", "GET", "/api/tags"), None)

    @defer.inlineCallbacks
    def test_chat_stream(self):
        """
        Thinking lines become reasoning_delta, content lines delta (those
        of one read joined, in order), and the done line's counts the
        usage (no breakdown: Ollama reports none); the request carries the model, messages and model options, with
        OpenAI's max_tokens spelled num_predict and think at the top level.
        """
        body = line(thinking="Let me ") + line(thinking="see.") + line("Hel") + line("lo") + DONE
        # Split mid-line to prove incremental parsing.
        script = Script(headers=[("Content-Type", "application/x-ndjson")], chunks=[body[:50], body[50:]])
        events = Events()
        run = RunInput(
            "r1",
            target="qwen3",
            messages=[{"role": "user", "content": "hi"}],
            options={"temperature": 0.2, "max_tokens": 9, "think": True},
        )
        yield self.adapter({"/api/chat": script}).execute(run, events)
        self.assertEqual(
            [(e.type, e.text) for e in events.events],
            [
                ("start", ""),
                ("reasoning_delta", "Let me see."),
                ("delta", "Hello"),
                ("complete", ""),
            ],
        )
        self.assertEqual(events.events[-1].usage, Usage(input_tokens=11, output_tokens=5))
        self.assertEqual(
            script.json_body(),
            {
                "model": "qwen3",
                "messages": [{"role": "user", "content": "hi"}],
                "stream": True,
                "think": True,
                "options": {"temperature": 0.2, "num_predict": 9},
            },
        )

    def test_response_format(self):
        """
        OpenAI's response_format becomes Ollama's top-level format (in
        options Ollama ignores it): "json" for json_object, the schema
        itself for json_schema; text (no constraint) and shapes that are
        neither send none, and an explicit format wins.
        """
        adapter = OllamaAdapter("ollama", 1, {"base_url": "http://127.0.0.1:1"}, reactor)
        schema = {"type": "object", "properties": {"age": {"type": "integer"}}, "required": ["age"]}

        def payload(**options):
            return adapter.chat_payload(RunInput("r1", target="qwen3", options=dict(options, temperature=0)))

        json_schema = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}
        for response_format, expected in (
            ({"type": "json_object"}, "json"),
            (json_schema, schema),
            ({"type": "text"}, None),
            ({"type": "json_schema"}, None),
            ("json", None),
        ):
            sent = payload(response_format=response_format)
            self.assertEqual((sent.get("format"), sent["options"]), (expected, {"temperature": 0}))
            self.assertNotIn("response_format", sent)
        self.assertEqual(payload(format=schema, response_format={"type": "json_object"})["format"], schema)
        self.assertEqual(payload(response_format={"type": "json_object"}, format=schema)["format"], schema)

    @defer.inlineCallbacks
    def test_error_status(self):
        """
        Ollama's {"error": ...} body with a non-2xx status becomes an error
        terminal with that message and status.
        """
        script = Script(status=404, chunks=[b'{"error":"model \\"nope\\" not found, try pulling it first"}'])
        events = Events()
        yield self.adapter({"/api/chat": script}).execute(RunInput("r1", target="nope"), events)
        self.assertEqual(events.types(), ["error"])
        self.assertEqual(
            events.events[0].error,
            RunFailure("provider_error", 'model "nope" not found, try pulling it first', 404),
        )

    @defer.inlineCallbacks
    def test_connection_lost_after_done(self):
        """
        A stream whose connection breaks after its done line (the end of
        the chunked body lost) is whole: the run completes with its usage;
        one that breaks before it ends incomplete.
        """
        events = Events()
        script = Script(chunks=[line("a"), DONE], cut=True)
        yield self.adapter({"/api/chat": script}).execute(RunInput("r1", target="m"), events)
        self.assertEqual(events.types(), ["start", "delta", "complete"])
        self.assertEqual(events.events[-1].usage, Usage(11, 5))
        events = Events()
        script = Script(chunks=[line("a")], cut=True)
        yield self.adapter({"/api/chat": script}).execute(RunInput("r1", target="m"), events)
        self.assertEqual(events.types(), ["start", "delta", "error"])
        assert events.events[-1].error is not None
        self.assertEqual(events.events[-1].error.code, "incomplete")

    @defer.inlineCallbacks
    def test_error_line(self):
        """
        An error line inside the stream ends the run with an error terminal,
        C{incomplete} after what was streamed.
        """
        script = Script(chunks=[line("a"), b'{"error": "runner crashed"}\n'])
        events = Events()
        yield self.adapter({"/api/chat": script}).execute(RunInput("r1", target="m"), events)
        self.assertEqual(events.types(), ["start", "delta", "error"])
        assert events.events[-1].error is not None
        self.assertEqual(events.events[-1].error.code, "incomplete")
        self.assertIn("runner crashed", events.events[-1].error.message)

    @defer.inlineCallbacks
    def test_line_of_the_wrong_shape(self):
        """
        A line that is JSON but not of the expected shape (a message that
        is not an object, tool_calls not a list) is a broken answer:
        provider_error 502 before start, incomplete after it.
        """
        for bad in ({"message": "oops", "done": False}, {"message": {"tool_calls": 5}, "done": False}):
            bad_line = json.dumps(bad).encode() + b"\n"
            events = Events()
            yield self.adapter({"/api/chat": Script(chunks=[bad_line, DONE])}).execute(
                RunInput("r1", target="m"), events
            )
            self.assertEqual(events.types(), ["error"], bad)
            assert events.events[0].error is not None
            self.assertEqual((events.events[0].error.code, events.events[0].error.status), ("provider_error", 502))
            events = Events()
            script = Script(chunks=[line("Hel") + bad_line, DONE])
            yield self.adapter({"/api/chat": script}).execute(RunInput("r1", target="m"), events)
            self.assertEqual(events.types(), ["start", "delta", "error"], bad)
            assert events.events[-1].error is not None
            self.assertEqual(events.events[-1].error.code, INCOMPLETE)

    @defer.inlineCallbacks
    def test_values_that_cannot_be_sent(self):
        """
        A done_reason of any JSON value (unhashable too) gives a finish
        reason that is a string; a token count that is not an integer from
        0 to 2**63 - 1 is not reported (0); a lone surrogate (legal JSON,
        not UTF-8) becomes U+FFFD in a tool call, and is left in text
        deltas for the Node to clean once a turn's text is joined.
        """
        call = {"function": {"name": "f\ud83d", "arguments": '{"a": "\ude00"}'}}
        body = (
            line("Hel\ud83d", thinking="hm\udc00")
            + line(message={"role": "assistant", "content": "", "tool_calls": [call]})
            + line(done=True, done_reason=["stop"], prompt_eval_count=-1, eval_count=2**64)
        )
        events = Events()
        yield self.adapter({"/api/chat": Script(chunks=[body])}).execute(RunInput("r1", target="m"), events)
        self.assertEqual(events.types(), ["start", "reasoning_delta", "delta", "tool_call", "complete"])
        self.assertEqual((events.text("reasoning_delta"), events.text()), ("hm\udc00", "Hel\ud83d"))
        tool_call = events.events[3].tool_call
        assert tool_call is not None
        self.assertEqual((tool_call.name, tool_call.arguments), ("f\ufffd", '{"a": "\ufffd"}'))
        self.assertEqual((events.events[-1].finish_reason, events.events[-1].usage), ("tool_calls", Usage(0, 0)))
        events = Events()
        done = line(done=True, done_reason={"why": "stop"}, prompt_eval_count=2**63 - 1, eval_count=True)
        yield self.adapter({"/api/chat": Script(chunks=[line("a") + done])}).execute(RunInput("r1", target="m"), events)
        self.assertEqual((events.events[-1].finish_reason, events.events[-1].usage), ("stop", Usage(2**63 - 1, 0)))

    @defer.inlineCallbacks
    def settled(self, d):
        """
        The result of C{d} once it fired: within a second (for a provider
        that is held open, no deadline firing on the real clock first).
        """
        for _ in range(20):
            if d.called:
                break
            yield moment()
        self.assertTrue(d.called, "still waiting")
        return (yield d)

    @defer.inlineCallbacks
    def test_line_without_end_is_bounded(self):
        """
        A line that never ends is refused past the limit (as an SSE line
        is), while the provider holds the connection open: a run ends
        incomplete (provider_error 502 before start) and its connection is
        closed; a pull fails.
        """
        self.patch(streams, "JSON_BODY_LIMIT", 1024)
        script = Script(chunks=[line("Hel")], hold=True)
        events = Events()
        first = events.first("delta")
        d = self.adapter({"/api/chat": script}).execute(RunInput("r1", target="m"), events)
        yield first
        script.write(b"y" * 600, b"y" * 600)
        yield self.settled(d)
        self.assertEqual(events.types(), ["start", "delta", "error"])
        assert events.events[-1].error is not None
        self.assertEqual(events.events[-1].error.code, INCOMPLETE)
        yield script.closed_early
        events = Events()
        script = Script(chunks=[b"{" * 2000], hold=True)
        yield self.settled(self.adapter({"/api/chat": script}).execute(RunInput("r1", target="m"), events))
        assert events.events[-1].error is not None
        self.assertEqual((events.types(), events.events[-1].error.status), (["error"], 502))
        pull = Script(chunks=[b'{"status": "pulling manifest"}\n', b"{" * 2000], hold=True)
        d = self.adapter({"/api/pull": pull}).command("ollama_pull", {"model": "q"})
        error = yield self.assertFailure(self.settled(d), ProviderError)
        self.assertEqual(error.status, 502)
        yield pull.closed_early

    @defer.inlineCallbacks
    def test_embed_answer_of_the_wrong_shape(self):
        """
        An /api/embed answer that is JSON but not an object with a list of
        embeddings fails the tunnel as a broken answer (502), with nothing
        relayed, rather than with a TypeError; one that is not JSON is
        answered 502 as a failed answer of Ollama is (not an adapter
        error).
        """
        request = TunnelInput("t1", "POST", "/embeddings", body=b'{"model": "m", "input": "x"}')
        sink = TunnelRecorder()
        yield self.adapter({"/api/embed": Script(chunks=[b"<html>oops</html>"])}).tunnel(request, sink)
        self.assertEqual(sink.calls[0], ("status", 502))
        self.assertIn("not JSON", json.loads(sink.bodies[0])["error"]["message"])
        for body in (b"[1]", b'{"embeddings": 5}', b'"x"'):
            sink = TunnelRecorder()
            adapter = self.adapter({"/api/embed": Script(chunks=[body])})
            error = yield self.assertFailure(adapter.tunnel(request, sink), ProviderError)
            self.assertEqual((error.status, sink.calls), (502, []), body)
        sink = TunnelRecorder()
        answer = b'{"embeddings": [[0.5]], "prompt_eval_count": -1}'
        yield self.adapter({"/api/embed": Script(chunks=[answer])}).tunnel(request, sink)
        self.assertEqual(json.loads(sink.bodies[0])["usage"], {"prompt_tokens": 0, "total_tokens": 0})

    @defer.inlineCallbacks
    def test_cancel(self):
        """
        Cancelling a run mid-stream closes the connection to Ollama.
        """
        script = Script(chunks=[line("a")], hold=True)
        events = Events()
        first = events.first("delta")
        d = self.adapter({"/api/chat": script}).execute(RunInput("r1", target="m"), events)
        yield first
        d.cancel()
        yield self.assertFailure(d, defer.CancelledError)
        yield script.closed_early

    @defer.inlineCallbacks
    def test_list(self):
        """
        ollama_list returns the parsed GET /api/tags answer.
        """
        tags = {"models": [{"name": "qwen3:latest", "size": 1}]}
        script = Script(chunks=[json.dumps(tags).encode()])
        result = yield self.adapter({"/api/tags": script}).command("ollama_list", {})
        self.assertEqual(result, tags)
        self.assertEqual(script.requests[0][0], "GET")

    @defer.inlineCallbacks
    def test_model_commands(self):
        """
        show, pull and delete send the model in a JSON body with the right
        method; pull streams and answers its last status; delete's empty
        body is None.
        """
        show = Script(chunks=[b'{"details": {"family": "qwen3"}}'])
        pull = Script(chunks=[b'{"status": "success"}\n'])
        delete = Script()
        adapter = self.adapter({"/api/show": show, "/api/pull": pull, "/api/delete": delete})
        self.assertEqual((yield adapter.command("ollama_show", {"model": "q"})), {"details": {"family": "qwen3"}})
        self.assertEqual((yield adapter.command("ollama_pull", {"model": "q"})), {"status": "success"})
        self.assertIsNone((yield adapter.command("ollama_delete", {"model": "q"})))
        self.assertEqual((show.requests[0][0], show.json_body()), ("POST", {"model": "q"}))
        self.assertEqual(pull.json_body(), {"model": "q", "stream": True})
        self.assertEqual((delete.requests[0][0], delete.json_body()), ("DELETE", {"model": "q"}))

    @defer.inlineCallbacks
    def test_pull_progress(self):
        """
        A pull hands each of Ollama's status lines to C{progress} as it
        arrives (status, digest, total, completed), split across chunks or
        not, and answers the last one.
        """
        pull = Script(
            chunks=[
                b'{"status": "pulling manifest"}\n{"status": "pulling ab", "digest": "ab", "total": 10, "comp',
                b'leted": 4}\n{"status": "success"}\n',
            ]
        )
        adapter = self.adapter({"/api/pull": pull})
        updates: list[dict[str, Any]] = []
        result = yield adapter.command("ollama_pull", {"model": "q"}, updates.append)
        self.assertEqual(
            updates,
            [
                {"status": "pulling manifest"},
                {"status": "pulling ab", "digest": "ab", "total": 10, "completed": 4},
                {"status": "success"},
            ],
        )
        self.assertEqual(result, {"status": "success"})

    @defer.inlineCallbacks
    def test_pull_error_line(self):
        """
        An C{error} line in the pull stream fails the pull with its text.
        """
        pull = Script(
            chunks=[b'{"status": "pulling manifest"}\n{"error": "pull model manifest: file does not exist"}\n']
        )
        adapter = self.adapter({"/api/pull": pull})
        error = yield self.assertFailure(adapter.command("ollama_pull", {"model": "nope"}), ProviderError)
        self.assertIn("file does not exist", str(error))

    @defer.inlineCallbacks
    def test_command_needs_model(self):
        """
        A model command without args.model fails with a clear message.
        """
        adapter = OllamaAdapter("ollama", 1, {"base_url": "http://127.0.0.1:1"}, reactor)
        error = yield self.assertFailure(adapter.command("ollama_show", {}), ValueError)
        self.assertIn("args.model", str(error))


class MessageTests(TestCase):
    def test_tool_calls(self) -> None:
        """
        An assistant's function calls go to Ollama with their arguments as
        objects; a custom tool call (free-form input, which Ollama has no
        form for) is left out rather than sent as a nameless function.
        """
        message = {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}},
                {"id": "c2", "type": "custom", "custom": {"name": "grep", "input": "-r x"}},
            ],
        }
        self.assertEqual(
            _ollama_message(message),
            {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": {"a": 1}}}]},
        )
