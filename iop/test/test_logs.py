"""
log_format: the key in both configurations, the JSON line a log event
becomes, and the way the taps hand twistd a JSON observer.
"""

import io
import json

from twisted.application.service import Application, IService, Service
from twisted.logger import ILogObserver, LogEvent, Logger, LogLevel
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase
from zope.interface import provider

from iop.config import ConfigError, Section
from iop.logs import JSONLineObserver, LogFormatted, json_line, with_log_format
from iop.node.config import parse_config
from iop.testing.edge import EDGE_YAML, edge_config


def collector(events: list[LogEvent]) -> ILogObserver:
    """
    A log observer that appends every event to C{events}.
    """

    @provider(ILogObserver)
    def observe(event: LogEvent) -> None:
        events.append(event)

    return observe


def node_config(**data):
    return parse_config(Section({"edge": "tcp:host=e:port=1", "token": "t", **data}, "", "node.yaml"))


class ConfigKeyTests(SynchronousTestCase):
    def test_default_and_json(self):
        """
        Both daemons default to text and accept json.
        """
        self.assertEqual(edge_config().log_format, "text")
        self.assertEqual(edge_config({**EDGE_YAML, "log_format": "json"}).log_format, "json")
        self.assertEqual(node_config().log_format, "text")
        self.assertEqual(node_config(log_format="json").log_format, "json")

    def test_bad_value_names_the_key(self):
        """
        Any other value stops the daemon with one line naming the file and
        the key.
        """
        with self.assertRaises(ConfigError) as caught:
            edge_config({**EDGE_YAML, "log_format": "xml"})
        self.assertIn("edge.yaml: log_format:", str(caught.exception))
        with self.assertRaises(ConfigError) as caught:
            node_config(log_format="xml")
        self.assertIn("node.yaml: log_format:", str(caught.exception))


class JSONLineTests(SynchronousTestCase):
    def test_fields(self):
        """
        A line has the daemon, the time in UTC, the level, the module, the
        sentence the text format prints, and every keyword field of the
        call (the ids an operator searches for) as its own key.
        """
        events: list[LogEvent] = []
        log = Logger(namespace="iop.edge.links", observer=collector(events))
        log.warn("node {node} disconnected: {reason}", node="gpu-1", reason="heartbeat timeout", generation=3)
        record = json.loads(json_line(events[0], daemon="iop-edge"))
        self.assertEqual(record["daemon"], "iop-edge")
        self.assertEqual(record["level"], "warn")
        self.assertEqual(record["logger"], "iop.edge.links")
        self.assertEqual(record["message"], "node gpu-1 disconnected: heartbeat timeout")
        self.assertEqual((record["node"], record["reason"], record["generation"]), ("gpu-1", "heartbeat timeout", 3))
        self.assertTrue(record["time"].endswith("+00:00"))

    def test_one_line_with_traceback(self):
        """
        A failure's traceback rides along escaped: the record stays one
        line; values JSON cannot hold become their text.
        """
        events: list[LogEvent] = []
        log = Logger(namespace="x", observer=collector(events))
        try:
            raise ValueError("bad\nthing")
        except ValueError:
            log.failure("run {run_id} failed", Failure(), run_id="run-1", level=LogLevel.error, thing=object())
        line = json_line(events[0])
        self.assertNotIn("\n", line)
        record = json.loads(line)
        self.assertEqual(record["run_id"], "run-1")
        self.assertIn("ValueError: bad", record["traceback"])
        self.assertIsInstance(record["thing"], str)

    def test_observer_writes_lines(self):
        """
        The observer writes one line per event.
        """
        out = io.StringIO()
        observer = JSONLineObserver(out, "iop-node")
        Logger(namespace="n", observer=observer).info("one {x}", x=1)
        Logger(namespace="n", observer=observer).info("two")
        self.assertEqual([json.loads(line)["message"] for line in out.getvalue().splitlines()], ["one 1", "two"])


class LogFormattedTests(SynchronousTestCase):
    def test_text_is_the_service_itself(self):
        """
        With text, the tap returns its service unchanged.
        """
        service = Service()
        self.assertIs(with_log_format(service, "text", "iop-edge"), service)

    def test_json_offers_the_observer_to_twistd(self):
        """
        With json, adding the service to twistd's application sets the
        application's ILogObserver (which twistd logs to), and starting
        and stopping reach the daemon's own service.
        """
        service = Service()
        wrapped = with_log_format(service, "json", "iop-edge", out=io.StringIO())
        assert isinstance(wrapped, LogFormatted)
        application = Application("iop-edge")
        IService(wrapped).setServiceParent(application)
        self.assertIs(application.getComponent(ILogObserver), wrapped.observer)
        IService(application).startService()
        self.assertTrue(service.running)
        IService(application).stopService()
        self.assertFalse(service.running)
