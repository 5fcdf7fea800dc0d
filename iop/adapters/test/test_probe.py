"""
The C{probe} node command of the HTTP adapters (is an ejected provider
back?) and the continuation of a partial answer (C{assistant_prefix}).
"""

from twisted.internet import defer, reactor
from twisted.internet.task import Clock
from twisted.trial.unittest import TestCase

from iop.adapters.interface import RunInput
from iop.adapters.ollama import OllamaAdapter
from iop.adapters.openai_compat import OpenAICompatAdapter
from iop.adapters.streams import PROBE_TIMEOUT_SEC
from iop.adapters.test.providers import Events, Routes, Script, Sequence, chunk, closed_port, serve, sse
from iop.adapters.vllm import VLLMAdapter
from iop.run import ASSISTANT_PREFIX_OPTION, PROBE_COMMAND

SSE_HEADERS = [("Content-Type", "text/event-stream")]


class ProbeTests(TestCase):
    def adapter(self, cls, resource=None, base_url=None, suffix="/v1"):
        base_url = base_url or serve(self, resource) + suffix
        adapter = cls("p", 1, {"base_url": base_url}, reactor)
        self.addCleanup(adapter.stop)
        return adapter

    @defer.inlineCallbacks
    def test_down_then_up(self):
        """
        An HTTP adapter declares probe; it GETs /models and answers ok
        false with the reason while the provider fails, ok true once it
        answers.
        """
        models = Sequence(Script(status=503, chunks=[b"loading"]), Script(chunks=[b'{"data": []}']))
        adapter = self.adapter(OpenAICompatAdapter, Routes({"/v1/models": models}))
        self.assertIn(PROBE_COMMAND, adapter.capabilities().commands)
        down = yield adapter.command(PROBE_COMMAND, {})
        self.assertEqual(down, {"ok": False, "reason": "provider_error: loading", "status": 503})
        up = yield adapter.command(PROBE_COMMAND, {})
        self.assertEqual(up, {"ok": True})

    @defer.inlineCallbacks
    def test_ollama_tags(self):
        """
        Ollama is probed on /api/tags, beside its model commands.
        """
        tags = Script(chunks=[b'{"models": []}'])
        adapter = self.adapter(OllamaAdapter, Routes({"/api/tags": tags}), suffix="")
        self.assertIn("ollama_list", adapter.capabilities().commands)
        result = yield adapter.command(PROBE_COMMAND, {})
        self.assertEqual(result, {"ok": True})
        self.assertEqual(tags.requests[0][:2], ("GET", "/api/tags"))

    @defer.inlineCallbacks
    def test_silent_and_unreachable(self):
        """
        A provider that does not answer within PROBE_TIMEOUT_SEC, or cannot
        be reached, is not ok; the probe never fails.
        """
        script = Script(headers_only=True)
        adapter = self.adapter(OpenAICompatAdapter, script)
        adapter.clock = Clock()
        d = adapter.command(PROBE_COMMAND, {})
        yield script.arrived
        adapter.clock.advance(PROBE_TIMEOUT_SEC)
        result = yield d
        self.assertEqual(result["ok"], False)
        self.assertIn("no answer", result["reason"])
        yield script.closed_early
        result = yield self.adapter(OpenAICompatAdapter, base_url=closed_port(self)).command(PROBE_COMMAND, {})
        self.assertEqual(result["ok"], False)
        self.assertIn("provider_unreachable", result["reason"])


class ContinuationTests(TestCase):
    def test_option_reported(self):
        """
        continuation (default false) is read and reported in the
        capabilities.
        """
        plain = OpenAICompatAdapter("p", 1, {"base_url": "http://x/v1"}, reactor)
        self.assertFalse(plain.capabilities().continuation)
        adapter = VLLMAdapter("p", 1, {"base_url": "http://x/v1", "continuation": True}, reactor)
        self.assertTrue(adapter.capabilities().continuation)
        self.assertTrue(adapter.capabilities().tunnel)

    @defer.inlineCallbacks
    def test_prefix_continued(self):
        """
        A run's assistant_prefix option becomes a final assistant message
        (never a provider parameter); vLLM is asked to continue it.
        """
        for cls, extra in ((OpenAICompatAdapter, {}), (VLLMAdapter, {"continue_final_message": True})):
            script = Script(headers=SSE_HEADERS, chunks=sse(chunk(content=" rest"), chunk(finish="stop")))
            adapter = cls("p", 1, {"base_url": serve(self, script) + "/v1", "continuation": True}, reactor)
            self.addCleanup(adapter.stop)
            run = RunInput(
                "r1", "m", [{"role": "user", "content": "go"}], options={ASSISTANT_PREFIX_OPTION: "the first"}
            )
            yield adapter.execute(run, Events())
            sent = script.json_body()
            self.assertEqual(sent["messages"][-1], {"role": "assistant", "content": "the first"})
            self.assertNotIn(ASSISTANT_PREFIX_OPTION, sent)
            for key, value in extra.items():
                self.assertEqual(sent[key], value)

    def test_ollama_prefix(self):
        """
        Ollama continues a final assistant message too.
        """
        adapter = OllamaAdapter("o", 1, {"base_url": "http://x"}, reactor)
        run = RunInput("r1", "m", [{"role": "user", "content": "go"}], options={ASSISTANT_PREFIX_OPTION: "half"})
        payload = adapter.chat_payload(run)
        self.assertEqual(payload["messages"][-1], {"role": "assistant", "content": "half"})
        self.assertNotIn(ASSISTANT_PREFIX_OPTION, payload.get("options", {}))
