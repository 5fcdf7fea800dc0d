"""
Tests for L{iop.adapters.vllm}: vLLM's usage breakdown and its C{models}
command, on top of the inherited OpenAI-compatible behaviour.
"""

import json

from twisted.internet import defer, reactor
from twisted.trial.unittest import TestCase
from zope.interface.verify import verifyObject

from iop.adapters.interface import IAdapter, NotSupported, RunInput
from iop.adapters.streams import ProviderError
from iop.adapters.test.providers import Events, Routes, Script, chunk, serve, sse
from iop.adapters.vllm import VLLMAdapter
from iop.run import Usage


class VLLMTests(TestCase):
    def adapter(self, resource):
        adapter = VLLMAdapter("vllm", 4, {"base_url": serve(self, resource) + "/v1"}, reactor)
        self.addCleanup(adapter.stop)
        return adapter

    def test_capabilities(self):
        """
        vLLM is a tunnel target and answers the models and probe commands.
        """
        adapter = VLLMAdapter("vllm", 4, {"base_url": "http://127.0.0.1:1/v1"}, reactor)
        self.assertTrue(verifyObject(IAdapter, adapter))
        self.assertEqual(adapter.type, "vllm")
        self.assertTrue(adapter.capabilities().tunnel)
        self.assertEqual(adapter.capabilities().commands, ("models", "probe"))
        self.assertRaises(NotSupported, adapter.command, "ollama_list", {})

    @defer.inlineCallbacks
    def test_usage_breakdown(self):
        """
        vLLM's reasoning_content deltas become reasoning_delta events, and
        its cached and reasoning token counts land in the Usage breakdown.
        """
        usage = {
            "prompt_tokens": 12,
            "completion_tokens": 9,
            "total_tokens": 21,
            "prompt_tokens_details": {"cached_tokens": 8},
            "completion_tokens_details": {"reasoning_tokens": 4},
        }
        script = Script(
            headers=[("Content-Type", "text/event-stream; charset=utf-8")],
            chunks=sse(chunk(reasoning="hmm"), chunk(content="ok", finish="stop"), chunk(usage=usage)),
        )
        events = Events()
        run = RunInput("r1", target="qwen", messages=[{"role": "user", "content": "hi"}])
        yield self.adapter(Routes({"/v1/chat/completions": script})).execute(run, events)
        self.assertEqual(events.types(), ["start", "reasoning_delta", "delta", "complete"])
        self.assertEqual(events.events[-1].usage, Usage(12, 9, reasoning_tokens=4, cached_input_tokens=8))

    @defer.inlineCallbacks
    def test_usage_details_null(self):
        """
        vLLM sends prompt_tokens_details: null when prompt details are off;
        that is "not reported", so the breakdown stays None.
        """
        usage = {"prompt_tokens": 1, "completion_tokens": 2, "prompt_tokens_details": None}
        script = Script(headers=[("Content-Type", "text/event-stream")], chunks=sse(chunk(usage=usage)))
        events = Events()
        yield self.adapter(Routes({"/v1/chat/completions": script})).execute(RunInput("r1", target="q"), events)
        self.assertEqual(events.events[-1].usage, Usage(1, 2))

    @defer.inlineCallbacks
    def test_models(self):
        """
        The models command returns vLLM's parsed GET /v1/models answer.
        """
        listing = {"object": "list", "data": [{"id": "qwen", "object": "model", "max_model_len": 32768}]}
        script = Script(headers=[("Content-Type", "application/json")], chunks=[json.dumps(listing).encode()])
        result = yield self.adapter(Routes({"/v1/models": script})).command("models", {})
        self.assertEqual(result, listing)
        self.assertEqual(script.requests[0][:2], ("GET", "/v1/models"))

    @defer.inlineCallbacks
    def test_models_error(self):
        """
        A failing models request fails the command with the provider's
        message and status.
        """
        script = Script(status=503, chunks=[b'{"message": "loading"}'])
        adapter = self.adapter(Routes({"/v1/models": script}))
        error = yield self.assertFailure(adapter.command("models", {}), ProviderError)
        self.assertEqual((error.message, error.status), ("loading", 503))
