"""
Tests for L{iop.adapters.openai_compat} against scripted providers on
loopback sockets.
"""

import gzip
import json
import zlib
from typing import Any

from twisted.internet import defer, reactor
from twisted.internet.task import Clock
from twisted.trial.unittest import TestCase
from twisted.web.http_headers import Headers
from zope.interface.verify import verifyObject

from iop.adapters import openai_compat
from iop.adapters.interface import AdapterConfigError, IAdapter, RunInput, TunnelInput
from iop.adapters.openai_compat import OpenAICompatAdapter, TunnelObserver
from iop.adapters.streams import ProviderError, ProviderUnreachable
from iop.adapters.test.providers import Events, Script, chunk, closed_port, serve, sse
from iop.run import RunFailure, ToolCall, Usage
from iop.testing.tunnels import TunnelRecorder

SSE_HEADERS = [("Content-Type", "text/event-stream")]


def run_input(text="hello there", **kwargs):
    return RunInput(run_id="r1", target="m", messages=[{"role": "user", "content": text}], **kwargs)


class OpenAICompatTestCase(TestCase):
    adapter_class = OpenAICompatAdapter

    def adapter(self, resource=None, base_url=None, **options):
        if base_url is None:
            base_url = serve(self, resource) + "/v1"
        adapter = self.adapter_class("p", 2, dict(options, base_url=base_url), reactor)
        self.addCleanup(adapter.stop)
        return adapter


class ExecuteTests(OpenAICompatTestCase):
    def test_interface(self):
        """
        The adapter provides IAdapter and declares tunnel support.
        """
        adapter = self.adapter(base_url="http://127.0.0.1:1/v1")
        self.assertTrue(verifyObject(IAdapter, adapter))
        self.assertTrue(adapter.capabilities().tunnel)
        self.assertEqual(adapter.capabilities().max_concurrency, 2)

    @defer.inlineCallbacks
    def test_tool_calls_and_finish_reason(self):
        """
        Tool calls streamed in pieces (id and name first, arguments in
        parts) become one C{tool_call} event each, whole; the provider's
        finish reason rides on C{complete}. The request carries the run's
        tool messages and images in OpenAI's form.
        """
        pieces = [
            {
                "choices": [
                    {
                        "index": 0,
                        "delta": {
                            "tool_calls": [{"index": 0, "id": "c1", "function": {"name": "f", "arguments": '{"a"'}}]
                        },
                    }
                ]
            },
            {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}}]},
            {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
        ]
        script = Script(
            headers=SSE_HEADERS,
            chunks=[b"".join(b"data: " + json.dumps(p).encode() + b"\n\n" for p in pieces) + b"data: [DONE]\n\n"],
        )
        messages: list[dict[str, Any]] = [
            {"role": "user", "content": "look", "images": ["data:image/png;base64,AA"]},
            {"role": "tool", "content": "42", "tool_call_id": "c0"},
        ]
        events = Events()
        yield self.adapter(script).execute(RunInput(run_id="r1", target="m", messages=messages), events)
        self.assertEqual(events.types(), ["start", "tool_call", "complete"])
        call = events.events[1].tool_call
        assert call is not None
        self.assertEqual((call.id, call.name, call.arguments), ("c1", "f", '{"a": 1}'))
        self.assertEqual(events.events[-1].finish_reason, "tool_calls")
        sent = script.json_body()["messages"]
        self.assertEqual(
            sent[0]["content"],
            [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}],
        )
        self.assertEqual(sent[1], {"role": "tool", "content": "42", "tool_call_id": "c0"})

    @defer.inlineCallbacks
    def test_refusal_is_text(self):
        """
        A model's refusal (streamed C{delta.refusal}, or a whole answer's
        C{message.refusal}) is the run's answer text, not an empty one.
        """
        streamed = sse({"choices": [{"index": 0, "delta": {"refusal": "I can't help"}, "finish_reason": "stop"}]})
        whole = json.dumps({"choices": [{"index": 0, "message": {"content": None, "refusal": "No."}}]}).encode()
        for headers, chunks, text in (
            (SSE_HEADERS, streamed, "I can't help"),
            ([("content-type", "application/json")], [whole], "No."),
        ):
            events = Events()
            yield self.adapter(Script(headers=headers, chunks=chunks)).execute(run_input(), events)
            self.assertEqual([(e.type, e.text) for e in events.events if e.type == "delta"], [("delta", text)])
            self.assertEqual(events.types()[-1], "complete")

    @defer.inlineCallbacks
    def test_tool_calls_bounded(self):
        """
        Tool calls streaming more than MAX_TOOL_CALL_CHARS of arguments are
        a broken answer (they could not be sent, and would grow without
        bound): the run fails, not holding them (before any event: the
        calls go out only at the answer's end).
        """
        self.patch(openai_compat, "MAX_TOOL_CALL_CHARS", 10)
        piece = {
            "choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "123456"}}]}}]
        }
        script = Script(headers=SSE_HEADERS, chunks=[b"data: " + json.dumps(piece).encode() + b"\n\n"] * 2)
        events = Events()
        yield self.adapter(script).execute(RunInput(run_id="r1", target="m", messages=[]), events)
        error = events.events[-1].error
        assert error is not None
        self.assertEqual((events.types(), error.code), (["error"], "provider_error"))
        self.assertIn("tool calls exceed 10 characters", error.message)

    @defer.inlineCallbacks
    def test_tool_call_ids_bounded(self):
        """
        The ids of streamed tool calls count toward MAX_TOOL_CALL_CHARS as
        their names and arguments do: calls that bring only long ids, each
        at a new index, are a broken answer, not held until the end. An id
        sent again with every piece of its call counts once.
        """
        self.patch(openai_compat, "MAX_TOOL_CALL_CHARS", 12)

        def body(calls):
            pieces = [{"choices": [{"index": 0, "delta": {"tool_calls": [call]}}]} for call in calls]
            return [*sse(*pieces, done=False), *sse(chunk(finish="tool_calls"))]

        events = Events()
        calls = [{"index": index, "id": "abcdefgh"} for index in range(3)]
        yield self.adapter(Script(headers=SSE_HEADERS, chunks=body(calls))).execute(run_input(), events)
        error = events.events[-1].error
        assert error is not None
        self.assertEqual((events.types(), error.code), (["error"], "provider_error"))
        self.assertIn("tool calls exceed 12 characters", error.message)
        events = Events()
        calls = [{"index": 0, "id": "abcdefgh", "function": {"arguments": digit}} for digit in "123"]
        yield self.adapter(Script(headers=SSE_HEADERS, chunks=body(calls))).execute(run_input(), events)
        self.assertEqual(events.types(), ["start", "tool_call", "complete"])
        tool_call = events.events[1].tool_call
        assert tool_call is not None
        self.assertEqual((tool_call.id, tool_call.arguments), ("abcdefgh", "123"))

    @defer.inlineCallbacks
    def test_tool_call_count_bounded(self):
        """
        An answer that streams more than MAX_TOOL_CALLS tool calls (pieces
        at ever new indices, even empty ones) is a broken answer: the
        calls it would hold until the end are bounded in number too.
        """
        self.patch(openai_compat, "MAX_TOOL_CALLS", 3)
        calls = [{"index": index} for index in range(4)]
        piece = {"choices": [{"index": 0, "delta": {"tool_calls": calls}}]}
        body = [b"data: " + json.dumps(piece).encode() + b"\n\n", *sse(chunk(finish="tool_calls"))]
        events = Events()
        yield self.adapter(Script(headers=SSE_HEADERS, chunks=body)).execute(
            RunInput(run_id="r1", target="m", messages=[]), events
        )
        error = events.events[-1].error
        assert error is not None
        self.assertEqual((events.types(), error.code), (["error"], "provider_error"))
        self.assertIn("more than 3 tool calls", error.message)

    @defer.inlineCallbacks
    def test_streaming_text(self):
        """
        A streamed completion becomes start, the non-empty content of a
        read as one delta, and complete; the request is the documented
        streaming chat request with the run's options, the API key and
        configured headers.
        """
        script = Script(
            headers=SSE_HEADERS,
            chunks=sse(chunk(content=""), chunk(content="Hel"), chunk(content="lo"), chunk(finish="stop")),
        )
        adapter = self.adapter(script, api_key="sk-1", headers={"X-Team": "a"})
        events = Events()
        yield adapter.execute(run_input(options={"temperature": 0.5}), events)
        self.assertEqual(events.types(), ["start", "delta", "complete"])
        self.assertEqual(events.text(), "Hello")
        self.assertIsNone(events.events[-1].usage)
        method, path, headers, _ = script.requests[0]
        self.assertEqual((method, path), ("POST", "/v1/chat/completions"))
        self.assertEqual(headers["authorization"], ["Bearer sk-1"])
        self.assertEqual(headers["x-team"], ["a"])
        self.assertEqual(
            script.json_body(),
            {
                "model": "m",
                "messages": [{"role": "user", "content": "hello there"}],
                "stream": True,
                "stream_options": {"include_usage": True},
                "temperature": 0.5,
            },
        )

    @defer.inlineCallbacks
    def test_trace_context_reaches_the_provider(self):
        """
        A run that carries a trace context sends it as the provider
        request's C{traceparent}, beside the configured headers; a run
        without one sends none.
        """
        trace = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
        script = Script(headers=SSE_HEADERS, chunks=sse(chunk(content="x"), chunk(finish="stop")))
        adapter = self.adapter(script, api_key="sk-1")
        run = run_input()
        run.traceparent = trace
        yield adapter.execute(run, Events())
        yield adapter.execute(run_input(), Events())
        traced, plain = script.requests[0][2], script.requests[1][2]
        self.assertEqual((traced["traceparent"], traced["authorization"]), ([trace], ["Bearer sk-1"]))
        self.assertNotIn("traceparent", plain)

    @defer.inlineCallbacks
    def test_reasoning(self):
        """
        delta.reasoning_content and delta.reasoning both become
        reasoning_delta events, in order with the content deltas.
        """
        script = Script(
            headers=SSE_HEADERS,
            chunks=sse(
                chunk(reasoning="Let me "),
                chunk(reasoning="think.", reasoning_key="reasoning"),
                chunk(content="Answer"),
            ),
        )
        events = Events()
        yield self.adapter(script).execute(run_input(), events)
        self.assertEqual(
            [(e.type, e.text) for e in events.events],
            [
                ("start", ""),
                ("reasoning_delta", "Let me think."),
                ("delta", "Answer"),
                ("complete", ""),
            ],
        )

    @defer.inlineCallbacks
    def test_usage_without_breakdown(self):
        """
        Usage without details gives input and output tokens and leaves
        the reasoning and cached counts None, not 0.
        """
        usage = {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}
        script = Script(headers=SSE_HEADERS, chunks=sse(chunk(content="x"), chunk(usage=usage)))
        events = Events()
        yield self.adapter(script).execute(run_input(), events)
        self.assertEqual(events.events[-1].usage, Usage(input_tokens=7, output_tokens=3))
        assert events.events[-1].usage is not None
        self.assertIsNone(events.events[-1].usage.reasoning_tokens)
        self.assertIsNone(events.events[-1].usage.cached_input_tokens)

    @defer.inlineCallbacks
    def test_usage_with_breakdown(self):
        """
        Reported reasoning and cached token counts are kept, including a
        reported 0.
        """
        usage = {
            "prompt_tokens": 7,
            "completion_tokens": 3,
            "completion_tokens_details": {"reasoning_tokens": 2},
            "prompt_tokens_details": {"cached_tokens": 0},
        }
        script = Script(headers=SSE_HEADERS, chunks=sse(chunk(content="x"), chunk(usage=usage)))
        events = Events()
        yield self.adapter(script).execute(run_input(), events)
        self.assertEqual(events.events[-1].usage, Usage(7, 3, reasoning_tokens=2, cached_input_tokens=0))

    @defer.inlineCallbacks
    def test_error_status(self):
        """
        A non-2xx answer ends the run with an error terminal carrying the
        provider's message and HTTP status; no start is emitted.
        """
        body = json.dumps({"error": {"message": "rate limited", "type": "rate_limit_error"}}).encode()
        script = Script(status=429, headers=[("Content-Type", "application/json")], chunks=[body])
        events = Events()
        yield self.adapter(script).execute(run_input(), events)
        self.assertEqual(events.types(), ["error"])
        self.assertEqual(events.events[0].error, RunFailure(code="provider_error", message="rate limited", status=429))

    @defer.inlineCallbacks
    def test_error_plain_body(self):
        """
        A non-JSON error body is the message as it is.
        """
        script = Script(status=502, chunks=[b"Bad Gateway"])
        events = Events()
        yield self.adapter(script).execute(run_input(), events)
        self.assertEqual(events.events[0].error, RunFailure("provider_error", "Bad Gateway", 502))

    @defer.inlineCallbacks
    def test_error_in_stream(self):
        """
        An error object inside a 2xx stream ends the run after what was
        already streamed, as C{incomplete}: never like a success.
        """
        script = Script(
            headers=SSE_HEADERS,
            chunks=sse(chunk(content="a"), {"error": {"message": "out of memory", "code": 500}}),
        )
        events = Events()
        yield self.adapter(script).execute(run_input(), events)
        self.assertEqual(events.types(), ["start", "delta", "error"])
        self.assertEqual(
            events.events[-1].error, RunFailure("incomplete", "the answer is incomplete: out of memory", 500)
        )

    @defer.inlineCallbacks
    def test_values_that_cannot_be_sent(self):
        """
        Only a string is a finish reason, and only an integer from 0 to
        2**63 - 1 a token count (what the wire and the run store carry):
        any other value is taken as not reported, never passed on; an
        in-band error's code is its status only when it is an HTTP status.
        """
        usage = {
            "prompt_tokens": -1,
            "completion_tokens": 2**64,
            "completion_tokens_details": {"reasoning_tokens": 2**63 - 1},
            "prompt_tokens_details": {"cached_tokens": True},
        }
        calls = [{"index": [0], "id": 5, "function": {"name": "f", "arguments": "{}"}}, "not a call"]
        script = Script(
            headers=SSE_HEADERS,
            chunks=sse(
                chunk(content="hi"),
                {"choices": [7, {"index": 0, "delta": {"tool_calls": calls}}]},
                chunk(finish=1, usage=usage),
            ),
        )
        events = Events()
        yield self.adapter(script).execute(run_input(), events)
        self.assertEqual(events.types(), ["start", "delta", "tool_call", "complete"])
        self.assertEqual(events.events[2].tool_call, ToolCall("call_0", "f", "{}"))
        self.assertEqual((events.events[-1].finish_reason, events.events[-1].usage), (None, Usage(0, 0, 2**63 - 1)))
        script = Script(headers=SSE_HEADERS, chunks=sse(chunk(content="a"), {"error": {"message": "x", "code": 2**40}}))
        events = Events()
        yield self.adapter(script).execute(run_input(), events)
        self.assertEqual(events.events[-1].error, RunFailure("incomplete", "the answer is incomplete: x", 0))

    @defer.inlineCallbacks
    def test_lone_surrogates(self):
        """
        Text with a lone UTF-16 surrogate (legal JSON, "\\ud83d": half of
        an emoji a server cut in two) cannot be sent as UTF-8: it gets
        U+FFFD in its place in tool calls, the finish reason and an error's
        message; a pair split between two pieces of a tool call's arguments
        is the character again. Text deltas keep it, for the Node to clean
        once a turn's text is joined (where a pair cut between two chunks
        comes out whole).
        """
        pieces = [
            {"index": 0, "id": "c\ud83d", "function": {"name": "f\udc00", "arguments": '{"e": "\ud83d'}},
            {"index": 0, "function": {"arguments": '\ude00"}'}},
        ]
        script = Script(
            headers=SSE_HEADERS,
            chunks=sse(
                chunk(reasoning="a\ud83d"),
                chunk(content="b\udc00c"),
                *({"choices": [{"index": 0, "delta": {"tool_calls": [piece]}}]} for piece in pieces),
                chunk(finish="stop\ud83d"),
            ),
        )
        self.assertIn(b"\\ud83d", b"".join(script.chunks))
        events = Events()
        yield self.adapter(script).execute(run_input(), events)
        self.assertEqual(
            [(e.type, e.text) for e in events.events[:3]],
            [("start", ""), ("reasoning_delta", "a\ud83d"), ("delta", "b\udc00c")],
        )
        self.assertEqual(events.events[3].tool_call, ToolCall("c\ufffd", "f\ufffd", '{"e": "\U0001f600"}'))
        self.assertEqual(events.events[-1].finish_reason, "stop\ufffd")
        script = Script(headers=SSE_HEADERS, chunks=sse(chunk(content="a"), {"error": {"message": "oom \ud83d"}}))
        events = Events()
        yield self.adapter(script).execute(run_input(), events)
        error = events.events[-1].error
        assert error is not None
        self.assertEqual(error.message, "the answer is incomplete: oom \ufffd")

    @defer.inlineCallbacks
    def test_unreachable(self):
        """
        A refused connection ends the run with a provider_unreachable error.
        """
        events = Events()
        yield self.adapter(base_url=closed_port(self) + "/v1").execute(run_input(), events)
        self.assertEqual(events.types(), ["error"])
        assert events.events[0].error is not None
        self.assertEqual(events.events[0].error.code, "provider_unreachable")

    @defer.inlineCallbacks
    def test_json_that_is_no_completion(self):
        """
        A 200 whose one JSON document is no chat completion (no
        C{choices}: an empty object, null, a framework's C{detail}) is a
        broken answer (502, which the Edge may place elsewhere), not an
        empty completion.
        """
        for body in (b"{}", b"null", b'{"detail": "Not Found"}', b"[]"):
            script = Script(headers=[("Content-Type", "application/json")], chunks=[body])
            events = Events()
            yield self.adapter(script).execute(run_input(), events)
            self.assertEqual(events.types(), ["error"], body)
            error = events.events[0].error
            assert error is not None
            self.assertEqual((error.code, error.status), ("provider_error", 502))
            self.assertIn("not a chat completion", error.message)

    @defer.inlineCallbacks
    def test_non_streamed_answer(self):
        """
        A server that ignores stream=true and answers one JSON completion
        still gives content, reasoning and usage events.
        """
        body = {
            "id": "x",
            "object": "chat.completion",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi", "reasoning_content": "r"}}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1},
        }
        script = Script(headers=[("Content-Type", "application/json")], chunks=[json.dumps(body).encode()])
        events = Events()
        yield self.adapter(script).execute(run_input(), events)
        self.assertEqual(
            [(e.type, e.text) for e in events.events],
            [("start", ""), ("reasoning_delta", "r"), ("delta", "Hi"), ("complete", "")],
        )
        self.assertEqual(events.events[-1].usage, Usage(1, 1))

    @defer.inlineCallbacks
    def test_cancel_mid_stream(self):
        """
        Cancelling after the stream started fails the Deferred with
        CancelledError, emits no terminal, and the provider sees its
        connection closed.
        """
        script = Script(headers=SSE_HEADERS, chunks=sse(chunk(content="first"), done=False), hold=True)
        events = Events()
        first = events.first("delta")
        d = self.adapter(script).execute(run_input(), events)
        yield first
        d.cancel()
        yield self.assertFailure(d, defer.CancelledError)
        yield script.closed_early
        self.assertEqual(events.types(), ["start", "delta"])

    @defer.inlineCallbacks
    def test_cancel_before_headers(self):
        """
        Cancelling while the provider has not answered at all also closes
        the provider connection.
        """
        script = Script(headers_only=True)
        events = Events()
        d = self.adapter(script).execute(run_input(), events)
        yield script.arrived
        d.cancel()
        yield self.assertFailure(d, defer.CancelledError)
        yield script.closed_early
        self.assertEqual(events.types(), [])


class IdleTimeoutTests(OpenAICompatTestCase):
    def stalled_adapter(self, script):
        adapter = self.adapter(script, idle_timeout_sec=30)
        adapter.clock = Clock()
        return adapter

    @defer.inlineCallbacks
    def test_silent_before_headers(self):
        """
        A provider that answers nothing for idle_timeout_sec ends the run
        with a provider_timeout error and sees its connection closed.
        """
        script = Script(headers_only=True)
        adapter = self.stalled_adapter(script)
        events = Events()
        d = adapter.execute(run_input(), events)
        yield script.arrived
        adapter.clock.advance(29)
        self.assertEqual(events.types(), [])
        adapter.clock.advance(1)
        yield d
        yield script.closed_early
        self.assertEqual(events.types(), ["error"])
        assert events.events[-1].error is not None
        self.assertEqual(events.events[-1].error.code, "provider_timeout")

    @defer.inlineCallbacks
    def test_stalls_mid_stream(self):
        """
        Each chunk restarts the idle timer; a stream that then stalls is
        closed and ends C{incomplete} (deadline C{idle}) after its deltas.
        """
        script = Script(headers=SSE_HEADERS, chunks=sse(chunk(content="first"), done=False), hold=True)
        adapter = self.stalled_adapter(script)
        events = Events()
        first = events.first("delta")
        d = adapter.execute(run_input(), events)
        yield first
        adapter.clock.advance(29)
        self.assertEqual(events.types(), ["start", "delta"])
        adapter.clock.advance(1)
        yield d
        yield script.closed_early
        self.assertEqual(events.types(), ["start", "delta", "error"])
        assert events.events[-1].error is not None
        self.assertEqual((events.events[-1].error.code, events.events[-1].error.deadline), ("incomplete", "idle"))

    def test_disabled_and_invalid(self):
        """
        idle_timeout_sec 0 disables the timer; a negative one is refused,
        naming the key.
        """
        self.assertIsNone(self.adapter(base_url="http://127.0.0.1:1/v1", idle_timeout_sec=0).deadlines.idle)
        error = self.assertRaises(
            AdapterConfigError,
            OpenAICompatAdapter,
            "p",
            1,
            {"base_url": "http://x/v1", "idle_timeout_sec": -1},
            reactor,
        )
        self.assertIn("idle_timeout_sec", str(error))


class TunnelTests(OpenAICompatTestCase):
    @defer.inlineCallbacks
    def test_passthrough(self):
        """
        The sink gets the status, the headers without hop-by-hop ones, and
        body bytes whose concatenation is exactly what the server wrote;
        usage and metadata are observed from the SSE on the side.
        """
        chunks = sse(
            chunk(content="Hi", model="served"),
            chunk(finish="stop", model="served"),
            chunk(usage={"prompt_tokens": 4, "completion_tokens": 1}, model="served"),
        )
        chunks.insert(1, b": comment with \xc3\xa9 bytes\n\n")
        script = Script(headers=SSE_HEADERS + [("X-Provider", "yes")], chunks=chunks)
        sink = TunnelRecorder()
        request = TunnelInput(
            tunnel_id="t1",
            method="POST",
            path="/chat/completions",
            headers=[
                ("Content-Type", "application/json"),
                ("Host", "edge"),
                ("Connection", "close"),
                ("X-Caller", "c"),
            ],
            body=b'{"model": "served", "stream": true}',
        )
        yield self.adapter(script, api_key="k").tunnel(request, sink)
        self.assertEqual(b"".join(sink.bodies), b"".join(chunks))
        self.assertEqual(sink.calls[0], ("status", 200))
        headers = dict((k.lower(), v) for k, v in sink.calls[1][1])
        self.assertEqual(headers["content-type"], "text/event-stream")
        self.assertEqual(headers["x-provider"], "yes")
        self.assertNotIn("transfer-encoding", headers)
        self.assertEqual(sink.of("usage"), [Usage(4, 1)])
        self.assertEqual(sink.of("metadata"), [{"model": "served", "finish_reason": "stop"}])
        method, path, sent, body = script.requests[0]
        self.assertEqual((method, path, body), ("POST", "/v1/chat/completions", request.body))
        self.assertEqual(sent["x-caller"], ["c"])
        self.assertEqual(sent["authorization"], ["Bearer k"])
        self.assertNotEqual(sent["host"], ["edge"])

    @defer.inlineCallbacks
    def test_caller_authorization_replaced(self):
        """
        A caller's Authorization (meant for the Edge) never reaches the
        provider: the adapter's api_key replaces it, and without one it is
        dropped. drop_headers removes more; the adapter's headers win.
        """
        request = TunnelInput(
            "t1",
            "GET",
            "/models",
            headers=[("Authorization", "Bearer caller"), ("X-Secret", "s"), ("X-Team", "caller"), ("X-Trace", "t")],
        )
        script = Script(chunks=[b"{}"])
        adapter = self.adapter(script, api_key="k", drop_headers=["x-secret"], headers={"X-Team": "ops"})
        yield adapter.tunnel(request, TunnelRecorder())
        sent = script.requests[0][2]
        self.assertEqual((sent["authorization"], sent["x-team"], sent["x-trace"]), (["Bearer k"], ["ops"], ["t"]))
        self.assertNotIn("x-secret", sent)
        script = Script(chunks=[b"{}"])
        yield self.adapter(script).tunnel(request, TunnelRecorder())
        self.assertNotIn("authorization", script.requests[0][2])

    @defer.inlineCallbacks
    def test_json_body(self):
        """
        A non-streamed JSON answer is relayed as is; its usage is observed.
        """
        body = json.dumps(
            {
                "model": "m",
                "choices": [{"index": 0, "message": {"content": "x"}, "finish_reason": "length"}],
                "usage": {"prompt_tokens": 2, "completion_tokens": 5, "prompt_tokens_details": {"cached_tokens": 1}},
            }
        ).encode()
        script = Script(headers=[("Content-Type", "application/json")], chunks=[body[:10], body[10:]])
        sink = TunnelRecorder()
        yield self.adapter(script).tunnel(TunnelInput("t1", "POST", "/chat/completions", body=b"{}"), sink)
        self.assertEqual(b"".join(sink.bodies), body)
        self.assertEqual(sink.of("usage"), [Usage(2, 5, cached_input_tokens=1)])
        self.assertEqual(sink.of("metadata"), [{"model": "m", "finish_reason": "length"}])

    @defer.inlineCallbacks
    def test_error_status(self):
        """
        A non-2xx answer is relayed like any other: status, headers and the
        provider's own error body; nothing is observed and the Deferred
        succeeds.
        """
        body = b'{"error": {"message": "rate limited", "type": "rate_limit_error"}}'
        script = Script(status=429, headers=[("Content-Type", "application/json")], chunks=[body])
        sink = TunnelRecorder()
        yield self.adapter(script).tunnel(TunnelInput("t1", "POST", "/chat/completions", body=b"{}"), sink)
        self.assertEqual(sink.calls[0], ("status", 429))
        self.assertEqual(b"".join(sink.bodies), body)
        self.assertEqual(sink.of("usage"), [])

    @defer.inlineCallbacks
    def test_malformed_event_not_relayed(self):
        """
        A streamed event that is not JSON is never passed on: as the first
        event it fails the tunnel before anything reached the sink (not
        even the status), as a broken answer (502) the Edge may place
        elsewhere.
        """
        script = Script(headers=SSE_HEADERS, chunks=[b"data: {not json\n\n", b"data: [DONE]\n\n"])
        sink = TunnelRecorder()
        d = self.adapter(script).tunnel(TunnelInput("t1", "POST", "/chat/completions", body=b"{}"), sink)
        error = yield self.assertFailure(d, ProviderError)
        self.assertEqual((error.code, error.status), ("provider_error", 502))
        self.assertEqual(sink.calls, [])

    @defer.inlineCallbacks
    def test_deeply_nested_event_is_a_broken_answer(self):
        """
        An event nested deeper than Python can parse is as malformed as one
        that is not JSON, alone in its read or after a good event in a
        burst (which is relayed first): a broken answer, not an internal
        error from the parser's recursion.
        """
        nested = b"data: " + b"[" * 5000 + b"]" * 5000 + b"\n\n"
        for chunks, code, relayed in (
            ([nested], "provider_error", b""),
            ([b"data: {}\n\n" + nested + b"data: [DONE]\n\n"], "incomplete", b"data: {}\n\n"),
        ):
            sink = TunnelRecorder()
            d = self.adapter(Script(headers=SSE_HEADERS, chunks=chunks)).tunnel(
                TunnelInput("t1", "POST", "/chat/completions", body=b"{}"), sink
            )
            error = yield self.assertFailure(d, ProviderError)
            self.assertEqual((error.code, error.status), (code, 502))
            self.assertEqual(b"".join(sink.bodies), relayed)

    @defer.inlineCallbacks
    def test_unreachable(self):
        """
        A refused connection fails the tunnel with ProviderUnreachable and
        nothing reaches the sink.
        """
        adapter = self.adapter(base_url=closed_port(self) + "/v1")
        sink = TunnelRecorder()
        yield self.assertFailure(adapter.tunnel(TunnelInput("t1", "GET", "/models"), sink), ProviderUnreachable)
        self.assertEqual(sink.calls, [])

    @defer.inlineCallbacks
    def test_cancel(self):
        """
        Cancelling a tunnel mid-body fails it with CancelledError and the
        provider sees its connection closed.
        """
        script = Script(headers=SSE_HEADERS, chunks=sse(chunk(content="first"), done=False), hold=True)
        sink = TunnelRecorder()
        d = self.adapter(script).tunnel(TunnelInput("t1", "POST", "/chat/completions", body=b"{}"), sink)
        yield sink.first_body
        d.cancel()
        yield self.assertFailure(d, defer.CancelledError)
        yield script.closed_early


class GzipTunnelTests(OpenAICompatTestCase):
    @defer.inlineCallbacks
    def test_gzip_relayed_and_observed(self):
        """
        A gzip body (the caller asked for it) is relayed compressed, byte
        for byte with its Content-Encoding, and its usage is still observed.
        """
        plain = b'{"model": "m", "choices": [{"finish_reason": "stop"}], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}'
        body = gzip.compress(plain)
        script = Script(
            chunks=[body[:10], body[10:]], headers=[("content-encoding", "gzip"), ("content-type", "application/json")]
        )
        sink = TunnelRecorder()
        request = TunnelInput("t1", "POST", "/chat/completions", headers=[("Accept-Encoding", "gzip")], body=b"{}")
        yield self.adapter(script).tunnel(request, sink)
        self.assertEqual(b"".join(sink.bodies), body)
        headers = dict((k.lower(), v) for k, v in sink.calls[1][1])
        self.assertEqual(headers["content-encoding"], "gzip")
        self.assertEqual(sink.of("usage"), [Usage(3, 2)])
        self.assertEqual(script.requests[0][2]["accept-encoding"], ["gzip"])


class UsageAlwaysTests(OpenAICompatTestCase):
    def request(self, body):
        return TunnelInput("t1", "POST", "/chat/completions", [("Content-Type", "application/json")], body)

    @defer.inlineCallbacks
    def test_asks_and_strips(self):
        """
        With C{usage: always}, a streamed chat completion whose caller did
        not ask for usage asks the provider for it; the usage is observed
        (counted), and the usage-only chunk is taken out of the bytes the
        caller gets, which are otherwise the provider's own.
        """
        usage = chunk(usage={"prompt_tokens": 4, "completion_tokens": 2})
        usage["choices"] = []
        chunks = sse(chunk(content="Hi"), chunk(finish="stop"), usage)
        script = Script(headers=SSE_HEADERS, chunks=chunks)
        sink = TunnelRecorder()
        yield self.adapter(script, usage="always").tunnel(
            self.request(b'{"model": "m", "stream": true, "stream_options": {"x": 1}}'), sink
        )
        sent = script.json_body()
        self.assertEqual(sent["stream_options"], {"x": 1, "include_usage": True})
        self.assertEqual(b"".join(sink.bodies), chunks[0] + chunks[1] + chunks[3])
        self.assertEqual(sink.of("usage"), [Usage(4, 2)])

    @defer.inlineCallbacks
    def test_caller_asked(self):
        """
        A caller who asked for usage gets its request and the bytes as
        they are; so does a request that is not streamed.
        """
        usage = chunk(usage={"prompt_tokens": 4, "completion_tokens": 2})
        usage["choices"] = []
        chunks = sse(chunk(content="Hi"), usage)
        for body in (b'{"stream": true, "stream_options": {"include_usage": true}}', b'{"stream": false}'):
            script = Script(headers=SSE_HEADERS, chunks=chunks)
            sink = TunnelRecorder()
            yield self.adapter(script, usage="always").tunnel(self.request(body), sink)
            self.assertEqual(script.requests[0][3], body)
            self.assertEqual(b"".join(sink.bodies), b"".join(chunks))

    @defer.inlineCallbacks
    def test_default_as_asked(self):
        """
        Without the option nothing is added or taken out.
        """
        script = Script(headers=SSE_HEADERS, chunks=sse(chunk(content="Hi")))
        yield self.adapter(script).tunnel(self.request(b'{"stream": true}'), TunnelRecorder())
        self.assertEqual(script.requests[0][3], b'{"stream": true}')

    def test_bad_value(self):
        """
        Any other value is a configuration error naming the key.
        """
        error = self.assertRaises(AdapterConfigError, self.adapter, base_url="http://x/v1", usage="sometimes")
        self.assertIn("usage", str(error))

    @defer.inlineCallbacks
    def test_strip_whatever_the_split(self):
        """
        The usage-only event is taken out whatever the pieces the body
        comes in, with either line ending; other events pass unchanged.
        """
        usage = b'data: {"choices": [], "usage": {"prompt_tokens": 1}}\r\n\r\n'
        body = b'data: {"choices": [{"delta": {}}]}\n\n' + usage + b"data: [DONE]\n\n"
        for size in (1, 3, 7, len(body)):
            script = Script(headers=SSE_HEADERS, chunks=[body[i : i + size] for i in range(0, len(body), size)])
            sink = TunnelRecorder()
            yield self.adapter(script, usage="always").tunnel(self.request(b'{"model": "m", "stream": true}'), sink)
            self.assertEqual(b"".join(sink.bodies), body.replace(usage, b""))


class ObserverTests(OpenAICompatTestCase):
    @defer.inlineCallbacks
    def test_usage_found_whatever_the_split(self):
        """
        The tunnel observer finds the model, the finish reason and the
        usage of a stream however its bytes are split (events cut anywhere,
        CRLF or LF separators), while relaying every byte unchanged.
        """
        events = [chunk(content="a" * 5) for _ in range(50)] + [
            chunk(finish="length"),
            chunk(usage={"prompt_tokens": 3, "completion_tokens": 50}),
        ]
        body = b"".join(sse(*events))
        for size in (1, 7, 64, len(body)):
            for crlf in (False, True):
                data = body.replace(b"\n", b"\r\n") if crlf else body
                script = Script(headers=SSE_HEADERS, chunks=[data[i : i + size] for i in range(0, len(data), size)])
                sink = TunnelRecorder()
                request = TunnelInput("t1", "POST", "/chat/completions", headers=[], body=b"{}")
                yield self.adapter(script).tunnel(request, sink)
                self.assertEqual(b"".join(sink.bodies), data)
                self.assertEqual(sink.of("usage"), [Usage(3, 50)], (size, crlf))
                self.assertEqual(sink.of("metadata"), [{"model": "m", "finish_reason": "length"}], (size, crlf))


class _Response:
    """
    Just enough of an C{IResponse} for a L{TunnelObserver}.
    """

    code = 200

    def __init__(self, **headers: str) -> None:
        self.headers = Headers({k.replace("_", "-").encode(): [v.encode()] for k, v in headers.items()})


class ObserverLimitTests(TestCase):
    def test_event_without_end_is_not_held(self):
        """
        A gzip event stream (relayed as it comes) whose text has no blank
        line: past the limit the observer gives up and holds nothing more,
        however much follows; what it saw before is still reported.
        """
        self.patch(openai_compat, "JSON_BODY_LIMIT", 1024)
        sink = TunnelRecorder()
        response = _Response(content_type="text/event-stream", content_encoding="gzip")
        observer = TunnelObserver(sink, response)  # type: ignore[arg-type]
        deflate = zlib.compressobj(6, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
        first = b'data: {"model": "m", "usage": {"prompt_tokens": 1, "completion_tokens": 2}}\n\n'
        observer.feed(deflate.compress(first) + deflate.flush(zlib.Z_SYNC_FLUSH))
        for _ in range(4):
            observer.feed(deflate.compress(b"data: " + b"x" * 500) + deflate.flush(zlib.Z_SYNC_FLUSH))
        self.assertTrue(observer.broken)
        self.assertEqual(observer.tail, b"")
        for _ in range(4):
            observer.feed(deflate.compress(b"y" * 4096) + deflate.flush(zlib.Z_SYNC_FLUSH))
        self.assertEqual(observer.tail, b"")
        observer.finish()
        self.assertEqual((sink.of("usage"), sink.of("metadata")), ([Usage(1, 2)], [{"model": "m"}]))

    def test_chunks_of_the_wrong_shape(self):
        """
        What the observer cannot read says nothing and fails nothing:
        choices that are not a list, a finish reason that is not a string,
        token counts out of range.
        """
        sink = TunnelRecorder()
        observer = TunnelObserver(sink, _Response(content_type="text/event-stream"))  # type: ignore[arg-type]
        observer.chunk({"model": "m", "choices": 5})
        observer.chunk({"model": 7, "choices": [7, {"finish_reason": 1}, {"finish_reason": ["stop"]}]})
        observer.chunk({"choices": "stop", "usage": {"prompt_tokens": -1, "completion_tokens": 2**64}})
        observer.finish()
        self.assertEqual((sink.of("usage"), sink.of("metadata")), ([Usage(0, 0)], [{"model": "m"}]))
