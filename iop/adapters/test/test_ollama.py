"""
Tests for L{iop.adapters.ollama}: the native NDJSON chat stream and the
model commands.
"""

import json
from typing import Any

from twisted.internet import defer, reactor
from twisted.trial.unittest import TestCase
from zope.interface.verify import verifyObject

from iop.adapters.interface import IAdapter, NotSupported, RunInput, TunnelInput
from iop.adapters.ollama import OllamaAdapter
from iop.adapters.streams import ProviderError
from iop.adapters.test.providers import Events, Routes, Script, serve
from iop.run import RunFailure, Usage


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
