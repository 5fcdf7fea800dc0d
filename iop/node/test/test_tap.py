"""
The twistd plugin: discovery, options, what makeService builds or
refuses, and what SIGTERM/SIGINT do.
"""

import signal

from twisted.application.service import IServiceMaker, ServiceMaker
from twisted.plugin import getPlugins
from twisted.python.filepath import FilePath
from twisted.trial.unittest import SynchronousTestCase

from iop.daemon import stop_then_hurry
from iop.node import tap
from iop.node.service import NodeService
from iop.testing.reactor import RunningReactor, deliver_signal


def node_service(options: tap.Options) -> NodeService:
    """
    The tap's service, which is the Node's own (text logs: not wrapped).
    """
    service = tap.makeService(options)
    assert isinstance(service, NodeService)
    return service


class TapTests(SynchronousTestCase):
    def write(self, text):
        path = FilePath(self.mktemp())
        path.setContent(text.encode("utf-8"))
        return path.path

    def options(self, text):
        options = tap.Options()
        options.parseOptions(["--config", self.write(text)])
        return options

    def test_plugin_discovered(self):
        """
        twistd finds the C{iop-node} tapname pointing at this module.
        """
        makers = {maker.tapname: maker for maker in getPlugins(IServiceMaker)}
        self.assertIn("iop-node", makers)
        maker = makers["iop-node"]

        assert isinstance(maker, ServiceMaker)
        self.assertEqual(maker.module, "iop.node.tap")

    def test_options(self):
        """
        C{--config}/C{-c} defaults to conf/node.yaml.
        """
        options = tap.Options()
        options.parseOptions([])
        self.assertEqual(options["config"], "conf/node.yaml")
        options.parseOptions(["-c", "x.yaml"])
        self.assertEqual(options["config"], "x.yaml")

    def test_bad_config_exits_with_one_line(self):
        """
        A bad config stops twistd with status 1 and a one-line message
        naming the file and key.
        """
        path = self.write('edge: "tcp:host=h:port=1"\ntoken: t\nreconnect: {max_attempts: 0, interval_sec: 0}\n')
        options = tap.Options()
        options.parseOptions(["--config", path])
        with self.assertRaises(SystemExit) as caught:
            tap.makeService(options)
        message = str(caught.exception.code)
        self.assertIn(f"{path}: reconnect.interval_sec:", message)
        self.assertNotIn("\n", message)

    def test_bad_endpoint_names_key(self):
        """
        An edge string that is not a client endpoint is a config error
        naming C{edge}.
        """
        path = self.write('edge: "nonsense:1"\ntoken: t\n')
        options = tap.Options()
        options.parseOptions(["--config", path])
        with self.assertRaises(SystemExit) as caught:
            tap.makeService(options)
        self.assertIn(": edge: not a valid client endpoint", str(caught.exception.code))

    def test_service_tree(self):
        """
        makeService builds the store, the supervisor and, when configured,
        the metrics listener; nothing is started.
        """
        path = self.write('edge: "tcp:host=127.0.0.1:port=7100"\ntoken: t\nmetrics: "tcp:0:interface=127.0.0.1"\n')
        options = tap.Options()
        options.parseOptions(["--config", path])
        service = node_service(options)
        self.assertEqual(list(service), [service.store, service.supervisor, service.metrics_listener])
        self.assertFalse(service.running)

    def test_metrics_disabled(self):
        """
        Without C{metrics} no listener is built.
        """
        path = self.write('edge: "tcp:host=127.0.0.1:port=7100"\ntoken: t\n')
        options = tap.Options()
        options.parseOptions(["--config", path])
        service = node_service(options)
        self.assertIsNone(service.metrics_listener)
        self.assertEqual(len(list(service)), 2)

    def test_stop_signals_drain_then_hurry(self):
        """
        SIGTERM and SIGINT are taken from twistd (which would end the
        process "killed by" the signal instead of status 0): the first
        stops the reactor, so the service drains, and any later one calls
        the service's C{hurry} to end the drain at once.
        """
        for signum in (signal.SIGTERM, signal.SIGINT):
            self.addCleanup(signal.signal, signum, signal.getsignal(signum))
        reactor = RunningReactor()
        hurried = []
        self.patch(tap, "stop_then_hurry", lambda r, hurry: stop_then_hurry(reactor, hurry))
        service = node_service(self.options('edge: "tcp:host=127.0.0.1:port=7100"\ntoken: t\n'))
        self.patch(service.supervisor, "hurry", lambda: hurried.append(True))

        deliver_signal(signal.SIGTERM)
        self.assertEqual((reactor.stopped, hurried), (1, []))
        deliver_signal(signal.SIGINT)
        deliver_signal(signal.SIGTERM)
        self.assertEqual((reactor.stopped, hurried), (1, [True, True]))
