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
