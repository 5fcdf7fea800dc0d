"""
Caller keys sharing one gateway, in memory (L{iop.testing.gateway}): the
visible queue (SSE comments, native C{queued} events, C{GET /v1/queue},
Retry-After), token budgets and priorities, over the real HTTP surfaces.
"""

import copy
import json

from twisted.trial.unittest import SynchronousTestCase

from iop.testing.gateway import BASE, GATEWAY_YAML, Gateway

TEXT = "one two three four"


def config(**changes):
    data = copy.deepcopy(GATEWAY_YAML)
    data["api_keys"] = [
        {"key": "sk-alice", "name": "alice"},
        {"key": "sk-bob", "name": "bob"},
        {"key": "sk-vip", "name": "vip", "priority": 5},
        {"key": "sk-thrifty", "name": "thrifty", "tokens_per_minute": 600},
    ]
    data.update(changes)
    return data


def chat(stream=True, **extra):
    return dict({"model": "talk", "stream": stream, "messages": [{"role": "user", "content": TEXT}]}, **extra)


class TenantGatewayTests(SynchronousTestCase):
    def setUp(self):
        self.gateway = Gateway(config())
        self.node = self.gateway.node()

    def post(self, path, body, key="sk-alice", **headers):
        headers = dict({"authorization": f"Bearer {key}"}, **headers)
        d = self.gateway.http.post(BASE + path, json=body, headers=headers)
        self.gateway.flush()
        return d

    def get(self, path, key="sk-alice"):
        return self.gateway.get(path, headers={"authorization": f"Bearer {key}"})

    def result(self, d):
        return self.successResultOf(self.gateway.read(d))

    def fill(self, key="sk-bob"):
        """
        Take both slots of the C{talk} group.
        """
        return [self.post("/v1/chat/completions", chat(), key=key) for _ in range(2)]

    def test_queued_comments_then_answer(self):
        """
        A streamed completion that waits hears ': queued position=N
        eta_ms=M' comments until it starts, then its chunks and [DONE].
        """
        self.fill()
        d = self.post("/v1/chat/completions", chat())
        self.gateway.advance(2)
        code, headers, body = self.result(d)
        self.assertEqual(code, 200)
        text = body.decode()
        self.assertTrue(text.startswith(": queued position=1 eta_ms="), text[:80])
        self.assertIn("data: [DONE]", text)
        chunks = [json.loads(line[6:]) for line in text.split("\n") if line.startswith("data: {")]
        self.assertEqual("".join(c["choices"][0]["delta"].get("content", "") for c in chunks), TEXT)

    def test_native_queued_event(self):
        """
        A streamed native run that waits gets C{queued} events first.
        """
        self.fill()
        d = self.post("/v1/runs", {"model": "talk", "input": TEXT})
        self.gateway.advance(2)
        _, _, body = self.result(d)
        events = [json.loads(line[6:]) for line in body.decode().split("\n") if line.startswith("data: ")]
        self.assertEqual(events[0]["type"], "queued")
        self.assertEqual(events[0]["position"], 1)
        self.assertEqual(events[-1]["type"], "complete")

    def test_timeout_while_queued_ends_the_stream(self):
        """
        A streamed request told it is queued, whose wait then times out,
        gets an error event and [DONE], not a silent end.
        """
        self.gateway = Gateway(config(model_groups=[dict(GATEWAY_YAML["model_groups"][0], queue_timeout_sec=0.5)]))
        self.node = self.gateway.node()
        blocking = self.post("/v1/chat/completions", chat(messages=[{"role": "user", "content": "x " * 40}]))
        blocking2 = self.post("/v1/chat/completions", chat(messages=[{"role": "user", "content": "x " * 40}]))
        d = self.post("/v1/chat/completions", chat())
        self.gateway.advance(1)
        _, _, body = self.result(d)
        text = body.decode()
        self.assertIn(": queued position=1", text)
        self.assertIn('"code": "queue_timeout"', text)
        self.assertTrue(text.endswith("data: [DONE]\n\n"))
        self.gateway.advance(10)
        for other in (blocking, blocking2):
            self.assertEqual(self.result(other)[0], 200)

    def test_queue_view_own_and_admin(self):
        """
        C{GET /v1/queue} shows a caller only its own waiting work; an admin
        key sees everyone's with a count per key.
        """
        self.fill()
        self.post("/v1/chat/completions", chat(), key="sk-alice")
        self.post("/v1/chat/completions", chat(), key="sk-bob")
        code, _, body = self.result(self.get("/v1/queue", key="sk-alice"))
        self.assertEqual(code, 200)
        mine = json.loads(body)
        self.assertEqual(mine["key"], "alice")
        self.assertEqual([(e["key"], e["model"]) for e in mine["queued"]], [("alice", "talk")])
        _, _, body = self.result(self.get("/v1/queue", key="admin"))
        everyone = json.loads(body)
        self.assertEqual(everyone["by_key"], {"alice": 1, "bob": 1})
        self.assertEqual(sorted(e["position"] for e in everyone["queued"]), [1, 2])
        self.gateway.advance(3)

    def test_priority_served_first(self):
        """
        A key of a higher priority is served before work that waited
        longer; x-iop-priority may lower it, and must be an integer.
        """
        self.fill()
        low = self.post("/v1/chat/completions", chat(stream=False), key="sk-alice")
        lowered = self.post("/v1/chat/completions", chat(stream=False), key="sk-vip", **{"x-iop-priority": "0"})
        high = self.post("/v1/chat/completions", chat(stream=False), key="sk-vip", **{"x-iop-priority": "9"})
        view = json.loads(self.result(self.get("/v1/queue", key="admin"))[2])
        order = [(e["key"], e["priority"]) for e in sorted(view["queued"], key=lambda e: e["position"])]
        self.assertEqual(order, [("vip", 5), ("alice", 0), ("vip", 0)])
        self.gateway.advance(3)
        for d in (low, lowered, high):
            self.assertEqual(self.result(d)[0], 200)
        code, _, body = self.result(
            self.post("/v1/chat/completions", chat(), key="sk-vip", **{"x-iop-priority": "high"})
        )
        self.assertEqual(code, 400)
        self.assertEqual(json.loads(body)["error"]["code"], "invalid_priority")

    def test_token_budget(self):
        """
        A key's token budget holds each request's estimate while it runs
        (its input and max_tokens); over it, 429 token_budget_exceeded with
        Retry-After; what was reported is what it spends.
        """
        first = self.post("/v1/chat/completions", chat(stream=False, max_tokens=400), key="sk-thrifty")
        code, headers, body = self.result(
            self.post("/v1/chat/completions", chat(stream=False, max_tokens=400), key="sk-thrifty")
        )
        self.assertEqual(code, 429)
        self.assertEqual(json.loads(body)["error"]["code"], "token_budget_exceeded")
        self.assertGreaterEqual(int(headers.getRawHeaders("retry-after")[0]), 1)
        self.gateway.advance(2)
        self.assertEqual(self.result(first)[0], 200)
        left = json.loads(self.result(self.get("/v1/queue", key="sk-thrifty"))[2])["tokens_left"]["minute"]
        self.assertGreater(left, 500)  # echo reports a handful of tokens, not the 400 reserved
        # No max_tokens: limits.token_estimate (1024) is more than the whole
        # budget, so the request reserves all of it while it runs.
        running = self.post("/v1/chat/completions", chat(stream=False), key="sk-thrifty")
        small = self.post("/v1/chat/completions", chat(stream=False, max_tokens=10), key="sk-thrifty")
        self.assertEqual(self.result(small)[0], 429)
        self.gateway.advance(2)
        self.assertEqual(self.result(running)[0], 200)

    def test_queue_full_says_when_to_retry(self):
        """
        A refusal from a full queue carries Retry-After.
        """
        groups = [dict(GATEWAY_YAML["model_groups"][0], max_queue=1), GATEWAY_YAML["model_groups"][1]]
        self.gateway = Gateway(config(model_groups=groups))
        self.node = self.gateway.node()
        self.fill()
        self.post("/v1/chat/completions", chat())
        code, headers, body = self.result(self.post("/v1/chat/completions", chat()))
        self.assertEqual(code, 429)
        self.assertEqual(json.loads(body)["error"]["code"], "queue_full")
        self.assertGreaterEqual(int(headers.getRawHeaders("retry-after")[0]), 1)
        self.gateway.advance(3)

    def test_metrics(self):
        """
        Queue waits are measured by key and outcome, and refusals counted
        by reason.
        """
        self.fill()
        queued = self.post("/v1/chat/completions", chat(stream=False), key="sk-alice")
        for _ in range(2):
            self.post("/v1/runs", {"model": "talk", "input": TEXT, "options": {"max_tokens": 400}}, key="sk-thrifty")
        self.gateway.advance(3)
        self.assertEqual(self.result(queued)[0], 200)
        _, _, body = self.result(self.gateway.get("/metrics"))
        text = body.decode()
        self.assertIn('iop_edge_queue_wait_seconds_count{key="alice",outcome="served"} 1.0', text)
        self.assertIn('iop_edge_refusals_total{reason="token_budget_exceeded"} 1.0', text)
