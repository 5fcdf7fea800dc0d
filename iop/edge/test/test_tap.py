"""
The Edge's twistd plugin: discovery, the service tree makeService builds,
and a bad configuration refused before anything listens.
"""

import signal

from twisted.application.service import IServiceMaker, ServiceMaker
from twisted.logger import capturedLogs, formatEvent
from twisted.plugin import getPlugins
from twisted.python.filepath import FilePath
from twisted.trial.unittest import SynchronousTestCase

from iop.edge import tap
from iop.edge.listeners import with_backlog
from iop.edge.service import EdgeService
from iop.testing.edge import EdgeHarness

EDGE_YAML = """
listen: {nodes: "tcp:0:interface=127.0.0.1", http: "tcp:0:interface=127.0.0.1"}
nodes:
  - id: n1
    token: t1
    adapters: [{name: echo, type: echo, max_concurrency: 2}]
"""


class TapTests(SynchronousTestCase):
    def options(self, text):
        path = FilePath(self.mktemp())
        path.setContent(text.encode("utf-8"))
        options = tap.Options()
        options.parseOptions(["--config", path.path])
        return options

    def test_plugin_discovered(self):
        """
        twistd finds the C{iop-edge} tapname pointing at this module.
        """
        makers = {maker.tapname: maker for maker in getPlugins(IServiceMaker)}
        maker = makers["iop-edge"]
        assert isinstance(maker, ServiceMaker)
        self.assertEqual(maker.module, "iop.edge.tap")

    def test_service_tree(self):
        """
        makeService returns the EdgeService itself, with the Node port and
        the HTTP site as children (no console unless configured), none of
        them listening yet.
        """
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            self.addCleanup(signal.signal, signum, signal.getsignal(signum))
        service = tap.makeService(self.options(EDGE_YAML))
        self.assertIsInstance(service, EdgeService)
        assert isinstance(service, EdgeService)
        self.assertEqual(len(list(service)), 2)
        self.assertFalse(any(child.running for child in service))

    def test_bad_config_exits_with_one_line(self):
        """
        A bad edge.yaml stops twistd with a one-line message naming the key.
        """
        with self.assertRaises(SystemExit) as caught:
            tap.makeService(self.options(EDGE_YAML + "shutdown_grace_sec: -1\n"))
        message = str(caught.exception.code)
        self.assertIn("shutdown_grace_sec", message)
        self.assertNotIn("\n", message)


class ReloadTests(SynchronousTestCase):
    def test_not_while_draining(self):
        """
        A SIGHUP while the Edge drains is logged and ignored: nothing is
        read, applied or pushed to the Nodes it is letting go.
        """
        edge = EdgeHarness()
        node, pump, _ = edge.register(token="tok-1")
        edge.service.drain.draining = True
        with capturedLogs() as events:
            tap.reload(edge.service, "/no/such/edge.yaml", "SIGHUP")
        pump.flush()
        self.assertEqual(
            [formatEvent(e) for e in events], ["SIGHUP: not reloading /no/such/edge.yaml: the Edge is draining"]
        )
        self.assertEqual(node.of("config_refresh"), [])


class BacklogTests(SynchronousTestCase):
    def test_backlog_added_unless_given(self):
        """
        The Node and HTTP endpoints listen with a backlog of 1024 unless
        their string sets one (or their type takes none).
        """
        self.assertEqual(with_backlog("tcp:8080:interface=127.0.0.1"), "tcp:8080:interface=127.0.0.1:backlog=1024")
        self.assertEqual(with_backlog("tcp:8080:backlog=10"), "tcp:8080:backlog=10")
        self.assertEqual(with_backlog("ssl:7100:privateKey=k.pem"), "ssl:7100:privateKey=k.pem:backlog=1024")
        self.assertEqual(with_backlog("systemd:domain=INET:index=0"), "systemd:domain=INET:index=0")
