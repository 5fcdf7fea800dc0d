"""
Node metrics: separate registries per instance and the /metrics page.
"""

from typing import cast

from twisted.trial.unittest import SynchronousTestCase
from twisted.web.iweb import IRequest
from twisted.web.test.requesthelper import DummyRequest

from iop.metricspage import MetricsPage
from iop.node.metrics import NodeMetrics


class MetricsTests(SynchronousTestCase):
    def test_separate_registries(self):
        """
        Two NodeMetrics do not share counters (and do not clash on names).
        """
        a, b = NodeMetrics(), NodeMetrics()
        a.run_ended("echo", "complete")
        self.assertEqual(a.value("iop_node_runs_total", {"adapter": "echo", "status": "complete"}), 1)
        self.assertIsNone(b.value("iop_node_runs_total", {"adapter": "echo", "status": "complete"}))

    def test_page(self):
        """
        /metrics renders the Prometheus text format of the Node's registry.
        """
        metrics = NodeMetrics()
        metrics.run_ended("echo", "error")
        metrics.in_flight("echo", 2)
        metrics.tunnel_body(123)
        request = DummyRequest([b""])
        body = MetricsPage(metrics.registry).render_GET(cast(IRequest, request)).decode()
        self.assertIn('iop_node_runs_total{adapter="echo",status="error"} 1.0', body)
        self.assertIn('iop_node_in_flight{adapter="echo"} 2.0', body)
        self.assertIn("iop_node_tunnel_bytes_total 123.0", body)
        self.assertTrue(request.responseHeaders.getRawHeaders(b"content-type", [b""])[0].startswith(b"text/plain"))
