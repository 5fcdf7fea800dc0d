"""
node.yaml: defaults, the reconnect policy table, and errors that name the
offending key.
"""

import random
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from iop.config import ConfigError, Section
from iop.node.config import DEFAULT_STORE, ReconnectPolicy, load_config, parse_config
from iop.node.store import Retention


def parse(**data):
    data.setdefault("edge", "tcp:host=127.0.0.1:port=7100")
    data.setdefault("token", "t0ken")
    return parse_config(Section(data, "", "node.yaml"))


class ConfigTests(SynchronousTestCase):
    def assert_error_names(self, key, **data):
        with self.assertRaises(ConfigError) as caught:
            parse(**data)
        self.assertIn(f"node.yaml: {key}:", str(caught.exception))
        return str(caught.exception)

    def test_defaults(self):
        """
        Only edge and token are needed; the rest has documented defaults
        (metrics off).
        """
        config = parse()
        self.assertEqual(config.store, DEFAULT_STORE)
        self.assertEqual(config.reconnect, ReconnectPolicy(max_attempts=10, interval_sec=10.0))
        self.assertEqual(config.register_timeout_sec, 10.0)
        self.assertEqual(config.configure_timeout_sec, 60.0)
        self.assertEqual(config.shutdown_grace_sec, 30.0)
        self.assertIsNone(config.metrics)

    def test_policy_table(self):
        """
        max_attempts omitted = 10, 0 = unlimited, positive = that many;
        interval_sec omitted = 10.
        """
        self.assertEqual(parse(reconnect={}).reconnect, ReconnectPolicy(10, 10.0))
        unlimited = parse(reconnect={"max_attempts": 0, "interval_sec": 1}).reconnect
        self.assertTrue(unlimited.unlimited)
        self.assertFalse(unlimited.exhausted(10**6))
        finite = parse(reconnect={"max_attempts": 3, "interval_sec": 0}).reconnect
        self.assertEqual(finite, ReconnectPolicy(3, 0.0))
        self.assertFalse(finite.exhausted(2))
        self.assertTrue(finite.exhausted(3))

    def test_jitter(self):
        """
        reconnect.jitter: on by default (a half of the interval either
        way), false for a fixed interval, or a fraction from 0 to 1;
        anything else names the key.
        """
        self.assertEqual(parse(reconnect={}).reconnect.jitter, 0.5)
        self.assertEqual(parse(reconnect={"jitter": True}).reconnect.jitter, 0.5)
        self.assertEqual(parse(reconnect={"jitter": False}).reconnect.jitter, 0.0)
        self.assertEqual(parse(reconnect={"jitter": 0.2}).reconnect.jitter, 0.2)
        self.assertEqual(parse(reconnect={"jitter": 1}).reconnect.jitter, 1.0)
        for bad in (1.5, -0.1, "lots"):
            self.assert_error_names("reconnect.jitter", reconnect={"jitter": bad})

    def test_jitter_bounds(self):
        """
        The pause is drawn between interval * (1 - jitter) and interval *
        (1 + jitter); without jitter it is the interval itself.
        """
        policy = ReconnectPolicy(0, 10.0, jitter=0.5)

        def bounds(low: float, high: float) -> Any:
            # Not a draw: the bounds themselves, passed back by delay.
            return (low, high)

        self.assertEqual(policy.delay(bounds), (5.0, 15.0))
        draws = [policy.delay(random.Random(seed).uniform) for seed in range(200)]
        self.assertTrue(all(5.0 <= d <= 15.0 for d in draws))
        self.assertGreater(max(draws) - min(draws), 8.0)
        self.assertEqual(ReconnectPolicy(0, 10.0, jitter=0).delay(lambda low, high: 99.0), 10.0)

    def test_unlimited_needs_positive_interval(self):
        """
        Unlimited retrying with a zero or negative interval would spin: it
        is an error naming reconnect.interval_sec.
        """
        message = self.assert_error_names("reconnect.interval_sec", reconnect={"max_attempts": 0, "interval_sec": 0})
        self.assertIn("max_attempts is 0", message)
        self.assert_error_names("reconnect.interval_sec", reconnect={"max_attempts": 0, "interval_sec": -1})

    def test_invalid_values(self):
        """
        Wrong types and ranges are refused with the key's full path.
        """
        self.assert_error_names("reconnect.max_attempts", reconnect={"max_attempts": -1})
        self.assert_error_names("reconnect.max_attempts", reconnect={"max_attempts": 2.5})
        self.assert_error_names("reconnect.max_attempts", reconnect={"max_attempts": True})
        self.assert_error_names("reconnect.interval_sec", reconnect={"interval_sec": -1})
        self.assert_error_names("reconnect.interval_sec", reconnect={"interval_sec": "soon"})
        self.assert_error_names("register_timeout_sec", register_timeout_sec=0)
        for bad in (0, -5, "soon"):
            self.assert_error_names("configure_timeout_sec", configure_timeout_sec=bad)
        self.assertEqual(parse(configure_timeout_sec=2.5).configure_timeout_sec, 2.5)
        self.assert_error_names("metrics", metrics=9100)
        self.assert_error_names("store", store="")

    def test_store_mapping_and_retention(self):
        """
        store may be a path or a mapping with path and retention; a
        retention limit set to null is lifted, an absent one has its
        default, and mistakes name the key.
        """
        self.assertEqual(parse(store="x.db").retention, Retention())
        config = parse(store={"path": "file:h.db?mode=rwc", "retention": {"max_age_days": 2, "max_rows": None}})
        self.assertEqual(config.store, "file:h.db?mode=rwc")
        self.assertEqual(config.retention, Retention(max_age_days=2, max_rows=None))
        self.assertEqual(parse(store={"retention": {"max_rows": 10}}).store, DEFAULT_STORE)
        self.assertEqual(parse(store={"retention": {"max_rows": 10}}).retention.max_age_days, 30.0)
        self.assert_error_names("store.retention.max_rows", store={"retention": {"max_rows": 0}})
        self.assert_error_names("store.retention.max_age_days", store={"retention": {"max_age_days": "week"}})
        self.assert_error_names("store.retention.keep", store={"retention": {"keep": 1}})
        self.assert_error_names("store.file", store={"file": "x"})
        self.assert_error_names("store.path", store={"path": ""})
        # Past a float's range: pruning would fail with OverflowError each time.
        self.assert_error_names("store.retention.max_age_days", store={"retention": {"max_age_days": 10**400}})
        self.assert_error_names("register_timeout_sec", register_timeout_sec=10**400)

    def test_shutdown_grace(self):
        """
        shutdown_grace_sec takes any number from 0 (cancel at once); a
        negative or non-numeric value is refused naming the key.
        """
        self.assertEqual(parse(shutdown_grace_sec=0).shutdown_grace_sec, 0.0)
        self.assertEqual(parse(shutdown_grace_sec=2.5).shutdown_grace_sec, 2.5)
        message = self.assert_error_names("shutdown_grace_sec", shutdown_grace_sec=-1)
        self.assertIn("-1", message)
        self.assert_error_names("shutdown_grace_sec", shutdown_grace_sec="soon")
        self.assert_error_names("shutdown_grace_sec", shutdown_grace_sec=True)

    def test_required_keys(self):
        """
        edge and token are required.
        """
        with self.assertRaises(ConfigError) as caught:
            parse_config(Section({"token": "x"}, "", "node.yaml"))
        self.assertEqual(str(caught.exception), "node.yaml: edge: required")
        with self.assertRaises(ConfigError) as caught:
            parse_config(Section({"edge": "tcp:host=h:port=1"}, "", "node.yaml"))
        self.assertEqual(str(caught.exception), "node.yaml: token: required")

    def test_token_not_echoed(self):
        """
        A token of the wrong type is refused without repeating its value.
        """
        message = self.assert_error_names("token", token=123456789)
        self.assertNotIn("123456789", message)

    def test_unknown_keys(self):
        """
        Typos are refused, at the top level and inside reconnect.
        """
        self.assert_error_names("edge_url", edge_url="x")
        self.assert_error_names("reconnect.max_attempt", reconnect={"max_attempt": 3})

    def test_shipped_example(self):
        """
        conf/node.yaml is valid and points at the demo Edge.
        """
        import os

        import iop

        path = os.path.join(os.path.dirname(os.path.dirname(iop.__file__)), "conf", "node.yaml")
        if not os.path.exists(path):
            raise self.skipTest("conf/node.yaml is not next to the package")
        config = load_config(path)
        self.assertEqual(config.edge, "tcp:host=127.0.0.1:port=7100")
        self.assertEqual(config.token, "demo-node-token")


class SeveralEdgesConfigTests(SynchronousTestCase):
    def test_list(self):
        """
        C{edge} may list several endpoints (an Edge cluster): all are
        kept in order, the first is C{edge}.
        """
        config = parse_config(
            Section({"edge": ["tcp:host=a:port=1", "tcp:host=b:port=1"], "token": "t"}, "", "node.yaml")
        )
        self.assertEqual(config.edges, ("tcp:host=a:port=1", "tcp:host=b:port=1"))
        self.assertEqual(config.edge, "tcp:host=a:port=1")

    def test_bad_lists(self):
        """
        An empty list, an empty item or a repeated endpoint names the key.
        """
        for value, message in (([], "edge: must list"), (["x", ""], r"edge\[1\]"), (["x", "x"], "twice")):
            with self.assertRaisesRegex(ConfigError, message):
                parse_config(Section({"edge": value, "token": "t"}, "", "node.yaml"))
