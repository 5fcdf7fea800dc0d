"""
The adapters against C{tests/support/fake_providers.py}, the fake back ends the
multi-process tests use: this proves the fakes speak the protocols the
adapters expect, and that a tunnel relays exactly the bytes a direct
request gets. Skipped when the source tree's C{tests/} is not there.
"""

import json
import os
import sys
from io import BytesIO

from twisted.internet import defer, reactor
from twisted.internet.protocol import ProcessProtocol
from twisted.trial.unittest import SkipTest, TestCase
from twisted.web.client import Agent, FileBodyProducer, HTTPConnectionPool, readBody
from twisted.web.http_headers import Headers

from iop.adapters.interface import RunInput, TunnelInput
from iop.adapters.ollama import OllamaAdapter
from iop.adapters.openai_compat import OpenAICompatAdapter
from iop.adapters.test.providers import Events
from iop.adapters.vllm import VLLMAdapter
from iop.run import Usage
from iop.testing.tunnels import TunnelRecorder

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "..", "tests", "support", "fake_providers.py")


class _Fake(ProcessProtocol):
    """
    Reads the fake's stdout: its port, and the lines it logs.
    """

    def __init__(self) -> None:
        self.port: defer.Deferred[int] = defer.Deferred()
        self.ended: defer.Deferred[None] = defer.Deferred()
        self.buffer = b""
        self.waiting: list[tuple[str, defer.Deferred[str]]] = []

    def outReceived(self, data):
        self.buffer += data
        while b"\n" in self.buffer:
            line, self.buffer = self.buffer.split(b"\n", 1)
            text = line.decode()
            if text.startswith("PORT ") and not self.port.called:
                self.port.callback(int(text.split()[1]))
            for prefix, d in list(self.waiting):
                if text.startswith(prefix):
                    self.waiting.remove((prefix, d))
                    d.callback(text)

    def line(self, prefix):
        """
        A Deferred firing with the next stdout line starting with C{prefix}.
        """
        d: defer.Deferred[str] = defer.Deferred()
        self.waiting.append((prefix, d))
        return d

    def processEnded(self, reason):
        if not self.port.called:
            self.port.errback(reason)
        self.ended.callback(None)


class FakeProviderTestCase(TestCase):
    kind: str = ""

    # (trial waits on a setUp that returns a Deferred; unittest's type says None.)
    @defer.inlineCallbacks
    def setUp(self):  # type: ignore[override]
        if not os.path.exists(SCRIPT):
            raise SkipTest("tests/support/fake_providers.py is not in this tree")
        self.fake = _Fake()
        port_file = os.path.abspath(self.mktemp())
        args = [sys.executable, SCRIPT, self.kind, "--port-file", port_file, "--delay-ms", "20"]
        process = reactor.spawnProcess(self.fake, sys.executable, args, env=dict(os.environ))

        def stop():
            process.signalProcess("KILL")
            return self.fake.ended

        self.addCleanup(stop)
        port = yield self.fake.port
        with open(port_file) as f:
            self.assertEqual(int(f.read()), port)
        self.root = f"http://127.0.0.1:{port}"

    def adapter(self, cls, path=""):
        adapter = cls("fake", 4, {"base_url": self.root + path}, reactor)
        self.addCleanup(adapter.stop)
        return adapter

    @defer.inlineCallbacks
    def direct(self, method, path, body=None):
        """
        The body of a plain request, without any adapter in the way.
        """
        pool = HTTPConnectionPool(reactor, persistent=False)
        agent = Agent(reactor, pool=pool)
        producer = None if body is None else FileBodyProducer(BytesIO(body))
        response = yield agent.request(method, (self.root + path).encode(), Headers(), producer)
        data = yield readBody(response)
        return response.code, data

    @defer.inlineCallbacks
    def stats(self):
        code, body = yield self.direct(b"GET", "/_stats")
        return json.loads(body)


CHAT = (
    b'{"model": "fake-model", "stream": true, "stream_options": {"include_usage": true}, '
    b'"messages": [{"role": "user", "content": "tunnel these exact bytes"}]}'
)


class OpenAIFakeTests(FakeProviderTestCase):
    kind = "openai"

    @defer.inlineCallbacks
    def test_tunnel_bytes_equal_direct(self):
        """
        The tunnel relays byte for byte what a direct request gets, and
        observes the usage (without a breakdown: this fake reports none).
        """
        code, direct = yield self.direct(b"POST", "/v1/chat/completions", CHAT)
        sink = TunnelRecorder()
        request = TunnelInput("t1", "POST", "/chat/completions", [("Content-Type", "application/json")], CHAT)
        yield self.adapter(OpenAICompatAdapter, "/v1").tunnel(request, sink)
        self.assertEqual(sink.of("status"), [code])
        self.assertEqual(b"".join(sink.bodies), direct)
        self.assertIn(b"data: [DONE]", direct)
        self.assertEqual(sink.of("usage"), [Usage(input_tokens=4, output_tokens=4)])

    @defer.inlineCallbacks
    def test_run_and_error(self):
        """
        A run echoes the message as deltas with usage; error-model is a
        429 provider_error with the fake's message.
        """
        adapter = self.adapter(OpenAICompatAdapter, "/v1")
        events = Events()
        yield adapter.execute(RunInput("r1", "fake-model", [{"role": "user", "content": "a b  c"}]), events)
        self.assertEqual(events.text(), "a b  c")
        self.assertEqual(events.events[-1].usage, Usage(3, 3))
        events = Events()
        yield adapter.execute(RunInput("r2", "error-model", [{"role": "user", "content": "x"}]), events)
        assert events.events[0].error is not None
        self.assertEqual(events.events[0].error.status, 429)
        self.assertEqual(events.events[0].error.message, "rate limited by fake")

    @defer.inlineCallbacks
    def test_cancel_seen_by_fake(self):
        """
        Cancelling a slow run is seen by the fake as a connection closed
        early, in its log and its /_stats.
        """
        adapter = self.adapter(OpenAICompatAdapter, "/v1")
        events = Events()
        first = events.first("delta")
        run = RunInput("r1", "slow-model", [{"role": "user", "content": "go"}], options={"max_tokens": 1000})
        d = adapter.execute(run, events)
        yield first
        closed = self.fake.line("CLOSED")
        d.cancel()
        yield self.assertFailure(d, defer.CancelledError)
        self.assertIn("early=true", (yield closed))
        stats = yield self.stats()
        self.assertEqual((stats["closed_early"], stats["active"], stats["max_active"]), (1, 0, 1))


class VLLMFakeTests(FakeProviderTestCase):
    kind = "vllm"

    @defer.inlineCallbacks
    def test_reasoning_and_breakdown(self):
        """
        The vLLM fake's reasoning_content comes out as reasoning_delta and
        its usage carries the cached and reasoning counts.
        """
        adapter = self.adapter(VLLMAdapter, "/v1")
        events = Events()
        yield adapter.execute(RunInput("r1", "fake-model", [{"role": "user", "content": "one two three four"}]), events)
        self.assertEqual(events.text("reasoning_delta"), "Thinking it over.")
        self.assertEqual(events.text(), "one two three four")
        self.assertEqual(events.events[-1].usage, Usage(4, 7, reasoning_tokens=3, cached_input_tokens=2))
        models = yield adapter.command("models", {})
        self.assertIn("fake-model", [m["id"] for m in models["data"]])


class OllamaFakeTests(FakeProviderTestCase):
    kind = "ollama"

    @defer.inlineCallbacks
    def test_chat_and_commands(self):
        """
        The Ollama fake streams thinking then content with a done line the
        adapter reads usage from, and answers the model commands.
        """
        adapter = self.adapter(OllamaAdapter)
        events = Events()
        yield adapter.execute(RunInput("r1", "fake-model", [{"role": "user", "content": "hi there"}]), events)
        self.assertEqual(events.text("reasoning_delta"), "Thinking it over.")
        self.assertEqual(events.text(), "hi there")
        self.assertEqual(events.events[-1].usage, Usage(2, 5))
        tags = yield adapter.command("ollama_list", {})
        self.assertIn("fake-model:latest", [m["name"] for m in tags["models"]])
        self.assertEqual((yield adapter.command("ollama_running", {})), {"models": []})
        self.assertEqual((yield adapter.command("ollama_show", {"model": "fake-model"}))["details"]["family"], "fake")
        self.assertEqual((yield adapter.command("ollama_pull", {"model": "fake-model"})), {"status": "success"})
        self.assertIsNone((yield adapter.command("ollama_delete", {"model": "fake-model"})))
