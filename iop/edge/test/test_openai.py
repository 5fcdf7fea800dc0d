"""
The OpenAI surface as an OpenAI client sees it, through the whole gateway
in memory (L{iop.testing.gateway}): a tunnelled event stream cut mid-event,
C{n} on a normalized run, the type of an in-band error event, usage when
the back end reports none, the documented parameters checked, the
C{x-request-id} header, and the reason phrase of a 429.
"""

import copy
import json
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from iop.edge.errors import ServiceError
from iop.edge.http import openai
from iop.edge.http.common import EventStream
from iop.edge.http.openai import event_end
from iop.run import COMPLETE, DELTA, ERROR, PROVIDER_ERROR, START, RunEventData, RunFailure, Usage
from iop.testing import gateway
from iop.testing.gateway import GATEWAY_YAML, Gateway
from iop.testing.node import ManualAdapter

HI = [{"role": "user", "content": "hello there world"}]

#: A chunk of a provider's stream, as one SSE event.
CHUNK = b'data: {"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"hel"}}]}\n\n'


def events(body: bytes) -> list[str]:
    """
    The C{data:} payloads of an event stream (LF or CRLF lines).
    """
    text = body.decode().replace("\r\n", "\n")
    return [line[6:] for block in text.split("\n\n") for line in block.split("\n") if line.startswith("data: ")]


def config() -> dict[str, Any]:
    """
    The gateway's configuration with a normalized back end played by hand:
    the model group C{local} on an C{ollama} adapter (a L{ManualAdapter}
    here), which reports what the test says, usage or not.
    """
    data = copy.deepcopy(GATEWAY_YAML)
    node = data["nodes"][0]
    node["adapters"].append({"name": "local", "type": "ollama", "max_concurrency": 2, "base_url": "http://o.invalid"})
    node["providers"].append({"id": "local", "adapter": "local", "capacity": {"normal": 2, "long": 0}})
    data["model_groups"].append({"name": "local", "providers": [{"node": "n1", "provider": "local"}]})
    # A group of both kinds of provider: a tunnel or a normalized run.
    data["model_groups"].append(
        {"name": "mixed", "providers": [{"node": "n1", "provider": "llm"}, {"node": "n1", "provider": "local"}]}
    )
    return data


class OpenAITestCase(SynchronousTestCase):
    def setUp(self) -> None:
        self.patch(gateway, "GATEWAY_TYPES", dict(gateway.GATEWAY_TYPES, ollama=ManualAdapter))
        self.gateway = Gateway(config())
        self.node = self.gateway.node()

    def result(self, d: Any) -> tuple[int, Any, bytes]:
        return self.successResultOf(self.gateway.read(d))

    def chat(self, **body: Any) -> Any:
        return self.gateway.post("/v1/chat/completions", dict({"messages": HI}, **body))

    def error(self, d: Any) -> tuple[int, dict[str, Any]]:
        code, _, body = self.result(d)
        return code, json.loads(body)["error"]

    def tunnel(self) -> Any:
        """
        The sink of the latest tunnel to the provider C{llm}.
        """
        return self.node.adapter("llm").tunnels[-1][1]

    def manual_run(self) -> Any:
        """
        The latest run on C{local}: C{(RunInput, emit, Deferred)}.
        """
        return self.node.adapter("local").runs[-1]

    def fill(self, model: str = "talk") -> None:
        """
        Take both slots of C{model} with long streams.
        """
        words = [{"role": "user", "content": " ".join(f"w{i}" for i in range(200))}]
        for _ in range(2):
            self.gateway.post("/v1/chat/completions", {"model": model, "stream": True, "messages": words})


class TunnelledStreamTests(OpenAITestCase):
    def start(self) -> Any:
        d = self.chat(model="big", stream=True)
        sink = self.tunnel()
        sink.status(200)
        sink.headers([("content-type", "text/event-stream")])
        return d, sink

    def cut(self) -> None:
        self.node.session.close()
        self.gateway.flush()

    def test_cut_mid_event_drops_the_half(self) -> None:
        """
        A provider's stream cut after half an event: the caller gets the
        whole events, then the Edge's error event and C{[DONE]}, each event
        whole JSON (never half an event with the error glued to it).
        """
        d, sink = self.start()
        sink.body(CHUNK + b'data: {"id":"c1","object":"chat.comp')
        self.gateway.flush()
        self.cut()
        code, _, body = self.result(d)
        self.assertEqual(code, 200)
        self.assertTrue(body.startswith(CHUNK), body)
        *chunks, error, done = events(body)
        self.assertEqual(done, "[DONE]")
        self.assertEqual([json.loads(c)["choices"][0]["delta"]["content"] for c in chunks], ["hel"])
        self.assertEqual(json.loads(error)["error"]["code"], "node_disconnected")

    def test_crlf_events_split_across_writes(self) -> None:
        """
        Events may end with CRLF lines, and an event's blank line may be
        split between two body writes: the event is whole all the same, and
        only what follows it is dropped at the cut.
        """
        d, sink = self.start()
        first = CHUNK.replace(b"\n", b"\r\n")
        sink.body(first[:-1])
        sink.body(first[-1:] + b'data: {"half')
        self.gateway.flush()
        self.cut()
        body = self.result(d)[2]
        self.assertTrue(body.startswith(first), body)
        self.assertNotIn(b"half", body)
        self.assertEqual(
            [json.loads(e).get("error", {}).get("code") for e in events(body)[:-1]], [None, "node_disconnected"]
        )

    def test_clean_end_flushes_the_tail(self) -> None:
        """
        A stream the provider ends cleanly reaches the caller byte for
        byte, an unended last event included.
        """
        d, sink = self.start()
        sent = [CHUNK[:10], CHUNK[10:] + b"data: [DONE]", b"\n"]
        for part in sent:
            sink.body(part)
        self.node.adapter("llm").tunnels[-1][2].callback(None)
        self.gateway.flush()
        self.assertEqual(self.result(d)[2], b"".join(sent))

    def test_long_event_goes_through(self) -> None:
        """
        An event longer than the bound is not held whole: it goes out as it
        comes, and a cut then ends it before the error event.
        """
        self.patch(openai, "MAX_HELD_EVENT", 8)
        d, sink = self.start()
        sink.body(b"data: {")
        self.gateway.flush()
        request = self.gateway.requests[-1]
        self.assertFalse(request.startedWriting)
        sink.body(b'"long event')
        self.gateway.flush()
        self.assertTrue(request.startedWriting)
        self.cut()
        body = self.result(d)[2]
        self.assertTrue(body.startswith(b'data: {"long event\n\ndata: {"error"'), body)

    def test_event_end(self) -> None:
        """
        L{event_end} finds the end of the last whole event: after LF or CRLF
        blank lines, one split from the bytes held before, or none.
        """
        self.assertEqual(event_end(b"data: a\n\n"), 9)
        self.assertEqual(event_end(b"data: a\n\ndata: b"), 9)
        self.assertEqual(event_end(b"data: a\r\n\r\ndata: b\n\ndata: c"), 20)
        self.assertEqual(event_end(b"data: a\n\ndata: b\r\n\r\ndata: c"), 20)
        self.assertEqual(event_end(b"data: a\ndata: b"), 0)
        self.assertEqual(event_end(b"\ndata: b", b"a\n"), 1)
        self.assertEqual(event_end(b"\n\r\ndata", b"a\r"), 3)
        self.assertEqual(event_end(b"data", b"a\n"), 0)
        self.assertEqual(event_end(b"data: a\r\rdata: b"), 9)
        self.assertEqual(event_end(b"data: a\r\r"), 9)
        self.assertEqual(event_end(b"\rdata: b", b"a\r"), 1)

    def test_cr_events_go_as_they_come(self) -> None:
        """
        Events of CR-ended lines (which SSE allows) are written as each
        ends, not held to the stream's end.
        """
        d, sink = self.start()
        sink.body(CHUNK.replace(b"\n", b"\r"))
        self.gateway.flush()
        self.assertTrue(self.gateway.requests[-1].startedWriting)
        self.cut()
        self.assertTrue(self.result(d)[2].startswith(CHUNK.replace(b"\n", b"\r")))

    def test_compressed_stream_relayed_as_it_comes(self) -> None:
        """
        A compressed event stream (a provider that compressed it anyway)
        is relayed as any body, each piece as it comes: its events' ends
        cannot be seen in it, and holding it would hold the whole answer.
        """
        self.chat(model="big", stream=True)
        sink = self.tunnel()
        sink.status(200)
        sink.headers([("content-type", "text/event-stream"), ("content-encoding", "gzip")])
        sink.body(b"\x1f\x8b\x08\x00piece")
        self.gateway.flush()
        self.assertTrue(self.gateway.requests[-1].startedWriting)

    def test_error_before_the_body_drops_the_providers_headers(self) -> None:
        """
        An error the Edge answers after the provider's headers but before
        any body byte (half an event came, held) is the Edge's own JSON:
        none of the provider's headers (a length, a content coding)
        describes it.
        """
        d = self.chat(model="big", stream=True)
        sink = self.tunnel()
        sink.status(200)
        sink.headers([("content-type", "text/event-stream"), ("content-length", "900"), ("x-served-by", "p")])
        sink.body(b'data: {"half')
        self.gateway.flush()
        self.assertEqual(self.gateway.requests[-1].responseHeaders.getRawHeaders(b"x-served-by"), [b"p"])
        self.cut()
        code, _, body = self.result(d)
        self.assertEqual((code, json.loads(body)["error"]["code"]), (503, "node_disconnected"))
        # (As written: the test's client marks every answer it decoded.)
        headers = self.gateway.requests[-1].responseHeaders
        self.assertEqual(headers.getRawHeaders(b"content-type"), [b"application/json"])
        self.assertEqual(headers.getRawHeaders(b"content-length"), [str(len(body)).encode()])
        self.assertIsNone(headers.getRawHeaders(b"content-encoding"))
        self.assertIsNone(headers.getRawHeaders(b"x-served-by"))

    def test_streamed_request_asks_for_no_compression(self) -> None:
        """
        A streamed request goes to the provider without the caller's
        C{Accept-Encoding} (the SDKs send gzip), so its events come as
        they are written; a request answered whole keeps it.
        """
        for stream in (True, False):
            self.gateway.http.post(
                gateway.BASE + "/v1/chat/completions",
                json={"model": "big", "messages": HI, "stream": stream},
                headers={"accept-encoding": "gzip, deflate"},
            )
            self.gateway.flush()
            names = [name.lower() for name, _ in self.node.adapter("llm").tunnels[-1][0].headers]
            self.assertEqual("accept-encoding" in names, not stream, names)


class OneChoiceTests(OpenAITestCase):
    def test_refused_before_waiting(self) -> None:
        """
        C{n} other than 1 for a model whose providers all run it normalized
        is a 400 naming C{n} at once, not after waiting for room: nothing
        is queued or put on record.
        """
        self.fill()
        code, error = self.error(self.chat(model="talk", n=2))
        self.assertEqual((code, error["param"], error["code"]), (400, "n", "unsupported_n"))
        self.assertEqual(self.gateway.service.pool.waiting(), 0)
        self.assertEqual([r.model for r in self.gateway.service.runs.records()], ["talk", "talk"])

    def test_refused_for_an_adapter(self) -> None:
        """
        So it is for an adapter named as the model, and for a background
        run, which never tunnels: neither is put on record.
        """
        self.assertEqual(self.error(self.chat(model="echo", n=3))[1]["param"], "n")
        background = self.gateway.http.post(
            gateway.BASE + "/v1/chat/completions",
            json={"model": "big", "messages": HI, "n": 2},
            headers={"x-iop-background": "true"},
        )
        self.gateway.flush()
        self.assertEqual(self.error(background)[1]["code"], "unsupported_n")
        self.assertEqual((self.node.adapter("llm").runs, self.gateway.service.runs.records()), ([], []))

    def test_unknown_model_is_404(self) -> None:
        """
        A model nothing serves is 404 C{model_not_found} whatever its C{n}.
        """
        for n in (1, 2):
            code, error = self.error(self.chat(model="nothing", n=n))
            self.assertEqual((code, error["code"]), (404, "model_not_found"))

    def test_tunnels_relay_n(self) -> None:
        """
        A tunnel (and a group that may choose one) carries C{n} to the
        provider.
        """
        for model in ("big", "mixed"):
            self.chat(model=model, n=2)
            request = self.node.adapter("llm").tunnels[-1][0]
            self.assertEqual(json.loads(request.body)["n"], 2)


class StreamErrorTypeTests(OpenAITestCase):
    def test_queue_timeout_is_a_rate_limit_error(self) -> None:
        """
        A stream told it was queued, whose wait then timed out, ends with an
        error event of the type its HTTP answer would have.
        """
        self.fill()
        d = self.chat(model="talk", stream=True)
        self.gateway.advance(6)
        error = json.loads(events(self.result(d)[2])[-2])["error"]
        self.assertEqual((error["type"], error["code"]), ("rate_limit_error", "queue_timeout"))

    def test_type_by_kind(self) -> None:
        """
        L{EventStream.fail} takes the event's type from the error's kind.
        """
        written: list[bytes] = []
        request: Any = type("R", (), {"startedWriting": True, "write": lambda self, data: written.append(data)})()
        EventStream(request).fail(ServiceError("invalid", "bad", code="invalid_request"))
        self.assertEqual(json.loads(written[0][6:])["error"]["type"], "invalid_request_error")

    def test_run_failure_mid_stream(self) -> None:
        """
        A normalized run that fails mid-stream says the type of its
        failure's kind (C{invalid_request}: the caller's mistake).
        """
        d = self.chat(model="local", stream=True)
        emit = self.manual_run()[1]
        emit(RunEventData(START))
        emit(RunEventData(DELTA, text="hi"))
        emit(RunEventData(ERROR, error=RunFailure("invalid_request", "bad options")))
        self.gateway.flush()
        error = json.loads(events(self.result(d)[2])[-2])["error"]
        self.assertEqual((error["type"], error["code"]), ("invalid_request_error", "invalid_request"))


class EstimatedUsageTests(OpenAITestCase):
    def answer(self, usage: Usage | None = None) -> None:
        emit = self.manual_run()[1]
        emit(RunEventData(START))
        emit(RunEventData(DELTA, text="hi you"))
        emit(RunEventData(COMPLETE, usage=usage))
        self.gateway.flush()

    #: "hello there world" (17 characters) and "hi you" (6), 4 a token.
    ESTIMATE = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7, "estimated": True}

    def test_response(self) -> None:
        """
        A back end that reports no usage: the response's usage is the
        Edge's estimate, said to be one.
        """
        d = self.chat(model="local")
        self.answer()
        self.assertEqual(json.loads(self.result(d)[2])["usage"], self.ESTIMATE)

    def test_stream(self) -> None:
        """
        So is the usage chunk a stream asked for (C{choices: []}).
        """
        d = self.chat(model="local", stream=True, stream_options={"include_usage": True})
        self.answer()
        final = json.loads(events(self.result(d)[2])[-2])
        self.assertEqual((final["choices"], final["usage"]), ([], self.ESTIMATE))

    def test_reported_usage_as_it_is(self) -> None:
        """
        Reported usage is given as reported.
        """
        d = self.chat(model="local")
        self.answer(Usage(input_tokens=3, output_tokens=4))
        usage = json.loads(self.result(d)[2])["usage"]
        self.assertEqual(usage, {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7})


#: A call of a custom tool (free-form input), in an assistant message.
CUSTOM_CALL = {"id": "c1", "type": "custom", "custom": {"name": "grep", "input": "-r x"}}


class ParameterTests(OpenAITestCase):
    BAD: list[tuple[str, dict[str, Any]]] = [
        ("max_tokens", {"max_tokens": "abc"}),
        ("max_tokens", {"max_tokens": -1}),
        ("max_completion_tokens", {"max_completion_tokens": 0}),
        ("max_completion_tokens", {"max_completion_tokens": 1.5}),
        ("temperature", {"temperature": "hot"}),
        ("temperature", {"temperature": 3}),
        ("top_p", {"top_p": 1.5}),
        ("top_p", {"top_p": True}),
        ("n", {"n": True}),
        ("n", {"n": 0}),
        ("tools", {"tools": "x"}),
        ("tools", {"tools": ["x"]}),
        ("tool_choice", {"tool_choice": 5}),
        ("tool_choice", {"tool_choice": "sometimes"}),
        ("tool_choice", {"tool_choice": ["auto"]}),
        ("stop", {"stop": 5}),
        ("stop", {"stop": ["a", 1]}),
        ("messages[0].role", {"messages": [{"role": "bogus", "content": "x"}]}),
        ("stream_options", {"stream_options": {"include_usage": True}}),
        ("stream_options", {"stream": False, "stream_options": {"include_usage": True}}),
    ]

    def test_bad_parameters(self) -> None:
        """
        Each documented parameter of a wrong type or out of range is a 400
        C{invalid_request_error} naming it, before anything is placed, on
        a normalized run or a tunnel alike.
        """
        for model in ("local", "big"):
            for param, fields in self.BAD:
                code, error = self.error(self.chat(model=model, **fields))
                self.assertEqual((code, error["type"], error["param"]), (400, "invalid_request_error", param), fields)
        self.assertEqual((self.node.adapter("local").runs, self.node.adapter("llm").tunnels), ([], []))

    def test_good_parameters_and_extensions(self) -> None:
        """
        Good values and keys the Edge does not know (vendor extensions)
        pass, and a tunnel carries them to the provider.
        """
        fields = {
            "max_tokens": 5,
            "max_completion_tokens": None,
            "temperature": 0.7,
            "top_p": 1,
            "n": 1,
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": {"name": "f"}},
            "stop": ["END"],
            "stream": True,
            "stream_options": {"include_usage": True},
            "top_k": 20,
            "chat_template_kwargs": {"enable_thinking": False},
            "messages": [{"role": r, "content": "x"} for r in ("developer", "system", "user", "assistant", "tool")]
            + [{"role": "assistant", "content": None, "tool_calls": [CUSTOM_CALL]}],
        }
        self.chat(model="big", **fields)
        sent = json.loads(self.node.adapter("llm").tunnels[-1][0].body)
        self.assertEqual((sent["top_k"], sent["chat_template_kwargs"]), (20, {"enable_thinking": False}))
        self.assertEqual(sent["messages"][-1]["tool_calls"], [CUSTOM_CALL])
        self.chat(model="local", **dict(fields, stop="END"))
        self.assertEqual(self.manual_run()[0].options["top_k"], 20)


class RequestIdTests(OpenAITestCase):
    def request_ids(self, headers: Any) -> list[bytes]:
        return headers.getRawHeaders(b"x-request-id")

    def test_normalized_answer(self) -> None:
        """
        A normalized answer's C{x-request-id} is its run's id.
        """
        d = self.chat(model="talk")
        self.gateway.advance(1)
        _, headers, _ = self.result(d)
        self.assertEqual(self.request_ids(headers), headers.getRawHeaders(b"x-iop-run-id"))

    def test_native_run(self) -> None:
        """
        A native run's answer is a normalized one too: streamed, collected,
        or the 202 of a background run, its C{x-request-id} is its run's id.
        """
        for body in (
            {"model": "talk", "input": "hi"},
            {"model": "talk", "input": "hi", "stream": False},
            {"model": "talk", "input": "hi", "stream": False, "background": True},
        ):
            d = self.gateway.post("/v1/runs", body)
            self.gateway.advance(1)
            _, headers, _ = self.result(d)
            run_ids = headers.getRawHeaders(b"x-iop-run-id")
            self.assertEqual((len(run_ids), self.request_ids(headers)), (1, run_ids), body)

    def test_queued_stream(self) -> None:
        """
        A streamed answer told its place in the queue (its headers go with
        the first word of it) has an C{x-request-id} too.
        """
        self.fill()
        d = self.chat(model="talk", stream=True)
        self.gateway.advance(6)
        (request_id,) = self.request_ids(self.result(d)[1])
        self.assertTrue(request_id.startswith(b"req-"), request_id)

    def test_own_errors(self) -> None:
        """
        The Edge's own error answers carry one: a refused request, an
        unknown path.
        """
        for d in (self.chat(model="talk", temperature="hot"), self.gateway.get("/v1/nothing")):
            (request_id,) = self.request_ids(self.result(d)[1])
            self.assertTrue(request_id.startswith(b"req-"), request_id)

    def test_tunnel_keeps_the_providers(self) -> None:
        """
        A tunnel answers with the provider's own C{x-request-id}, alone.
        """
        d = self.chat(model="big")
        sink = self.tunnel()
        sink.status(200)
        sink.headers([("content-type", "application/json"), ("x-request-id", "req_abc")])
        sink.body(b"{}")
        self.node.adapter("llm").tunnels[-1][2].callback(None)
        self.gateway.flush()
        self.assertEqual(self.request_ids(self.result(d)[1]), [b"req_abc"])


class RetryAfterTests(OpenAITestCase):
    def test_provider_retry_after_on_a_normalized_run(self) -> None:
        """
        A normalized run its provider refused with a 429 and a Retry-After
        the Edge could not wait for answers 429 with that Retry-After (in
        whole seconds, rounded up), as a tunnel relays the provider's own.
        """
        for stream in (False, True):
            d = self.chat(model="local", stream=stream)
            emit = self.manual_run()[1]
            emit(RunEventData(ERROR, error=RunFailure(PROVIDER_ERROR, "slow down", 429, retry_after_sec=299.2)))
            self.gateway.flush()
            code, headers, _ = self.result(d)
            self.assertEqual((code, headers.getRawHeaders(b"retry-after")), (429, [b"300"]), stream)


class StatusPhraseTests(OpenAITestCase):
    def test_429_phrase(self) -> None:
        """
        A 429 says C{Too Many Requests}, not twisted.web's C{Unknown
        Status} (its table lacks 429).
        """
        self.fill()
        d = self.chat(model="talk")
        self.gateway.advance(6)
        response = self.successResultOf(d)
        self.assertEqual((response.code, response.phrase), (429, b"Too Many Requests"))
