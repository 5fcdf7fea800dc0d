"""
The Edge's metrics on the whole gateway in memory: request counts and time
to first byte from the router, tokens and failure reasons from the bus,
disconnect causes, and the gauges read from the live service.
"""

import copy
import json

from prometheus_client.parser import text_string_to_metric_families
from twisted.internet.address import IPv4Address
from twisted.internet.testing import StringTransport
from twisted.trial.unittest import SynchronousTestCase

from iop.edge.metrics import disconnect_cause
from iop.run import Usage
from iop.testing.gateway import GATEWAY_YAML, Gateway

TEXT = "one two three four"


class EdgeMetricsTests(SynchronousTestCase):
    def setUp(self):
        self.gateway = Gateway()
        self.node = self.gateway.node()

    def samples(self):
        d = self.gateway.get("/metrics")
        _, _, body = self.successResultOf(self.gateway.read(d))
        return {
            (sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(body.decode())
            for sample in family.samples
        }

    def value(self, name, **labels):
        return self.samples().get((name, tuple(sorted(labels.items()))))

    def test_requests_ttfb_and_tokens(self):
        """
        A streamed run is counted once by route, method and status when it
        ends, its time to first byte is observed on the Edge's clock, and
        the tokens of its terminal are counted by node and kind.
        """
        self.gateway.clock.advance(1)
        d = self.gateway.post("/v1/runs", {"model": "talk", "input": TEXT})
        self.assertEqual(self.value("iop_edge_provider_in_use", node="n1", provider="echo", **{"class": "normal"}), 1)
        self.assertEqual(self.value("iop_edge_node_in_flight", node="n1"), 1)
        self.gateway.advance(1)
        self.successResultOf(self.gateway.read(d))
        self.assertEqual(self.value("iop_edge_http_requests_total", route="/v1/runs", method="POST", code="200"), 1)
        self.assertEqual(self.value("iop_edge_http_ttfb_seconds_count", route="/v1/runs"), 1)
        ttfb = self.value("iop_edge_http_ttfb_seconds_sum", route="/v1/runs")
        self.assertTrue(0 <= ttfb < 0.1, ttfb)
        self.assertEqual(
            self.value(
                "iop_edge_tokens_total", node="n1", kind="output", model_group="talk", provider="echo", key="anonymous"
            ),
            len(TEXT.split()),
        )
        self.assertEqual(self.value("iop_edge_run_terminals_total", type="complete", kind="run"), 1)
        self.assertEqual(self.value("iop_edge_provider_up", node="n1", provider="echo"), 1)

    def test_tunnel_terminals_and_tokens(self):
        """
        A tunnel counts among the terminals (kind tunnel) and the usage
        its body reported among the tokens, by model group and provider.
        """
        d = self.gateway.post("/v1/chat/completions", {"model": "big", "messages": [{"role": "user", "content": "x"}]})
        (_, sink, done), *_ = self.node.adapter("llm").tunnels
        sink.status(200)
        sink.headers([("content-type", "application/json")])
        sink.body(b"{}")
        sink.usage(Usage(3, 5, cached_input_tokens=2))
        done.callback(None)
        self.gateway.flush()
        self.successResultOf(self.gateway.read(d))
        labels = {"node": "n1", "model_group": "big", "provider": "llm", "key": "anonymous"}
        self.assertEqual(self.value("iop_edge_tokens_total", kind="input", **labels), 3)
        self.assertEqual(self.value("iop_edge_tokens_total", kind="cached_input", **labels), 2)
        self.assertIsNone(self.value("iop_edge_tokens_total", kind="reasoning", **labels))
        self.assertEqual(self.value("iop_edge_run_terminals_total", type="complete", kind="tunnel"), 1)

    def test_methods_a_stranger_makes_up_are_one_label(self):
        """
        A method outside HTTP's usual ones (a stranger's C{X0}, C{X1}, ...)
        is counted as C{_OTHER}: it cannot grow the metric by a series.
        """
        for i in range(5):
            d = self.gateway.http.request(f"X{i}", "http://edge.invalid/v1/status")
            self.gateway.flush()
            self.successResultOf(self.gateway.read(d))
        methods = {
            dict(labels).get("method") for (name, labels) in self.samples() if name == "iop_edge_http_requests_total"
        }
        self.assertEqual(methods, {"_OTHER"})

    def test_caller_gone_before_an_answer(self):
        """
        A request whose caller went away before any answer is counted with
        code 499 (nginx's "client closed request"), not as a 200.
        """
        self.gateway.post("/v1/chat/completions", {"model": "big", "messages": [{"role": "user", "content": "x"}]})
        self.gateway.hang_up()
        self.assertEqual(
            self.value("iop_edge_http_requests_total", route="/v1/chat/completions", method="POST", code="499"), 1
        )
        self.assertIsNone(
            self.value("iop_edge_http_requests_total", route="/v1/chat/completions", method="POST", code="200")
        )

    def test_queue_words_are_no_first_byte(self):
        """
        A stream told its place in the queue has its first byte when its
        answer comes, not with the queue's word; one that never got room
        (queue timeout) has none.
        """
        words = [{"role": "user", "content": " ".join(f"w{i}" for i in range(200))}]
        for _ in range(3):
            self.gateway.post("/v1/chat/completions", {"model": "talk", "stream": True, "messages": words})
        self.assertTrue(self.gateway.requests[-1].startedWriting)  # (its ": queued" comment)
        self.assertEqual(self.value("iop_edge_http_ttfb_seconds_count", route="/v1/chat/completions"), 2)
        self.gateway.advance(11)
        self.assertEqual(self.value("iop_edge_refusals_total", reason="queue_timeout"), 1)
        self.assertEqual(self.value("iop_edge_http_ttfb_seconds_count", route="/v1/chat/completions"), 2)

    def test_direct_work_waiting_is_counted(self):
        """
        Work for an adapter named as the model waits in its node's line of
        direct work, counted as C{NODE/ADAPTER} in C{iop_edge_queued} and in
        the status's C{direct_queues}.
        """
        for _ in range(3):
            self.gateway.post("/v1/runs", {"model": "echo", "input": TEXT})
        self.assertEqual(self.value("iop_edge_queued", model_group="n1/echo"), 1)
        status = self.successResultOf(self.gateway.read(self.gateway.get("/v1/status")))[2]
        self.assertEqual(json.loads(status)["direct_queues"], [{"name": "n1/echo", "queued": 1}])

    def test_errors_are_not_timed(self):
        """
        An error answer is counted with its status, and an unknown path
        under the route C{unmatched}; neither is a time to first byte.
        """
        d = self.gateway.post("/v1/runs", {"model": "nope", "input": TEXT})
        self.successResultOf(self.gateway.read(d))
        self.successResultOf(self.gateway.read(self.gateway.get("/v1/nope")))
        self.assertEqual(self.value("iop_edge_http_requests_total", route="/v1/runs", method="POST", code="404"), 1)
        self.assertEqual(self.value("iop_edge_http_requests_total", route="unmatched", method="GET", code="404"), 1)
        self.assertIsNone(self.value("iop_edge_http_ttfb_seconds_count", route="/v1/runs"))

    def test_only_work_is_timed(self):
        """
        C{GET /v1/runs} (the run history) shares its route with the
        C{POST} that runs work, but is no time to a first token: only the
        C{POST} is observed in C{iop_edge_http_ttfb_seconds}.
        """
        self.successResultOf(self.gateway.read(self.gateway.get("/v1/runs")))
        self.assertEqual(self.value("iop_edge_http_requests_total", route="/v1/runs", method="GET", code="200"), 1)
        self.assertIsNone(self.value("iop_edge_http_ttfb_seconds_count", route="/v1/runs"))

    def test_failure_reason_and_disconnect_cause(self):
        """
        A Node lost mid-run counts the run's failure by its code and the
        loss by its cause; its provider reads down.
        """
        d = self.gateway.post("/v1/runs", {"model": "talk", "input": TEXT})
        self.gateway.advance(0.1)
        self.node.session.close()
        self.gateway.flush()
        self.gateway.clock.advance(0)
        self.successResultOf(self.gateway.read(d))
        self.assertEqual(
            self.value("iop_edge_run_failures_total", node="n1", type="error", code="node_disconnected"), 1
        )
        self.assertEqual(self.value("iop_edge_node_disconnects_total", node="n1", cause="closed"), 1)
        self.assertEqual(self.value("iop_edge_provider_up", node="n1", provider="echo"), 0)

    def test_disconnect_causes(self):
        """
        Loss reasons fold into a few causes.
        """
        self.assertEqual(disconnect_cause("heartbeat timeout: nothing received for 5s"), "heartbeat_timeout")
        self.assertEqual(disconnect_cause("undecodable frame (3 bytes): x"), "protocol_error")
        self.assertEqual(disconnect_cause("Connection was closed cleanly."), "closed")
        self.assertEqual(disconnect_cause(None), "lost")

    def test_refusals_by_reason(self):
        """
        HTTP connections over their address's cap are counted as waits
        while they wait, and by reason when they are refused or wait out
        their header deadline.
        """
        site = self.gateway.edge.site
        cap = site.limits.max_http_connections_per_address
        transports = []
        for _ in range(2 * cap):
            protocol = site.buildProtocol(IPv4Address("TCP", "192.0.2.66", 40000))
            assert protocol is not None
            transports.append(StringTransport())
            protocol.makeConnection(transports[-1])
        # One more: refused at once (no protocol: the port closes it).
        self.assertIsNone(site.buildProtocol(IPv4Address("TCP", "192.0.2.66", 40000)))
        self.assertEqual(self.value("iop_edge_http_waiting_connections"), cap)
        self.assertEqual(self.value("iop_edge_http_address_waits_total"), cap)
        self.assertEqual(self.value("iop_edge_refusals_total", reason="max_http_connections_per_address"), 1)
        self.gateway.clock.advance(site.limits.header_timeout_sec)
        self.assertEqual(self.value("iop_edge_refusals_total", reason="address_wait_timeout"), cap)
        self.assertEqual(self.value("iop_edge_refusals_total", reason="header_timeout_sec"), cap)
        self.assertEqual(self.value("iop_edge_http_waiting_connections"), 0)
        self.assertIsNone(self.value("iop_edge_refusals_total", reason="max_unregistered_connections"))
        self.assertEqual(self.value("iop_edge_node_port_waiting_connections"), 0)


class KeyLabelTests(SynchronousTestCase):
    def test_tokens_by_key_name(self):
        """
        The C{key} label of the tokens is the configured name of the
        caller's key, never the key itself.
        """
        config = copy.deepcopy(GATEWAY_YAML)
        config["api_keys"] = [{"key": "sk-secret-1", "name": "alice"}]
        gateway = Gateway(config)
        gateway.node()
        d = gateway.http.post(
            "http://edge.invalid/v1/runs",
            json={"model": "talk", "input": TEXT},
            headers={"authorization": "Bearer sk-secret-1"},
        )
        gateway.advance(1)
        self.successResultOf(gateway.read(d))
        _, _, body = self.successResultOf(gateway.read(gateway.http.get("http://edge.invalid/metrics")))
        text = body.decode()
        self.assertIn('key="alice"', text)
        self.assertNotIn("sk-secret-1", text)
