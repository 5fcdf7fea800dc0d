"""
Every way a provider fails, against the real HTTP adapters: each fault a
scripted provider on a loopback socket, the adapter's deadlines on a
L{Clock}, for a normalized run and for a tunnel, streamed and not.

What must hold: a failure before anything reached the caller keeps its own
code (and nothing was relayed, not even a tunnel's status), so the Edge
can place the work elsewhere; a failure after it ends as C{incomplete},
never like a success; a malformed event is never passed on.
"""

import json

from twisted.internet import defer, reactor
from twisted.internet.task import Clock
from twisted.trial.unittest import TestCase

from iop.adapters import openai_compat
from iop.adapters.deadlines import FINISH_GRACE_SEC
from iop.adapters.interface import AdapterConfigError, RunInput, TunnelInput
from iop.adapters.openai_compat import OpenAICompatAdapter
from iop.adapters.streams import ProviderError
from iop.adapters.test.providers import Events, Script, chunk, moment, sse
from iop.adapters.test.test_openai_compat import SSE_HEADERS, OpenAICompatTestCase
from iop.run import CONTEXT_LENGTH_EXCEEDED, FIRST_BYTE, IDLE, INCOMPLETE, STALL, RunFailure, Usage
from iop.testing.tunnels import TunnelRecorder

#: The deadlines of the adapters under test (seconds).
FIRST = 10
STALL_SEC = 5
IDLE_SEC = 60

JSON_HEADERS = [("Content-Type", "application/json")]


def run_input(**kwargs):
    return RunInput(run_id="r1", target="m", messages=[{"role": "user", "content": "hi"}], **kwargs)


def streamed(stream=True):
    body = json.dumps({"model": "m", "messages": [], "stream": stream}).encode()
    return TunnelInput("t1", "POST", "/chat/completions", [("Content-Type", "application/json")], body)


def completion(text="whole answer"):
    return json.dumps(
        {
            "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 2},
        }
    ).encode()


def role_chunk():
    data = chunk()
    data["choices"][0]["delta"] = {"role": "assistant", "content": ""}
    return data


def event(data):
    """
    One SSE event of C{data} (a chunk, or any JSON value).
    """
    return b"data: " + json.dumps(data).encode() + b"\n\n"


def tool_piece(arguments, first=False):
    """
    A chunk with a piece of a streamed tool call: its id and name first.
    """
    function = {"name": "write_file", "arguments": arguments} if first else {"arguments": arguments}
    call = {"index": 0, "function": function, **({"id": "c1"} if first else {})}
    return {"choices": [{"index": 0, "delta": {"tool_calls": [call]}, "finish_reason": None}]}


#: Chunks that are JSON objects, but not of a chat completion's shape.
WRONG_SHAPES = [
    {"choices": 5},
    {"choices": [{"index": 0, "delta": "oops"}]},
    {"choices": [{"index": 0, "delta": {"tool_calls": 5}}]},
]


class FaultTestCase(OpenAICompatTestCase):
    timeout = 10

    def faulty(self, script):
        """
        An adapter on C{script} whose deadlines run on a L{Clock}.
        """
        adapter = self.adapter(
            script, first_byte_timeout_sec=FIRST, stall_timeout_sec=STALL_SEC, idle_timeout_sec=IDLE_SEC
        )
        adapter.clock = Clock()
        return adapter

    @defer.inlineCallbacks
    def run_on(self, script, before=None, advance=0, until=None):
        """
        Run on C{script}; once C{before} (a Deferred) fires, or the first
        event of type C{until} came, advance the clock by C{advance}.
        @return: the L{Events}.
        """
        adapter = self.faulty(script)
        events = Events()
        if until is not None:
            before = events.first(until)
        d = adapter.execute(run_input(), events)
        if before is not None:
            yield before
            yield moment()
            adapter.clock.advance(advance)
        yield d
        return events

    @defer.inlineCallbacks
    def tunnel_on(self, script, request, before=None, advance=0, after_body=False):
        """
        Tunnel C{request} to C{script} as L{run_on} does (C{after_body}:
        advance once the first body bytes were relayed). @return: the
        recorder and the tunnel's failure (C{None} if it succeeded).
        """
        adapter = self.faulty(script)
        sink = TunnelRecorder()
        if after_body:
            before = sink.first_body
        d = adapter.tunnel(request, sink)
        if before is not None:
            yield before
            yield moment()
            adapter.clock.advance(advance)
        try:
            yield d
        except ProviderError as e:
            return sink, e
        return sink, None


class RunFaultTests(FaultTestCase):
    @defer.inlineCallbacks
    def test_silent(self):
        """
        A provider that answers nothing misses first_byte_timeout_sec, not
        the idle timeout: provider_timeout (first_byte), nothing started,
        its connection closed.
        """
        script = Script(headers_only=True)
        events = yield self.run_on(script, script.arrived, FIRST)
        self.assertEqual(events.types(), ["error"])
        self.assertEqual(
            (events.events[0].error.code, events.events[0].error.deadline), ("provider_timeout", FIRST_BYTE)
        )
        yield script.closed_early

    @defer.inlineCallbacks
    def test_slow_first_token(self):
        """
        Headers, then no body: the headers do not count as the first byte.
        """
        script = Script(headers=SSE_HEADERS, chunks=[b""], hold=True)
        events = yield self.run_on(script, script.arrived, FIRST)
        self.assertEqual(events.types(), ["error"])
        self.assertEqual(events.events[0].error.deadline, FIRST_BYTE)

    @defer.inlineCallbacks
    def test_role_chunk_then_silence(self):
        """
        A first chunk that says nothing (the role) is not the answer: the
        stall deadline does not start, and the first-byte one fails the
        run before start (provider_timeout, first_byte).
        """
        script = Script(headers=SSE_HEADERS, chunks=sse(role_chunk(), done=False), hold=True)
        adapter = self.faulty(script)
        events = Events()
        d = adapter.execute(run_input(), events)
        yield script.arrived
        yield moment()
        adapter.clock.advance(STALL_SEC)
        self.assertNoResult(d)
        adapter.clock.advance(FIRST - STALL_SEC)
        yield d
        self.assertEqual(events.types(), ["error"])
        error = events.events[0].error
        assert error is not None
        self.assertEqual((error.code, error.deadline), ("provider_timeout", FIRST_BYTE))

    @defer.inlineCallbacks
    def test_keepalives_are_not_the_answer(self):
        """
        Keep-alive comments reset the idle deadline but do not meet the
        first-byte one; a tunnel holds them (and its status) until the
        answer's first event, so a provider that only pings fails before
        anything reached the caller.
        """
        script = Script(headers=SSE_HEADERS, chunks=[b": ping\n\n"], hold=True)
        sink, error = yield self.tunnel_on(script, streamed(), before=script.arrived, advance=FIRST)
        self.assertEqual((error.code, error.deadline), ("provider_timeout", FIRST_BYTE))
        self.assertEqual(sink.calls, [])

    @defer.inlineCallbacks
    def test_stall_mid_stream(self):
        """
        Silence past stall_timeout_sec after the answer began ends the run
        incomplete (stall), with the usage reported so far.
        """
        first = chunk(content="par", usage={"prompt_tokens": 3, "completion_tokens": 1})
        script = Script(headers=SSE_HEADERS, chunks=sse(first, done=False), hold=True)
        events = yield self.run_on(script, until="delta", advance=STALL_SEC)
        self.assertEqual(events.types(), ["start", "delta", "error"])
        error = events.events[-1].error
        assert error is not None
        self.assertEqual((error.code, error.deadline), (INCOMPLETE, STALL))
        self.assertEqual(events.events[-1].usage, Usage(3, 1))
        yield script.closed_early

    @defer.inlineCallbacks
    def test_cut_mid_stream(self):
        """
        A stream cut after a delta ends incomplete.
        """
        script = Script(headers=SSE_HEADERS, chunks=sse(chunk(content="par"), done=False), cut=True)
        events = yield self.run_on(script)
        self.assertEqual(events.types(), ["start", "delta", "error"])
        self.assertEqual(events.events[-1].error.code, INCOMPLETE)

    @defer.inlineCallbacks
    def test_cut_before_the_answer(self):
        """
        A stream cut before its first delta fails before start: a broken
        answer (provider_error 502), which the Edge may place elsewhere.
        """
        script = Script(headers=SSE_HEADERS, chunks=sse(role_chunk(), done=False), cut=True)
        events = yield self.run_on(script)
        self.assertEqual(events.types(), ["error"])
        self.assertEqual((events.events[0].error.code, events.events[0].error.status), ("provider_error", 502))

    @defer.inlineCallbacks
    def test_ended_without_done(self):
        """
        A stream that ends cleanly without [DONE] or a finish reason was
        cut: incomplete, never complete.
        """
        script = Script(headers=SSE_HEADERS, chunks=sse(chunk(content="par"), done=False))
        events = yield self.run_on(script)
        self.assertEqual(events.types(), ["start", "delta", "error"])
        self.assertEqual(events.events[-1].error.code, INCOMPLETE)

    @defer.inlineCallbacks
    def test_finished_without_done(self):
        """
        A stream that said it finished but neither sends [DONE] nor ends is
        ended as complete FINISH_GRACE_SEC after its last byte, its
        connection closed.
        """
        usage = chunk(usage={"prompt_tokens": 1, "completion_tokens": 1})
        script = Script(
            headers=SSE_HEADERS, chunks=sse(chunk(content="all"), chunk(finish="stop"), usage, done=False), hold=True
        )
        events = yield self.run_on(script, until="delta", advance=FINISH_GRACE_SEC)
        self.assertEqual(events.types(), ["start", "delta", "complete"])
        self.assertEqual((events.events[-1].finish_reason, events.events[-1].usage), ("stop", Usage(1, 1)))
        yield script.closed_early

    @defer.inlineCallbacks
    def test_finished_outlasts_the_stall_deadline(self):
        """
        Once the answer said it finished, the grace alone bounds what
        follows: a stall deadline shorter than the grace does not cut it.
        """
        script = Script(
            headers=SSE_HEADERS, chunks=sse(chunk(content="all"), chunk(finish="stop"), done=False), hold=True
        )
        adapter = self.adapter(script, stall_timeout_sec=1)
        adapter.clock = Clock()
        events = Events()
        delta = events.first("delta")
        d = adapter.execute(run_input(), events)
        yield delta
        yield moment()
        adapter.clock.advance(1)
        self.assertNoResult(d)
        adapter.clock.advance(FINISH_GRACE_SEC)
        yield d
        self.assertEqual(events.types(), ["start", "delta", "complete"])

    @defer.inlineCallbacks
    def test_connection_lost_after_the_end(self):
        """
        A stream whose connection breaks after the answer said it finished
        (its finish reason, usage and [DONE] all came; only the end of the
        chunked body did not) is whole: it completes, with its usage, as
        one that said it finished and then went silent does.
        """
        usage = chunk(usage={"prompt_tokens": 1, "completion_tokens": 1})
        for done in (True, False):
            chunks = sse(chunk(content="all"), chunk(finish="stop"), usage, done=done)
            events = yield self.run_on(Script(headers=SSE_HEADERS, chunks=chunks, cut=True))
            self.assertEqual(events.types(), ["start", "delta", "complete"])
            self.assertEqual((events.events[-1].finish_reason, events.events[-1].usage), ("stop", Usage(1, 1)))

    @defer.inlineCallbacks
    def test_malformed_event(self):
        """
        An event that is not JSON after a delta ends the run incomplete;
        as the first event it fails before start (502).
        """
        later = Script(headers=SSE_HEADERS, chunks=sse(chunk(content="a"), done=False) + [b"data: {nope\n\n"])
        events = yield self.run_on(later)
        self.assertEqual(events.types(), ["start", "delta", "error"])
        self.assertEqual(events.events[-1].error.code, INCOMPLETE)
        first = Script(headers=SSE_HEADERS, chunks=[b"data: {nope\n\n"])
        events = yield self.run_on(first)
        self.assertEqual(events.types(), ["error"])
        self.assertEqual(events.events[0].error.status, 502)

    @defer.inlineCallbacks
    def test_chunk_of_the_wrong_shape(self):
        """
        A chunk that is JSON but not of the expected shape (choices not a
        list, a delta that is not an object, tool_calls not a list) is a
        broken answer, as a malformed event: before start provider_error
        502, after it incomplete.
        """
        for bad in WRONG_SHAPES:
            events = yield self.run_on(Script(headers=SSE_HEADERS, chunks=sse(bad)))
            self.assertEqual(events.types(), ["error"], bad)
            self.assertEqual((events.events[0].error.code, events.events[0].error.status), ("provider_error", 502))
            events = yield self.run_on(Script(headers=SSE_HEADERS, chunks=sse(chunk(content="a"), bad)))
            self.assertEqual(events.types(), ["start", "delta", "error"], bad)
            self.assertEqual(events.events[-1].error.code, INCOMPLETE)

    @defer.inlineCallbacks
    def test_streamed_tool_call_is_the_answer(self):
        """
        A tool call streamed in pieces (emitted whole at the end) is the
        answer from its first piece: one that streams for longer than
        first_byte_timeout_sec completes, and nothing is emitted before
        the call.
        """
        script = Script(headers=SSE_HEADERS, chunks=[event(tool_piece('{"path": "a"', first=True))], hold=True)
        adapter = self.faulty(script)
        events = Events()
        d = adapter.execute(run_input(), events)
        yield script.arrived
        yield moment()
        for i in range(FIRST + 2):
            adapter.clock.advance(1)
            script.write(event(tool_piece(f', "x{i}": 1')))
            yield moment()
        self.assertNoResult(d)
        self.assertEqual(events.events, [])
        script.write(event(tool_piece("}")), event(chunk(finish="tool_calls")), b"data: [DONE]\n\n")
        yield moment()
        adapter.clock.advance(FINISH_GRACE_SEC)
        yield d
        self.assertEqual(events.types(), ["start", "tool_call", "complete"])
        arguments = '{"path": "a"' + "".join(f', "x{i}": 1' for i in range(FIRST + 2)) + "}"
        tool_call = events.events[1].tool_call
        assert tool_call is not None
        self.assertEqual(json.loads(tool_call.arguments), json.loads(arguments))

    @defer.inlineCallbacks
    def test_streamed_tool_call_then_stall(self):
        """
        Once a tool call began, the stall deadline bounds the silence after
        it; nothing reached the caller, so the failure keeps its code
        (provider_timeout, stall), and the Edge may place the run elsewhere.
        """
        script = Script(headers=SSE_HEADERS, chunks=[event(tool_piece('{"a": ', first=True))], hold=True)
        adapter = self.faulty(script)
        events = Events()
        d = adapter.execute(run_input(), events)
        yield script.arrived
        yield moment()
        adapter.clock.advance(STALL_SEC)
        yield moment()
        self.assertEqual(events.types(), ["error"])
        error = events.events[0].error
        assert error is not None
        self.assertEqual((error.code, error.deadline), ("provider_timeout", STALL))
        yield d
        yield script.closed_early

    @defer.inlineCallbacks
    def test_streamed_tool_call_ended_without_finish(self):
        """
        A stream that ends cleanly in the middle of a tool call, without a
        finish reason or [DONE], was cut: the call is never passed on
        half-made. Nothing reached the caller, so the run fails before
        start (provider_error 502) and the Edge may place it elsewhere.
        """
        script = Script(headers=SSE_HEADERS, chunks=[event(tool_piece('{"path": "a', first=True))])
        events = yield self.run_on(script)
        self.assertEqual(events.types(), ["error"])
        error = events.events[0].error
        assert error is not None
        self.assertEqual((error.code, error.status), ("provider_error", 502))

    @defer.inlineCallbacks
    def test_rate_limited(self):
        """
        A 429 says how long to wait (Retry-After) in retry_after_sec.
        """
        body = b'{"error": {"message": "slow down"}}'
        script = Script(status=429, headers=JSON_HEADERS + [("Retry-After", "7")], chunks=[body])
        events = yield self.run_on(script)
        self.assertEqual(events.events[0].error, RunFailure("provider_error", "slow down", 429, retry_after_sec=7.0))

    @defer.inlineCallbacks
    def test_server_error(self):
        """
        A 500 is the provider's error with its status, before start.
        """
        script = Script(status=500, chunks=[b"boom"])
        events = yield self.run_on(script)
        self.assertEqual(events.events[0].error, RunFailure("provider_error", "boom", 500))

    @defer.inlineCallbacks
    def test_context_length(self):
        """
        A 400 saying the prompt is longer than the context is
        context_length_exceeded (a larger model may take it); another 400
        stays the provider's error.
        """
        body = json.dumps(
            {"error": {"message": "This model's maximum context length is 4096 tokens", "code": None}}
        ).encode()
        events = yield self.run_on(Script(status=400, headers=JSON_HEADERS, chunks=[body]))
        self.assertEqual((events.events[0].error.code, events.events[0].error.status), (CONTEXT_LENGTH_EXCEEDED, 400))
        events = yield self.run_on(Script(status=400, headers=JSON_HEADERS, chunks=[b'{"error": {"message": "bad"}}']))
        self.assertEqual(events.events[0].error.code, "provider_error")

    @defer.inlineCallbacks
    def test_non_streamed_answer_too_large(self):
        """
        A whole JSON answer larger than the Node holds is a broken answer
        (502, as an event past the same bound is), before start.
        """
        self.patch(openai_compat, "JSON_BODY_LIMIT", 1024)
        body = completion("x" * 2048)
        events = yield self.run_on(Script(headers=JSON_HEADERS, chunks=[body]))
        self.assertEqual(events.types(), ["error"])
        error = events.events[0].error
        assert error is not None
        self.assertEqual((error.code, error.status), ("provider_error", 502))

    @defer.inlineCallbacks
    def test_non_streamed_answer_cut(self):
        """
        A provider that ignores stream=true and cuts its one JSON answer
        fails before start: the caller never gets part of it.
        """
        body = completion()
        script = Script(headers=JSON_HEADERS + [("Content-Length", str(len(body)))], chunks=[body[:20]], cut=True)
        events = yield self.run_on(script)
        self.assertEqual(events.types(), ["error"])
        self.assertEqual(events.events[0].error.code, "provider_error")


class StreamedTunnelFaultTests(FaultTestCase):
    @defer.inlineCallbacks
    def test_silent(self):
        """
        Silence before the first byte fails the tunnel (first_byte) with
        nothing relayed.
        """
        script = Script(headers_only=True)
        sink, error = yield self.tunnel_on(script, streamed(), script.arrived, FIRST)
        self.assertEqual((error.code, error.deadline), ("provider_timeout", FIRST_BYTE))
        self.assertEqual(sink.calls, [])

    @defer.inlineCallbacks
    def test_headers_then_silence(self):
        """
        The status and headers wait for the first event: a provider that
        sends them and nothing more fails the tunnel with nothing relayed.
        """
        script = Script(headers=SSE_HEADERS, chunks=[b""], hold=True)
        sink, error = yield self.tunnel_on(script, streamed(), script.arrived, FIRST)
        self.assertEqual(error.deadline, FIRST_BYTE)
        self.assertEqual(sink.calls, [])

    @defer.inlineCallbacks
    def test_cut_mid_stream(self):
        """
        A stream cut after an event: the event was relayed, whole; the
        tunnel fails incomplete, after the usage seen so far.
        """
        first = sse(chunk(content="a", usage={"prompt_tokens": 2, "completion_tokens": 1}), done=False)
        script = Script(headers=SSE_HEADERS, chunks=first + [b'data: {"choi'], cut=True)
        sink, error = yield self.tunnel_on(script, streamed())
        self.assertEqual(error.code, INCOMPLETE)
        self.assertEqual(b"".join(sink.bodies), first[0])
        self.assertEqual(sink.of("usage"), [Usage(2, 1)])
        self.assertEqual([call[0] for call in sink.calls], ["status", "headers", "body", "usage"])

    @defer.inlineCallbacks
    def test_stall_mid_stream(self):
        """
        A stream that stalls after an event fails incomplete (stall).
        """
        script = Script(headers=SSE_HEADERS, chunks=sse(chunk(content="a"), done=False), hold=True)
        _, error = yield self.tunnel_on(script, streamed(), advance=STALL_SEC, after_body=True)
        self.assertEqual((error.code, error.deadline), (INCOMPLETE, STALL))
        yield script.closed_early

    @defer.inlineCallbacks
    def test_malformed_event(self):
        """
        A malformed event is never passed on: what came before it was, and
        the tunnel fails incomplete.
        """
        good = sse(chunk(content="a"), done=False)
        script = Script(headers=SSE_HEADERS, chunks=good + [b"data: {nope\n\n", b"data: [DONE]\n\n"])
        sink, error = yield self.tunnel_on(script, streamed())
        self.assertEqual(error.code, INCOMPLETE)
        self.assertEqual(b"".join(sink.bodies), good[0])

    @defer.inlineCallbacks
    def test_error_event_mid_stream(self):
        """
        An error object after the first event is relayed, with what follows
        it, but ends the tunnel failed, as the run of the same stream ends:
        incomplete, with the error's message and status, after the usage
        seen so far.
        """
        good = sse(chunk(content="a", usage={"prompt_tokens": 2, "completion_tokens": 1}), done=False)
        error = b'data: {"error": {"message": "CUDA out of memory", "code": 500}}\n\n'
        for rest in ([], [b"data: [DONE]\n\n"]):
            script = Script(headers=SSE_HEADERS, chunks=good + [error] + rest)
            sink, failure = yield self.tunnel_on(script, streamed())
            self.assertEqual(b"".join(sink.bodies), b"".join(good + [error] + rest))
            self.assertEqual(
                failure.failure(), RunFailure(INCOMPLETE, "the answer is incomplete: CUDA out of memory", 500)
            )
            self.assertEqual(sink.of("usage"), [Usage(2, 1)])

    @defer.inlineCallbacks
    def test_events_of_the_wrong_shape(self):
        """
        Events that are JSON but of a shape the Node does not expect are
        relayed as they are: what the observer cannot read never fails the
        tunnel, and says nothing (a finish reason that is not a string).
        """
        events = [
            event({"model": "m", "choices": 5}),
            event({"type": ["x"], "choices": [{"finish_reason": 1}, 7], "usage": {"prompt_tokens": -1}}),
            event({"choices": [{"index": 0, "delta": "oops"}]}),
            b"data: [DONE]\n\n",
        ]
        for pieces in (events, [b"".join(events)]):
            sink, failure = yield self.tunnel_on(Script(headers=SSE_HEADERS, chunks=pieces), streamed())
            self.assertIsNone(failure)
            self.assertEqual(b"".join(sink.bodies), b"".join(events))
            self.assertEqual(sink.of("metadata"), [{"model": "m"}])
            self.assertEqual(sink.of("usage"), [Usage(0, 0)])

    @defer.inlineCallbacks
    def test_ended_without_done(self):
        """
        A stream that ends without [DONE] or a finish reason fails
        incomplete after what it relayed.
        """
        script = Script(headers=SSE_HEADERS, chunks=sse(chunk(content="a"), done=False))
        sink, error = yield self.tunnel_on(script, streamed())
        self.assertEqual(error.code, INCOMPLETE)

    @defer.inlineCallbacks
    def test_finished_without_done(self):
        """
        A stream that said it finished, then neither sends [DONE] nor ends,
        is ended after FINISH_GRACE_SEC: the tunnel succeeds.
        """
        chunks = sse(chunk(content="a"), chunk(finish="stop"), done=False)
        script = Script(headers=SSE_HEADERS, chunks=chunks, hold=True)
        sink, error = yield self.tunnel_on(script, streamed(), advance=FINISH_GRACE_SEC, after_body=True)
        self.assertIsNone(error)
        self.assertEqual(b"".join(sink.bodies), b"".join(chunks))
        self.assertEqual(sink.of("metadata"), [{"model": "m", "finish_reason": "stop"}])
        yield script.closed_early

    @defer.inlineCallbacks
    def test_connection_lost_after_the_end(self):
        """
        A stream whose connection breaks after [DONE] (the end of its
        chunked body lost) relayed the whole answer: the tunnel succeeds,
        with its usage. One that sent an error object still fails.
        """
        usage = chunk(usage={"prompt_tokens": 1, "completion_tokens": 1})
        chunks = sse(chunk(content="a"), chunk(finish="stop"), usage)
        sink, error = yield self.tunnel_on(Script(headers=SSE_HEADERS, chunks=chunks, cut=True), streamed())
        self.assertIsNone(error)
        self.assertEqual(b"".join(sink.bodies), b"".join(chunks))
        self.assertEqual(sink.of("usage"), [Usage(1, 1)])
        failed = sse(chunk(content="a"), {"error": {"message": "CUDA out of memory", "code": 500}})
        sink, error = yield self.tunnel_on(Script(headers=SSE_HEADERS, chunks=failed, cut=True), streamed())
        self.assertEqual(error.failure(), RunFailure(INCOMPLETE, "the answer is incomplete: CUDA out of memory", 500))

    @defer.inlineCallbacks
    def test_responses_stream_ends_with_its_event(self):
        """
        A Responses API stream has no [DONE]: its response.completed event
        says it finished.
        """
        events = [
            b'event: response.output_text.delta\ndata: {"type": "response.output_text.delta", "delta": "a"}\n\n',
            b'event: response.completed\ndata: {"type": "response.completed", "response": {}}\n\n',
        ]
        request = TunnelInput("t1", "POST", "/responses", [], b'{"stream": true}')
        sink, error = yield self.tunnel_on(Script(headers=SSE_HEADERS, chunks=events), request)
        self.assertIsNone(error)
        self.assertEqual(b"".join(sink.bodies), b"".join(events))


class WholeTunnelFaultTests(FaultTestCase):
    @defer.inlineCallbacks
    def test_held_until_complete(self):
        """
        A non-streamed answer reaches the sink only once complete: status,
        headers and body together.
        """
        body = completion()
        script = Script(headers=JSON_HEADERS, chunks=[body[:20]], hold=True)
        adapter = self.faulty(script)
        sink = TunnelRecorder()
        d = adapter.tunnel(streamed(False), sink)
        yield script.arrived
        yield moment()
        self.assertEqual(sink.calls, [])
        script.write(body[20:])
        assert script.held is not None
        script.held.finish()
        yield d
        self.assertEqual([c[0] for c in sink.calls], ["status", "headers", "body", "usage", "metadata"])
        self.assertEqual(b"".join(sink.bodies), body)

    @defer.inlineCallbacks
    def test_cut_mid_body(self):
        """
        A non-streamed answer cut mid-body fails the tunnel with nothing
        relayed (a broken answer, 502): never a 200 with part of a body.
        """
        body = completion()
        script = Script(headers=JSON_HEADERS + [("Content-Length", str(len(body)))], chunks=[body[:20]], cut=True)
        sink, error = yield self.tunnel_on(script, streamed(False))
        self.assertEqual((error.code, error.status), ("provider_error", 502))
        self.assertEqual(sink.calls, [])

    @defer.inlineCallbacks
    def test_stall_mid_body(self):
        """
        A non-streamed answer that stalls mid-body fails (stall), nothing
        relayed.
        """
        body = completion()
        script = Script(headers=JSON_HEADERS, chunks=[body[:20]], hold=True)
        sink, error = yield self.tunnel_on(script, streamed(False), before=script.arrived, advance=STALL_SEC)
        self.assertEqual((error.code, error.deadline), ("provider_timeout", STALL))
        self.assertEqual(sink.calls, [])

    @defer.inlineCallbacks
    def test_silent_is_bounded_by_idle(self):
        """
        A non-streamed answer has no first-byte deadline (its first byte is
        its last): only idle_timeout_sec bounds the wait.
        """
        script = Script(headers_only=True)
        adapter = self.faulty(script)
        sink = TunnelRecorder()
        d = adapter.tunnel(streamed(False), sink)
        yield script.arrived
        adapter.clock.advance(FIRST)
        self.assertNoResult(d)
        adapter.clock.advance(IDLE_SEC - FIRST)
        error = yield self.assertFailure(d, ProviderError)
        self.assertEqual((error.code, error.deadline), ("provider_timeout", IDLE))

    @defer.inlineCallbacks
    def test_failure_answers_say_what_they_are(self):
        """
        A 429 passes through as the provider wrote it, with a failure
        observation carrying its Retry-After; so does a context-length 400;
        another 400 has none.
        """
        body = b'{"error": {"message": "slow down"}}'
        script = Script(status=429, headers=JSON_HEADERS + [("Retry-After", "3")], chunks=[body])
        sink, error = yield self.tunnel_on(script, streamed())
        self.assertIsNone(error)
        self.assertEqual(b"".join(sink.bodies), body)
        self.assertEqual(
            sink.of("metadata"),
            [{"failure": {"code": "provider_error", "status": 429, "message": "slow down", "retry_after_sec": 3.0}}],
        )
        context = b'{"error": {"message": "too long", "code": "context_length_exceeded"}}'
        sink, _ = yield self.tunnel_on(Script(status=400, headers=JSON_HEADERS, chunks=[context]), streamed())
        self.assertEqual(sink.of("metadata")[0]["failure"]["code"], CONTEXT_LENGTH_EXCEEDED)
        sink, _ = yield self.tunnel_on(Script(status=400, headers=JSON_HEADERS, chunks=[b"{}"]), streamed())
        self.assertEqual(sink.of("metadata"), [])


class DeadlineOptionTests(TestCase):
    def test_defaults_and_disabled(self):
        """
        The defaults are 120 s to the first byte, 60 s of stall and 300 s
        idle; 0 disables each.
        """
        adapter = OpenAICompatAdapter("p", 1, {"base_url": "http://x/v1"}, reactor)
        self.assertEqual(
            (adapter.deadlines.first_byte, adapter.deadlines.stall, adapter.deadlines.idle), (120, 60, 300)
        )
        options = {"base_url": "http://x/v1", "first_byte_timeout_sec": 0, "stall_timeout_sec": 0}
        adapter = OpenAICompatAdapter("p", 1, options, reactor)
        self.assertEqual((adapter.deadlines.first_byte, adapter.deadlines.stall), (None, None))

    def test_invalid(self):
        """
        A negative or non-number deadline is refused at load, naming the key.
        """
        for key in ("first_byte_timeout_sec", "stall_timeout_sec"):
            for value in (-1, "5", True):
                error = self.assertRaises(
                    AdapterConfigError, OpenAICompatAdapter, "p", 1, {"base_url": "http://x/v1", key: value}, reactor
                )
                self.assertIn(f"adapters[p].{key}", str(error))
