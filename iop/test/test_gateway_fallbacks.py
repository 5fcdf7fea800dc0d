"""
Back ends that fail, on the whole in-memory gateway (L{iop.testing.gateway}):
a provider played by hand injects each fault (no answer, an error status,
a Retry-After, a context-length 400, a body cut before or after its first
byte) and each test checks what the caller gets: the whole answer (from
another provider, the same one again, or a fallback group, which the
answer names) or a bounded, explicit error; never a truncated answer that
ends like a success. Every lease is back at rest at the end.
"""

import json
from typing import Any

from twisted.internet import defer
from twisted.trial.unittest import SynchronousTestCase

from iop.adapters.interface import Capabilities
from iop.adapters.streams import ProviderError
from iop.run import DELTA, ERROR, START, RunEventData, RunFailure, Usage
from iop.testing import gateway as gateway_module
from iop.testing.gateway import Gateway
from iop.testing.node import ManualAdapter

PROVIDERS = ("a", "b", "c", "d")


class Fault(ProviderError):
    """
    What a tunnel's back end failed with, as an adapter raises it.
    """

    def __init__(self, code, message="injected", status=0):
        super().__init__(message, status)
        self.code = code


class ProbedAdapter(ManualAdapter):
    """
    A hand-played provider that also answers the Edge's C{probe} command
    (C{probe_ok} says how).
    """

    probe_ok = False

    def capabilities(self):
        caps = super().capabilities()
        return Capabilities(max_concurrency=caps.max_concurrency, tunnel=True, commands=caps.commands + ("probe",))

    def command(self, name, args, progress=None):
        if name == "probe":
            self.commands.append((name, args))
            return defer.succeed({"ok": self.probe_ok})
        return super().command(name, args, progress)


def config(**changes):
    """
    One node with four hand-played OpenAI-compatible providers: C{main}
    prefers C{a} to C{b}, falls back to C{small} (on C{c}) and, for a
    prompt too long, to C{long} (on C{d}); C{solo} has C{a} alone.
    """
    adapters = [
        {"name": name, "type": "openai_compat", "max_concurrency": 2, "base_url": "http://provider.invalid/v1"}
        for name in PROVIDERS
    ]
    data: dict[str, Any] = {
        "listen": {"nodes": "tcp:0", "http": "tcp:0"},
        "admin_keys": ["admin"],
        "health": {"probe_interval_sec": 5},
        "nodes": [
            {
                "id": "n1",
                "token": "tok-1",
                "adapters": adapters,
                "providers": [{"id": name, "adapter": name, "capacity": {"normal": 2}} for name in PROVIDERS],
            }
        ],
        "model_groups": [
            {
                "name": "main",
                "providers": [
                    {"node": "n1", "provider": "b", "target": "main-b", "priority": 1},
                    {"node": "n1", "provider": "a", "target": "main-a"},
                ],
                "fallbacks": ["small"],
                "context_fallbacks": ["long"],
                "queue_timeout_sec": 10,
            },
            {"name": "small", "providers": [{"node": "n1", "provider": "c", "target": "small-c"}]},
            {"name": "long", "providers": [{"node": "n1", "provider": "d", "target": "long-d"}]},
            {"name": "solo", "providers": [{"node": "n1", "provider": "a"}], "queue_timeout_sec": 5},
        ],
    }
    for group, values in changes.items():
        (section,) = [g for g in data["model_groups"] if g["name"] == group]
        section.update(values)
    return data


def sse_payloads(body):
    return [line[6:] for line in body.decode().split("\n") if line.startswith("data: ")]


class FallbackTests(SynchronousTestCase):
    def setUp(self):
        self.patch(gateway_module, "GATEWAY_TYPES", {"openai_compat": ProbedAdapter})
        self.start()

    def start(self, **changes):
        self.gateway = Gateway(config(**changes))
        self.node = self.gateway.node()
        self.seen = dict.fromkeys(PROVIDERS, 0)

    def tearDown(self):
        self.assertEqual(self.gateway.service.pool.active_leases(), [])

    def adapter(self, name):
        return self.node.adapter(name)

    def new_tunnels(self):
        """
        The providers that got a tunnel since the last call, with it.
        """
        found = []
        for name in PROVIDERS:
            tunnels = self.adapter(name).tunnels
            found += [(name, t) for t in tunnels[self.seen[name] :]]
            self.seen[name] = len(tunnels)
        return found

    def new_runs(self):
        found = []
        for name in PROVIDERS:
            runs = self.adapter(name).runs
            found += [(name, r) for r in runs[self.seen[name] :]]
            self.seen[name] = len(runs)
        return found

    def chat(self, model="main", stream=False):
        return self.gateway.post(
            "/v1/chat/completions", {"model": model, "stream": stream, "messages": [{"role": "user", "content": "hi"}]}
        )

    def native(self, model="main"):
        return self.gateway.post("/v1/runs", {"model": model, "input": "hi", "stream": False})

    def answer_tunnel(self, tunnel, status=200, body=b'{"ok": true}', headers=(("content-type", "application/json"),)):
        _, sink, done = tunnel
        sink.status(status)
        sink.headers(list(headers))
        sink.body(body)
        done.callback(None)
        self.gateway.flush()

    def fail_tunnel(self, tunnel, status=503, headers=()):
        _, sink, done = tunnel
        sink.status(status)
        sink.headers(list(headers))
        sink.body(b'{"error": {"message": "down"}}')
        done.callback(None)
        self.gateway.flush()

    def fail_run(self, run, code="provider_unreachable", status=0, retry_after=0.0):
        _, emit, _ = run
        emit(RunEventData(ERROR, error=RunFailure(code, "injected", status, retry_after_sec=retry_after)))
        self.gateway.flush()

    def complete_run(self, run, text="whole"):
        _, emit, done = run
        emit(RunEventData(START))
        emit(RunEventData(DELTA, text=text))
        done.callback(None)
        self.gateway.flush()

    def result(self, d):
        return self.successResultOf(self.gateway.read(d))

    def provider(self, name):
        (provider,) = [p for p in self.gateway.service.status()["nodes"][0]["providers"] if p["id"] == name]
        return provider

    # -- primary first

    def test_priority_before_load(self):
        """
        C{a} (priority 0) takes both of its slots before C{b} (priority 1,
        idle) gets any work: a fallback is not taken by load alone.
        """
        for _ in range(3):
            self.chat()
        self.assertEqual([name for name, _ in self.new_tunnels()], ["a", "a", "b"])
        for name in ("a", "a", "b"):
            self.answer_tunnel(self.adapter(name).tunnels.pop(0))

    # -- fallbacks

    def test_fallback_group_after_own_providers(self):
        """
        A run whose group's providers both fail before answering goes to
        the fallback group; the answer is whole and names C{small}.
        """
        d = self.native()
        (name, run), *_ = self.new_runs()
        self.assertEqual(name, "a")
        self.fail_run(run)
        ((name, run),) = self.new_runs()
        self.assertEqual(name, "b")
        self.fail_run(run)
        ((name, run),) = self.new_runs()
        self.assertEqual((name, run[0].target), ("c", "small-c"))
        self.complete_run(run)
        code, _, body = self.result(d)
        answer = json.loads(body)
        self.assertEqual((code, answer["status"], answer["text"], answer["model"]), (200, "complete", "whole", "small"))

    def normalized(self, continuation=(), **changes):
        """
        The same gateway with providers that run normalized runs (type
        C{ollama}, played by hand); those named in C{continuation} can
        continue a cut answer.
        """
        self.patch(gateway_module, "GATEWAY_TYPES", {"openai_compat": ProbedAdapter, "ollama": ProbedAdapter})
        data = config(**changes)
        for adapter in data["nodes"][0]["adapters"]:
            adapter["type"] = "ollama"
            if adapter["name"] in continuation:
                adapter["continuation"] = True
        self.gateway = Gateway(data)
        self.node = self.gateway.node()

    def test_fallback_names_the_serving_model(self):
        """
        A normalized chat completion served by a fallback names the model
        group that served it.
        """
        self.normalized(main={"retries": 0})
        d = self.chat()
        ((_, run),) = self.new_runs()
        self.fail_run(run, "provider_timeout")
        ((name, run),) = self.new_runs()
        self.assertEqual(name, "c")
        self.complete_run(run)
        code, _, body = self.result(d)
        answer = json.loads(body)
        self.assertEqual((code, answer["model"]), (200, "small"))
        self.assertEqual(answer["choices"][0]["message"]["content"], "whole")

    def test_fallbacks_in_order(self):
        """
        Fallbacks are tried in their order, after the group's own
        providers; when every one failed, the caller gets the last
        failure.
        """
        self.start(main={"retries": 0, "fallbacks": ["small", "long"]}, small={"retries": 0}, long={"retries": 0})
        d = self.chat()
        for expected in ("a", "c", "d"):
            ((name, tunnel),) = self.new_tunnels()
            self.assertEqual(name, expected)
            self.fail_tunnel(tunnel)
        self.assertEqual(self.new_tunnels(), [])
        self.assertEqual(self.result(d)[0], 503)

    def test_tunnel_fallback_body_names_target(self):
        """
        A tunnel taken by a fallback reaches its provider with the
        fallback's target as C{model}.
        """
        self.start(main={"retries": 0})
        d = self.chat()
        ((_, tunnel),) = self.new_tunnels()
        self.fail_tunnel(tunnel, 500)
        ((name, tunnel),) = self.new_tunnels()
        self.assertEqual((name, json.loads(tunnel[0].body)["model"]), ("c", "small-c"))
        self.answer_tunnel(tunnel)
        self.assertEqual(self.result(d)[:1], (200,))

    def test_context_fallback(self):
        """
        A prompt too long for the group's model goes to its context
        fallback (not to another provider of the same model).
        """
        d = self.native()
        ((_, run),) = self.new_runs()
        self.fail_run(run, "context_length_exceeded", 400)
        ((name, run),) = self.new_runs()
        self.assertEqual(name, "d")
        self.complete_run(run)
        self.assertEqual(json.loads(self.result(d)[2])["model"], "long")

    def test_tunnel_context_fallback_from_node_observation(self):
        """
        A tunnel's held 400 that the Node says is C{context_length_exceeded}
        (its C{failure} observation) goes to the context fallback.
        """
        d = self.chat()
        ((_, (_, sink, done)),) = self.new_tunnels()
        sink.status(400)
        sink.headers([("content-type", "application/json")])
        sink.metadata({"failure": {"code": "context_length_exceeded", "status": 400, "message": "too long"}})
        sink.body(b'{"error": {"message": "too long"}}')
        done.callback(None)
        self.gateway.flush()
        ((name, tunnel),) = self.new_tunnels()
        self.assertEqual((name, json.loads(tunnel[0].body)["model"]), ("d", "long-d"))
        self.answer_tunnel(tunnel)
        self.assertEqual(self.result(d)[0], 200)

    def test_other_client_error_passed_through(self):
        """
        Any other 4xx is the caller's answer, unchanged and not retried.
        """
        d = self.chat()
        ((_, tunnel),) = self.new_tunnels()
        self.fail_tunnel(tunnel, 400)
        self.assertEqual(self.new_tunnels(), [])
        code, _, body = self.result(d)
        self.assertEqual((code, body), (400, b'{"error": {"message": "down"}}'))

    # -- the same provider again

    def test_retry_after_waited_on_the_clock(self):
        """
        A 429 with Retry-After from the only provider is tried there again
        after that delay (not before).
        """
        d = self.native("solo")
        ((_, run),) = self.new_runs()
        self.fail_run(run, "provider_error", 429, retry_after=2)
        self.gateway.advance(1.9)
        self.assertEqual(self.new_runs(), [])
        self.gateway.advance(0.2)
        ((name, run),) = self.new_runs()
        self.assertEqual(name, "a")
        self.complete_run(run)
        self.assertEqual(json.loads(self.result(d)[2])["status"], "complete")

    def test_caller_gone_during_retry_after(self):
        """
        A caller who leaves while its work waits out a Retry-After cancels
        it: no second attempt is made.
        """
        self.native("solo")
        ((_, run),) = self.new_runs()
        self.fail_run(run, "provider_error", 429, retry_after=2)
        self.gateway.hang_up()
        self.gateway.advance(3)
        self.assertEqual(self.new_runs(), [])

    def test_drain_ends_retry_after_wait(self):
        """
        A stopping Edge does not keep work waiting out a Retry-After: its
        caller gets the provider's 429 at once.
        """
        d = self.native("solo")
        ((_, run),) = self.new_runs()
        self.fail_run(run, "provider_error", 429, retry_after=2)
        self.gateway.service.stopService()
        self.gateway.flush()
        answer = json.loads(self.result(d)[2])
        self.assertEqual((answer["status"], answer["events"][-1]["error"]["status"]), ("error", 429))
        self.gateway.advance(3)
        self.assertEqual(self.new_runs(), [])

    def test_tunnel_retry_after_header(self):
        """
        A tunnel's 429 is decided with its headers: its Retry-After is
        waited, then the same provider answers.
        """
        d = self.chat("solo")
        ((_, tunnel),) = self.new_tunnels()
        self.fail_tunnel(tunnel, 429, [("retry-after", "1")])
        self.assertEqual(self.new_tunnels(), [])
        self.gateway.advance(1.1)
        ((_, tunnel),) = self.new_tunnels()
        self.answer_tunnel(tunnel)
        self.assertEqual(self.result(d)[0], 200)

    def test_retry_after_beyond_queue_deadline(self):
        """
        A Retry-After longer than the caller's queue deadline is not
        waited: the caller gets the 429 at once.
        """
        d = self.native("solo")
        ((_, run),) = self.new_runs()
        self.fail_run(run, "provider_error", 429, retry_after=30)
        self.assertEqual(self.new_runs(), [])
        answer = json.loads(self.result(d)[2])
        self.assertEqual((answer["status"], answer["events"][-1]["error"]["status"]), ("error", 429))

    def test_server_error_retried_once(self):
        """
        A 500 from the only provider is retried there once; a second one
        is the caller's answer.
        """
        d = self.chat("solo")
        ((_, tunnel),) = self.new_tunnels()
        self.fail_tunnel(tunnel, 500)
        ((name, tunnel),) = self.new_tunnels()
        self.assertEqual(name, "a")
        self.fail_tunnel(tunnel, 500)
        self.assertEqual(self.new_tunnels(), [])
        self.assertEqual(self.result(d)[0], 500)

    # -- cut before or after the first byte

    def test_cut_before_first_body_byte_fails_over(self):
        """
        A tunnel whose provider sent its status and headers but failed
        before its first body byte (a missed first-byte deadline) is still
        placed again: the caller gets the other provider's whole answer.
        """
        d = self.chat()
        ((_, (_, sink, done)),) = self.new_tunnels()
        sink.status(200)
        sink.headers([("content-type", "application/json")])
        done.errback(Fault("provider_timeout", "no first byte"))
        self.gateway.flush()
        ((name, tunnel),) = self.new_tunnels()
        self.assertEqual(name, "b")
        self.answer_tunnel(tunnel, body=b'{"whole": true}')
        self.assertEqual(self.result(d)[::2], (200, b'{"whole": true}'))

    def test_non_streamed_cut_is_an_error_not_a_200(self):
        """
        With nowhere else to go, a non-streamed answer that failed before
        it was whole is a 504 JSON error, never a 200.
        """
        self.start(solo={"retries": 0})
        d = self.chat("solo")
        ((_, (_, sink, done)),) = self.new_tunnels()
        sink.status(200)
        sink.headers([("content-type", "application/json")])
        done.errback(Fault("provider_timeout", "the body stalled"))
        self.gateway.flush()
        code, headers, body = self.result(d)
        self.assertEqual(code, 504)
        self.assertEqual(json.loads(body)["error"]["code"], "provider_timeout")

    def test_tunnel_stream_incomplete(self):
        """
        A streamed tunnel cut after its first event ends with an error
        event (code C{incomplete}, with the usage so far) and C{[DONE]}.
        """
        d = self.chat("solo", stream=True)
        ((_, (_, sink, done)),) = self.new_tunnels()
        sink.status(200)
        sink.headers([("content-type", "text/event-stream")])
        sink.body(b'data: {"n": 1}\n\n')
        sink.usage(Usage(3, 1))
        done.errback(Fault("incomplete", "the stream was cut"))
        self.gateway.flush()
        code, _, body = self.result(d)
        self.assertEqual(code, 200)
        payloads = sse_payloads(body)
        self.assertEqual(payloads[0], '{"n": 1}')
        self.assertEqual(payloads[-1], "[DONE]")
        event = json.loads(payloads[-2])
        self.assertEqual(event["error"]["code"], "incomplete")
        self.assertEqual(event["usage"]["prompt_tokens"], 3)
        self.assertEqual(self.provider("a")["last_error"], "incomplete: the stream was cut")

    def test_responses_stream_incomplete(self):
        """
        A Responses API stream cut mid-way ends with that API's own
        C{error} event (no C{[DONE]}, which it does not use).
        """
        d = self.gateway.post("/v1/responses", {"model": "solo", "stream": True, "input": "hi"})
        ((_, (_, sink, done)),) = self.new_tunnels()
        sink.status(200)
        sink.headers([("content-type", "text/event-stream")])
        sink.body(b'event: response.created\ndata: {"type": "response.created"}\n\n')
        done.errback(Fault("incomplete", "the stream was cut"))
        self.gateway.flush()
        code, _, body = self.result(d)
        self.assertEqual(code, 200)
        self.assertTrue(body.endswith(b"\n\n"))
        self.assertIn(b"event: error\n", body)
        self.assertNotIn(b"[DONE]", body)
        event = json.loads(sse_payloads(body)[-1])
        self.assertEqual((event["type"], event["code"]), ("error", "incomplete"))

    def test_stream_first_byte_deadline_fails_over(self):
        """
        A streamed tunnel whose provider sent its headers but no first
        event in time is placed again: the caller gets the other
        provider's stream only.
        """
        d = self.chat(stream=True)
        ((_, (_, sink, done)),) = self.new_tunnels()
        sink.status(200)
        sink.headers([("content-type", "text/event-stream")])
        done.errback(Fault("provider_timeout", "no first event"))
        self.gateway.flush()
        ((name, tunnel),) = self.new_tunnels()
        self.assertEqual(name, "b")
        self.answer_tunnel(
            tunnel, body=b"data: {}\n\ndata: [DONE]\n\n", headers=[("content-type", "text/event-stream")]
        )
        code, _, body = self.result(d)
        self.assertEqual((code, body), (200, b"data: {}\n\ndata: [DONE]\n\n"))

    def test_run_stream_incomplete(self):
        """
        A streamed native run cut mid-way ends with its C{error} event
        (code C{incomplete}, with the usage so far).
        """
        d = self.gateway.post("/v1/runs", {"model": "solo", "input": "hi", "stream": True})
        ((_, (_, emit, _)),) = self.new_runs()
        emit(RunEventData(START))
        emit(RunEventData(DELTA, text="par"))
        emit(RunEventData(ERROR, usage=Usage(3, 1), error=RunFailure("incomplete", "cut")))
        self.gateway.flush()
        events = [json.loads(p) for p in sse_payloads(self.result(d)[2])]
        self.assertEqual([e["type"] for e in events], ["start", "delta", "error"])
        self.assertEqual(events[-1]["error"]["code"], "incomplete")
        self.assertEqual(events[-1]["usage"]["output_tokens"], 1)

    # -- continuation

    def cut(self, run, text="Hello, "):
        _, emit, _ = run
        emit(RunEventData(START))
        emit(RunEventData(DELTA, text=text))
        emit(RunEventData(ERROR, usage=Usage(5, 2), error=RunFailure("incomplete", "the stream stalled")))
        self.gateway.flush()

    def test_stream_continued_on_another_provider(self):
        """
        A streamed answer cut mid-way goes on on a provider that can
        continue it (the text so far as its assistant prefix): the caller
        gets the whole answer, one start, no error.
        """
        self.normalized(continuation=("b",))
        d = self.chat(stream=True)
        ((name, run),) = self.new_runs()
        self.assertEqual(name, "a")
        self.cut(run)
        ((name, run),) = self.new_runs()
        self.assertEqual((name, run[0].options.get("assistant_prefix")), ("b", "Hello, "))
        self.complete_run(run, "world")
        code, _, body = self.result(d)
        payloads = sse_payloads(body)
        self.assertEqual(payloads[-1], "[DONE]")
        chunks = [json.loads(p) for p in payloads[:-1]]
        self.assertEqual([c for c in chunks if "error" in c], [])
        deltas = [c["choices"][0]["delta"] for c in chunks if c.get("choices")]
        self.assertEqual("".join(delta.get("content", "") for delta in deltas), "Hello, world")
        self.assertEqual(sum(1 for delta in deltas if delta.get("role")), 1)
        self.assertEqual(chunks[-1]["choices"][0]["finish_reason"], "stop")
        text = self.successResultOf(self.gateway.read(self.gateway.get("/metrics")))[2].decode()
        self.assertIn('iop_edge_incompletes_total{continued="true",node="n1",provider="a"} 1.0', text)

    def test_non_streamed_continued_on_a_fallback(self):
        """
        A non-streamed answer cut mid-way goes on on a fallback group that
        can continue it: one whole answer.
        """
        self.normalized(continuation=("c",))
        d = self.chat()
        ((_, run),) = self.new_runs()
        self.cut(run)
        ((name, run),) = self.new_runs()
        self.assertEqual(name, "c")
        self.complete_run(run, "world")
        code, _, body = self.result(d)
        self.assertEqual((code, json.loads(body)["choices"][0]["message"]["content"]), (200, "Hello, world"))

    def test_no_continuation_is_explicit(self):
        """
        With no provider that can continue, the cut answer ends with the
        explicit error: an C{incomplete} event in the stream, a 502 for a
        non-streamed answer.
        """
        self.normalized()
        d = self.chat(stream=True)
        ((_, run),) = self.new_runs()
        self.cut(run)
        self.assertEqual(self.new_runs(), [])
        payloads = sse_payloads(self.result(d)[2])
        event = json.loads(payloads[-2])
        self.assertEqual((event["error"]["code"], event["usage"]["completion_tokens"]), ("incomplete", 2))
        d = self.chat()
        ((_, run),) = self.new_runs()
        self.cut(run)
        code, _, body = self.result(d)
        self.assertEqual((code, json.loads(body)["error"]["code"]), (502, "incomplete"))

    def test_continuation_that_fails_is_incomplete(self):
        """
        A continuation that fails before adding anything ends the caller's
        answer as C{incomplete}.
        """
        self.normalized(continuation=("b",), main={"retries": 0, "fallbacks": []})
        d = self.chat(stream=True)
        ((_, run),) = self.new_runs()
        self.cut(run)
        ((name, run),) = self.new_runs()
        self.fail_run(run, "provider_unreachable")
        event = json.loads(sse_payloads(self.result(d)[2])[-2])
        self.assertEqual(event["error"]["code"], "incomplete")

    # -- health

    def test_passed_through_failure_counts(self):
        """
        A 503 passed through to the caller (nowhere else to go) counts as
        the provider's failure, not as an answer: three eject it.
        """
        self.start(solo={"retries": 0})
        for _ in range(3):
            d = self.chat("solo")
            ((_, tunnel),) = self.new_tunnels()
            self.fail_tunnel(tunnel, 503)
            self.assertEqual(self.result(d)[0], 503)
        provider = self.provider("a")
        self.assertEqual(provider["health"], "ejected")
        self.assertEqual(provider["last_error"], "provider_error: the provider answered HTTP 503")

    def test_panic_mode(self):
        """
        With every provider of its group ejected, work still goes to the
        one that failed longest ago (not a 503 for a whole cooldown); its
        answer makes it healthy at once.
        """
        self.start(solo={"retries": 0})
        for _ in range(3):
            d = self.chat("solo")
            ((_, tunnel),) = self.new_tunnels()
            self.fail_tunnel(tunnel, 503)
            self.result(d)
        self.assertEqual(self.provider("a")["health"], "ejected")
        self.assertTrue(self.gateway.service.status()["model_groups"][3]["panic"])
        d = self.chat("solo")
        ((name, tunnel),) = self.new_tunnels()
        self.assertEqual(name, "a")
        self.answer_tunnel(tunnel)
        self.assertEqual(self.result(d)[0], 200)
        self.assertEqual(self.provider("a")["health"], "ok")

    def test_probe_returns_provider(self):
        """
        An ejected provider is probed every C{probe_interval_sec}; it is
        back (before its cooldown) as soon as a probe passes, and C{main}
        prefers it again.
        """
        self.start(main={"retries": 0, "fallbacks": []})
        for _ in range(3):
            d = self.chat()
            ((name, tunnel),) = self.new_tunnels()
            self.assertEqual(name, "a")
            self.fail_tunnel(tunnel, 503)
            self.result(d)
        self.assertEqual(self.provider("a")["health"], "ejected")
        d = self.chat()
        ((name, tunnel),) = self.new_tunnels()
        self.assertEqual(name, "b")
        self.answer_tunnel(tunnel)
        self.result(d)
        self.gateway.advance(5.1)
        self.assertEqual(self.adapter("a").commands, [("probe", {})])
        self.assertEqual(self.provider("a")["probes"], {"failed": 1})
        self.adapter("a").probe_ok = True
        self.gateway.advance(5)
        self.assertEqual(self.provider("a")["health"], "ok")
        self.assertEqual(self.provider("a")["probes"], {"failed": 1, "passed": 1})
        d = self.chat()
        ((name, tunnel),) = self.new_tunnels()
        self.assertEqual(name, "a")
        self.answer_tunnel(tunnel)
        self.result(d)

    def test_metrics(self):
        """
        Fallbacks taken, deadline hits by kind and incompletes are counted,
        in the metrics and in the status.
        """
        self.start(main={"retries": 0})
        d = self.native()
        ((_, (_, emit, _)),) = self.new_runs()
        emit(RunEventData(ERROR, error=RunFailure("provider_timeout", "slow", deadline="first_byte")))
        self.gateway.flush()
        ((_, (_, emit, _)),) = self.new_runs()
        emit(RunEventData(START))
        emit(RunEventData(DELTA, text="x"))
        emit(RunEventData(ERROR, error=RunFailure("incomplete", "cut")))
        self.gateway.flush()
        self.result(d)
        text = self.successResultOf(self.gateway.read(self.gateway.get("/metrics")))[2].decode()
        self.assertIn('iop_edge_fallbacks_total{fallback="small",model_group="main",reason="fallbacks"} 1.0', text)
        self.assertIn('iop_edge_deadline_hits_total{kind="first_byte",node="n1",provider="a"} 1.0', text)
        self.assertIn('iop_edge_incompletes_total{continued="false",node="n1",provider="c"} 1.0', text)
        status = self.gateway.service.status()
        self.assertEqual(status["model_groups"][0]["fallbacks_taken"], {"small": 1})
        self.assertEqual(self.provider("a")["deadline_hits"], {"first_byte": 1})
        self.assertEqual(self.provider("c")["failures"], {"incomplete": 1})
