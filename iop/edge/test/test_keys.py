"""
Caller, admin and metrics keys (issue 12, finding 10 and "Keys"): SHA-256
forms like node tokens, per-key limits on requests in progress and per
minute (429 with C{Retry-After}), and C{/metrics} behind its own key or on
its own endpoint.
"""

import copy
import hashlib
import json
from typing import Any

from treq.testing import StubTreq
from twisted.internet import defer
from twisted.internet.error import ConnectionDone
from twisted.trial.unittest import SynchronousTestCase

from iop.config import ConfigError
from iop.edge.cluster.forward import PEER_HEADER, PeerGate
from iop.edge.http.site import EdgeSite
from iop.edge.keys import KeyLimiter, KeySpec, RateLimited, key_digest
from iop.edge.test.test_config import parsed
from iop.protocols import messages
from iop.testing.edge import EDGE_YAML, EdgeHarness

BASE = "http://edge.invalid"


def sha(key):
    return hashlib.sha256(key.encode()).hexdigest()


class KeyConfigTests(SynchronousTestCase):
    def refused(self, mutate, *fragments):
        error = self.assertRaises(ConfigError, parsed, mutate)
        for fragment in fragments:
            self.assertIn(fragment, str(error))
        return error

    def test_forms(self):
        """
        A key may be given as itself, as C{{key: ...}} or as its SHA-256;
        entries may carry a name and limits.
        """
        config = parsed(
            lambda d: d.update(
                api_keys=[
                    "plain",
                    {"sha256": sha("hashed"), "name": "team-a", "max_concurrent": 2, "requests_per_minute": 60},
                    {"key": "mapped"},
                ],
                admin_keys=[{"sha256": sha("root").upper()}],
                metrics_key={"sha256": sha("scrape")},
            )
        )
        plain, hashed, mapped = config.api_keys
        self.assertEqual(plain, KeySpec(key_digest("plain"), "key-" + sha("plain")[:8]))
        self.assertEqual((hashed.digest, hashed.name, hashed.max_concurrent, hashed.requests_per_minute),
                         (key_digest("hashed"), "team-a", 2, 60))  # fmt: skip
        self.assertEqual(mapped.digest, key_digest("mapped"))
        self.assertEqual(config.admin_keys[0].digest, key_digest("root"))
        self.assertEqual(config.metrics_key.digest, key_digest("scrape"))

    def test_bad_entries(self):
        """
        Bad digests, both or neither form, unknown keys, limits below 1,
        empty keys, a name that is empty or C{anonymous} (the owner of
        work without a key) and duplicates are refused naming the entry; a
        duplicate is not shown.
        """
        self.refused(lambda d: d.update(api_keys=[{"sha256": "abc"}]), "api_keys[0].sha256", "64 hexadecimal")
        self.refused(lambda d: d.update(api_keys=[{"sha256": sha("a"), "key": "a"}]), "api_keys[0].key")
        self.refused(lambda d: d.update(api_keys=[{"name": "x"}]), "api_keys[0].key", "exactly one")
        self.refused(lambda d: d.update(api_keys=[{"key": "a", "rpm": 1}]), "api_keys[0].rpm", "unknown key")
        self.refused(lambda d: d.update(api_keys=[{"key": "a", "name": "anonymous"}]), "api_keys[0].name")
        self.refused(lambda d: d.update(api_keys=[{"key": "a", "name": ""}]), "api_keys[0].name")
        self.refused(
            lambda d: d.update(api_keys=[{"key": "a", "name": "ops"}], admin_keys=[{"key": "b", "name": "ops"}]),
            "admin_keys[0].name",
        )
        parsed(lambda d: d.update(api_keys=[{"key": "a", "name": "ops"}], admin_keys=[{"key": "a", "name": "ops"}]))
        self.refused(lambda d: d.update(api_keys=[{"key": "a", "max_concurrent": 0}]), "api_keys[0].max_concurrent")
        self.refused(lambda d: d.update(api_keys=[""]), "api_keys[0]")
        self.refused(lambda d: d.update(api_keys=[5]), "api_keys[0]")
        error = self.refused(lambda d: d.update(admin_keys=["secret", {"sha256": sha("secret")}]), "admin_keys[1]")
        self.assertNotIn("secret", str(error).replace("admin_keys", ""))
        self.refused(lambda d: d.update(metrics_key={"sha256": "zz"}), "metrics_key.sha256")

    def test_tenant_fields(self):
        """
        A key's weight, priority and token budgets make its tenant; bad
        ones are refused naming the entry.
        """
        config = parsed(
            lambda d: d.update(
                api_keys=[
                    {"key": "a", "name": "team-a", "weight": 2.5, "priority": 3, "tokens_per_minute": 1000},
                    {"key": "b", "tokens_per_day": 50000},
                ]
            )
        )
        tenant = config.api_keys[0].tenant()
        self.assertEqual((tenant.name, tenant.weight, tenant.priority), ("team-a", 2.5, 3))
        self.assertEqual((tenant.tokens_per_minute, tenant.tokens_per_day), (1000, None))
        self.assertEqual(config.api_keys[1].tenant().tokens_per_day, 50000)
        self.assertEqual((config.api_keys[1].weight, config.api_keys[1].priority), (1.0, 0))
        self.refused(lambda d: d.update(api_keys=[{"key": "a", "weight": 0}]), "api_keys[0].weight", "positive")
        self.refused(lambda d: d.update(api_keys=[{"key": "a", "priority": "high"}]), "api_keys[0].priority")
        self.refused(lambda d: d.update(api_keys=[{"key": "a", "tokens_per_day": 0}]), "api_keys[0].tokens_per_day")
        self.refused(lambda d: d.update(limits={"token_estimate": -1}), "limits.token_estimate")

    def test_one_name_one_owner(self):
        """
        Entries of one name (a key and its replacement) may differ in
        their per-key limits but not in what their owner shares: weight,
        priority and budgets; a difference is refused naming the field.
        """
        config = parsed(
            lambda d: d.update(
                api_keys=[
                    {"key": "old", "name": "team", "tokens_per_minute": 1000, "max_concurrent": 1},
                    {"key": "new", "name": "team", "tokens_per_minute": 1000, "max_concurrent": 4},
                ]
            )
        )
        self.assertEqual(config.api_keys[0].tenant(), config.api_keys[1].tenant())
        self.refused(
            lambda d: d.update(
                api_keys=[
                    {"key": "old", "name": "team", "tokens_per_minute": 1000},
                    {"key": "b", "name": "other"},
                    {"key": "new", "name": "team", "tokens_per_minute": 1200},
                ]
            ),
            "api_keys[2].tokens_per_minute",
            "api_keys[0]",
            "'team'",
        )
        self.refused(
            lambda d: d.update(api_keys=[{"key": "a", "name": "t"}, {"key": "b", "name": "t", "weight": 2}]),
            "api_keys[1].weight",
        )


class LimiterTests(SynchronousTestCase):
    def test_concurrent(self):
        """
        C{max_concurrent} counts requests in progress; a finished one
        frees its place (once, however often it is released).
        """
        limiter = KeyLimiter(lambda: 0.0)
        spec = KeySpec(key_digest("k"), "k", max_concurrent=2)
        first, _ = limiter.admit(spec), limiter.admit(spec)
        e = self.assertRaises(RateLimited, limiter.admit, spec)
        self.assertEqual((e.kind, e.retry_after), ("busy", 1))
        first()
        first()
        limiter.admit(spec)
        self.assertRaises(RateLimited, limiter.admit, spec)

    def test_release_ends_a_failed_chain(self):
        """
        The release takes a request's failed C{notifyFinish} result (the
        caller disconnected) and ends the chain there: nothing is left to
        be logged as an unhandled error.
        """
        limiter = KeyLimiter(lambda: 0.0)
        spec = KeySpec(key_digest("k"), "k", max_concurrent=1)
        finished: defer.Deferred[None] = defer.Deferred()
        finished.addBoth(limiter.admit(spec))
        finished.errback(ConnectionDone("the caller hung up"))
        self.assertIsNone(self.successResultOf(finished))
        self.assertEqual(limiter.in_progress, {})

    def test_not_concurrent(self):
        """
        A request that runs no work counts per minute only, never against
        C{max_concurrent}, even when the key is at it.
        """
        limiter = KeyLimiter(lambda: 0.0)
        spec = KeySpec(key_digest("k"), "k", max_concurrent=1, requests_per_minute=3)
        limiter.admit(spec)
        limiter.admit(spec, concurrent=False)()
        self.assertEqual(limiter.in_progress, {spec.digest: 1})
        limiter.admit(spec, concurrent=False)
        self.assertRaises(RateLimited, limiter.admit, spec, concurrent=False)

    def test_per_minute(self):
        """
        C{requests_per_minute} allows that many at once, then one per
        1/rate of a minute; C{Retry-After} says how long to wait.
        """
        now = [0.0]
        limiter = KeyLimiter(lambda: now[0])
        spec = KeySpec(key_digest("k"), "k", requests_per_minute=6)
        for _ in range(6):
            limiter.admit(spec)()
        e = self.assertRaises(RateLimited, limiter.admit, spec)
        self.assertEqual(e.retry_after, 10)
        now[0] = 9.0
        self.assertRaises(RateLimited, limiter.admit, spec)
        now[0] = 10.0
        limiter.admit(spec)

    def test_clock_stepping_back_takes_nothing(self):
        """
        The bucket refills by wall-clock time: a clock set back (an NTP
        step, a resumed VM) refills nothing for that while, and takes
        nothing either, so the key is not locked out for the hour the
        clock went back.
        """
        now = [3600.0]
        limiter = KeyLimiter(lambda: now[0])
        spec = KeySpec(key_digest("k"), "k", requests_per_minute=6)
        limiter.admit(spec)()
        now[0] = 0.0
        for _ in range(5):
            limiter.admit(spec)()
        e = self.assertRaises(RateLimited, limiter.admit, spec)
        self.assertEqual(e.retry_after, 10)


class KeyedHTTPTests(SynchronousTestCase):
    def setUp(self):
        data: dict[str, Any] = copy.deepcopy(EDGE_YAML)
        data["api_keys"] = [
            {"sha256": sha("caller")},
            {"key": "one-at-a-time", "max_concurrent": 1},
            {"key": "slow", "requests_per_minute": 2},
        ]
        data["admin_keys"] = [{"sha256": sha("root")}]
        data["metrics_key"] = {"sha256": sha("scrape")}
        self.edge = EdgeHarness(data)
        self.node, self.pump, _ = self.edge.register()
        # StubTreq makes its request functions (get, request, ...) at run time.
        self.http: Any = StubTreq(self.edge.site.resource)

    def request(self, method, path, key=None, body=None):
        headers = {b"authorization": [b"Bearer " + key.encode()]} if key else {}
        data = json.dumps(body).encode() if body is not None else None
        d = self.http.request(method, BASE + path, headers=headers, data=data)
        self.http.flush()
        self.pump.flush()
        return d

    def result(self, d):
        self.http.flush()
        response = self.successResultOf(d)
        return response.code, response.headers, self.successResultOf(response.content())

    def test_sha256_keys(self):
        """
        Keys configured as SHA-256 digests are accepted when presented in
        full; anything else is refused.
        """
        self.assertEqual(self.result(self.request("GET", "/v1/status", "caller"))[0], 200)
        self.assertEqual(self.result(self.request("GET", "/v1/status", sha("caller")))[0], 401)
        self.assertEqual(self.result(self.request("GET", "/v1/status"))[0], 401)
        d = self.request("POST", "/v1/nodes/n1/commands", "root", {"command": "capabilities"})
        self.assertEqual(len(self.node.of("node_command_request")), 1)
        self.assertNoResult(d)

    def test_status_hides_provider_words_from_callers(self):
        """
        A provider's C{last_error} in C{/v1/status} is its code alone for a
        caller key (the provider's words can quote another key's request)
        and whole for an admin key.
        """
        body = {"adapter": "echo", "node": "n1", "input": "x"}
        running = self.request("POST", "/v1/runs", "caller", body)
        run_id = self.node.of("run_request")[-1].run_id
        failure = messages.run_error(code="provider_unreachable", message="refused: team-b's secret")
        self.node.connection.send(messages.run_event(run_id=run_id, seq=1, type="error", error=failure))
        self.pump.flush()
        self.result(running)

        def last_error(key):
            code, _, answer = self.result(self.request("GET", "/v1/status", key))
            self.assertEqual(code, 200)
            (provider,) = json.loads(answer)["nodes"][0]["providers"]
            return provider["last_error"]

        self.assertEqual(last_error("caller"), "provider_unreachable")
        self.assertEqual(last_error("root"), "provider_unreachable: refused: team-b's secret")

    def test_max_concurrent(self):
        """
        A key at C{max_concurrent} gets 429 with C{Retry-After} for one
        more; when its request ends, it may make another.
        """
        body = {"adapter": "echo", "node": "n1", "input": "x", "stream": True}
        running = self.request("POST", "/v1/runs", "one-at-a-time", body)
        code, headers, answer = self.result(self.request("POST", "/v1/runs", "one-at-a-time", body))
        self.assertEqual(code, 429)
        self.assertEqual(headers.getRawHeaders(b"retry-after"), [b"1"])
        self.assertEqual(json.loads(answer)["error"]["code"], "key_rate_limited")
        self.assertEqual(self.result(self.request("GET", "/v1/status", "caller"))[0], 200)
        run_id = self.node.of("run_request")[-1].run_id
        self.node.connection.send(messages.run_event(run_id=run_id, seq=1, type="complete"))
        self.pump.flush()
        self.assertEqual(self.result(running)[0], 200)
        self.assertEqual(self.result(self.request("GET", "/v1/status", "one-at-a-time"))[0], 200)

    def test_forwarded_background_runs_count_where_they_run(self):
        """
        A request another Edge of the cluster forwarded here was counted
        per minute there, but its work runs here: a background run holds
        the key's C{max_concurrent} here until it ends (the other Edge's
        hold ends with the 202 it relays), and per minute it is not
        counted again.
        """
        peer: Any = StubTreq(PeerGate(self.edge.site.resource, "peer-secret"))

        def forwarded(key, body):
            headers = {b"authorization": [b"Bearer " + key.encode()], PEER_HEADER: [b"peer-secret"]}
            d = peer.request("POST", BASE + "/v1/runs", headers=headers, data=json.dumps(body).encode())
            peer.flush()
            self.pump.flush()
            peer.flush()
            return self.successResultOf(d).code

        body = {"adapter": "echo", "node": "n1", "input": "x", "background": True, "stream": False}
        self.assertEqual(forwarded("one-at-a-time", body), 202)
        self.assertEqual(forwarded("one-at-a-time", body), 429)
        run_id = self.node.of("run_request")[-1].run_id
        self.node.connection.send(messages.run_event(run_id=run_id, seq=1, type="complete"))
        self.pump.flush()
        self.assertEqual(forwarded("one-at-a-time", body), 202)
        for _ in range(3):
            self.assertEqual(forwarded("slow", body), 202)

    def test_requests_per_minute(self):
        """
        Over C{requests_per_minute}, 429 with C{Retry-After} until the
        bucket refills.
        """
        for _ in range(2):
            self.assertEqual(self.result(self.request("GET", "/v1/status", "slow"))[0], 200)
        code, headers, _ = self.result(self.request("GET", "/v1/status", "slow"))
        self.assertEqual((code, headers.getRawHeaders(b"retry-after")), (429, [b"30"]))
        self.edge.clock.advance(30)
        self.assertEqual(self.result(self.request("GET", "/v1/status", "slow"))[0], 200)

    def test_metrics_key(self):
        """
        With C{metrics_key}, C{/metrics} needs it; a caller key is not it.
        """
        self.assertEqual(self.result(self.request("GET", "/metrics"))[0], 401)
        self.assertEqual(self.result(self.request("GET", "/metrics", "caller"))[0], 401)
        code, _, body = self.result(self.request("GET", "/metrics", "scrape"))
        self.assertEqual(code, 200)
        self.assertIn(b"iop_edge_node_connected", body)
        # Behind its key, the page still has the requests counted.
        self.assertIn(b'iop_edge_http_requests_total{code="401",method="GET",route="/metrics"}', body)


class MetricsEndpointTests(SynchronousTestCase):
    def test_separate_endpoint(self):
        """
        With C{listen.metrics}, C{/metrics} is served there and not on the
        HTTP port.
        """
        data: dict[str, Any] = copy.deepcopy(EDGE_YAML)
        data["listen"]["metrics"] = "tcp:0:interface=127.0.0.1"
        edge = EdgeHarness(data)
        # StubTreq makes its request functions (get, request, ...) at run time.
        http: Any = StubTreq(edge.site.resource)
        d = http.get(BASE + "/metrics")
        http.flush()
        self.assertEqual(self.successResultOf(d).code, 404)
        (metrics_site,) = [
            child.factory
            for child in edge.service
            if isinstance(child.factory, EdgeSite) and child.factory is not edge.site
        ]
        separate: Any = StubTreq(metrics_site.resource)
        d = separate.get(BASE + "/metrics")
        separate.flush()
        response = self.successResultOf(d)
        self.assertEqual(response.code, 200)
        # The HTTP port's requests are counted there all the same.
        body = self.successResultOf(response.content())
        self.assertIn(b'iop_edge_http_requests_total{code="404",method="GET",route="unmatched"}', body)
