"""
Hostile JSON at every HTTP endpoint of the whole gateway in memory
(L{iop.testing.gateway}): type confusion, lone surrogates, absurd nesting
and sizes. Whatever arrives, the caller gets an answer that is not a
server error (a 4xx for bad input), nothing is logged as critical, and
once the work it started has ended every lease is back at rest and
nothing is left in flight (issue 12, findings 1 and 6).

Short here; C{make fuzz} runs many more examples (L{iop.test.fuzz}).
"""

import copy
import json

from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from iop.test.fuzz import encode, fuzz, json_values, mutated, nasty_strings, watch_critical
from iop.testing.gateway import BASE, GATEWAY_YAML, Gateway

#: The in-memory gateway with an instant echo (so work ends on its own)
#: and a manual OpenAI-compatible provider the test settles by hand.
FUZZ_YAML: dict = copy.deepcopy(GATEWAY_YAML)
FUZZ_YAML["nodes"][0]["adapters"][0]["delay_ms"] = 0

names = st.sampled_from(["talk", "big", "echo", "llm", "n1", "nope"])
text = st.one_of(st.text(max_size=30), st.text(max_size=30), nasty_strings)
booleans = st.one_of(st.booleans(), st.none())

part = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": text}),
    st.fixed_dictionaries({"type": st.just("image_url"), "image_url": st.just({"url": "data:,"})}),
)
message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["user", "system", "assistant"]),
        "content": st.one_of(text, st.lists(part, max_size=3), st.none()),
    }
)

chat_bodies = st.fixed_dictionaries(
    {"model": names, "messages": st.lists(message, min_size=1, max_size=3)},
    optional={
        "stream": booleans,
        "stream_options": st.fixed_dictionaries({}, optional={"include_usage": booleans}),
        "temperature": st.floats(0, 2),
        "max_tokens": st.integers(1, 100),
        "user": text,
    },
)

run_bodies = st.fixed_dictionaries(
    {"input": st.one_of(text, st.lists(message, min_size=1, max_size=2)), "adapter": names},
    optional={
        "model": names,
        "node": names,
        "target": text,
        "session_id": text,
        "background": booleans,
        "options": st.dictionaries(st.text(max_size=5), json_values, max_size=3),
        "stream": booleans,
    },
)

terminate_bodies = st.fixed_dictionaries(
    {"adapter": names, "session_id": text},
    optional={"node": names, "target": text},
)

command_bodies = st.fixed_dictionaries(
    {"command": st.sampled_from(["capabilities", "transport_status", "session_list", "manual_ping"])},
    optional={"adapter": names, "args": st.dictionaries(st.text(max_size=5), json_values, max_size=3)},
)

requests = st.one_of(
    st.tuples(st.just("/v1/chat/completions"), mutated(chat_bodies)),
    st.tuples(st.just("/v1/runs"), mutated(run_bodies)),
    st.tuples(st.just("/v1/sessions/terminate"), mutated(terminate_bodies)),
    st.tuples(st.just("/v1/nodes/n1/commands"), mutated(command_bodies)),
    st.tuples(st.sampled_from(["/v1/runs/run-x/cancel", "/v1/runs/%ED%A0%80/cancel"]), json_values),
    st.tuples(st.sampled_from(["/v1/chat/completions", "/v1/runs"]), st.binary(max_size=40)),
)


class HTTPFuzzTests(SynchronousTestCase):
    def setUp(self):
        self.gateway = Gateway(FUZZ_YAML)
        self.node = self.gateway.node()
        self.critical = watch_critical(self)

    def settle(self):
        """
        Let every piece of started work end: echo runs end by themselves;
        the manual provider answers whatever it was given.
        """
        self.gateway.advance(0.5)
        adapter = self.node.adapter("llm")
        for _, sink, d in adapter.tunnels:
            if not d.called:
                sink.status(200)
                sink.headers([("content-type", "application/json")])
                sink.body(b"{}")
                d.callback(None)
        for _, _, d in adapter.runs:
            if not d.called:
                d.callback(None)
        self.gateway.advance(0.5)

    def assert_at_rest(self):
        service = self.gateway.service
        self.assertEqual(len(service.inflight), 0)
        self.assertEqual(service.pool.active_leases(), [])
        for group in service.pool.snapshot()["model_groups"]:
            self.assertEqual(group["queued"], 0)

    def test_every_endpoint(self):
        """
        Any body at any endpoint: an answer below 500 (a 4xx with an
        OpenAI-style error for bad input; a Node's refusal of a command is
        its own 502), nothing critical logged, every lease back.
        """
        fuzz(requests, self.check, short=200)

    def check(self, request):
        path, body = request
        data = body if isinstance(body, bytes) else encode(body)
        d = self.gateway.http.post(
            BASE + path,
            data=data,
            headers={b"content-type": [b"application/json"], b"authorization": [b"Bearer admin"]},
        )
        self.settle()
        code, _, answer = self.successResultOf(self.gateway.read(d))
        if path.endswith("/commands") and code == 502:
            self.assertIn(b"command_failed", answer)
        else:
            self.assertLess(code, 500, (path, data[:300], answer[:300]))
        if code >= 400:
            self.assertIn("message", json.loads(answer)["error"])
        self.assertEqual(self.critical, [], (path, data[:300]))
        self.assert_at_rest()
        return 1
