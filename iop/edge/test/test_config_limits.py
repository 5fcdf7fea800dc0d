"""
edge.yaml's C{limits:} section and C{register_timeout_sec}: documented
defaults when absent, every bad value refused naming its key.
"""

from twisted.trial.unittest import SynchronousTestCase

from iop.config import ConfigError
from iop.edge.limits import Limits
from iop.edge.test.test_config import parsed


class LimitsConfigTests(SynchronousTestCase):
    def assert_refused(self, mutate, *fragments):
        error = self.assertRaises(ConfigError, parsed, mutate)
        for fragment in fragments:
            self.assertIn(fragment, str(error))

    def test_defaults(self):
        """
        Without a C{limits:} section every limit has its documented default.
        """
        config = parsed(lambda d: None)
        self.assertEqual(config.limits, Limits())
        self.assertEqual(config.limits.preauth_frame_bytes, 65536)
        self.assertEqual(config.limits.max_unregistered_connections, 256)
        self.assertEqual(config.register_timeout_sec, 10)
        self.assertEqual(config.limits.header_timeout_sec, 10)
        self.assertEqual(config.limits.body_timeout_sec, 60)
        self.assertEqual(config.limits.max_http_connections, 10000)
        self.assertEqual(config.limits.max_body_bytes, 8 * 1024 * 1024)
        self.assertEqual(config.limits.max_http_connections_per_address, 256)

    def test_values(self):
        """
        Each key sets its limit.
        """
        config = parsed(
            lambda d: d.update(
                register_timeout_sec=3,
                limits={"preauth_frame_bytes": 4096, "max_unregistered_connections": 9},
            )
        )
        self.assertEqual((config.limits.preauth_frame_bytes, config.limits.max_unregistered_connections), (4096, 9))
        self.assertEqual(config.register_timeout_sec, 3)

    def test_bad_values(self):
        """
        Wrong types, values out of range and unknown keys are refused with
        the key named.
        """
        self.assert_refused(lambda d: d.update(limits={"preauth_frame_bytes": 10}), "limits.preauth_frame_bytes")
        self.assert_refused(lambda d: d.update(limits={"preauth_frame_bytes": "big"}), "limits.preauth_frame_bytes")
        self.assert_refused(lambda d: d.update(limits={"preauth_frame_bytes": 2**25}), "at most 16777216")
        self.assert_refused(
            lambda d: d.update(limits={"max_unregistered_connections": 0}), "limits.max_unregistered_connections"
        )
        self.assert_refused(lambda d: d.update(limits={"preauth": 1}), "limits.preauth", "unknown key")
        self.assert_refused(lambda d: d.update(limits=[1]), "limits")
        self.assert_refused(lambda d: d.update(register_timeout_sec=0), "register_timeout_sec")
        self.assert_refused(lambda d: d.update(limits={"header_timeout_sec": 0}), "limits.header_timeout_sec")
        self.assert_refused(lambda d: d.update(limits={"body_timeout_sec": -1}), "limits.body_timeout_sec")
        self.assert_refused(lambda d: d.update(limits={"max_http_connections": 0}), "limits.max_http_connections")
        self.assert_refused(lambda d: d.update(limits={"max_body_bytes": 2**30}), "limits.max_body_bytes", "at most")
        self.assert_refused(
            lambda d: d.update(limits={"max_http_connections_per_address": -1}),
            "limits.max_http_connections_per_address",
            "at least 0",
        )

    def test_http_values(self):
        """
        The HTTP limits are read from their keys.
        """
        limits = {"header_timeout_sec": 2.5, "body_timeout_sec": 30, "max_http_connections": 50, "max_body_bytes": 4096}
        config = parsed(lambda d: d.update(limits=limits))
        self.assertEqual(
            (
                config.limits.header_timeout_sec,
                config.limits.body_timeout_sec,
                config.limits.max_http_connections,
                config.limits.max_body_bytes,
            ),
            (2.5, 30, 50, 4096),
        )
        for value in (0, 8):
            config = parsed(lambda d, value=value: d.update(limits={"max_http_connections_per_address": value}))
            self.assertEqual(config.limits.max_http_connections_per_address, value)
