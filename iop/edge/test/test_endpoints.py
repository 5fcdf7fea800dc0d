"""
L{iop.edge.endpoints}: endpoint strings read as Twisted reads them, and
the loopback check that a substring test could not make (issue 12,
finding 5).
"""

from twisted.internet import endpoints
from twisted.trial.unittest import SynchronousTestCase

from iop.edge.endpoints import EndpointError, loopback_interface, split_endpoint


class SplitTests(SynchronousTestCase):
    def test_like_twisted(self):
        """
        Positional fields and keywords come out as Twisted's parser reads
        them (which keeps only the last of repeated keys), escapes included.
        """
        for description in (
            "tcp:7122:interface=127.0.0.1",
            "ssl:443:privateKey=/k\\:ey.pem:certKey=c.pem",
            "tcp:80:interface=a=b",
            "unix:/tmp/x\\=y:mode=600",
        ):
            positional, keywords = split_endpoint(description)
            args, kwargs = endpoints._parse(description)
            self.assertEqual((positional, dict(keywords)), (args, kwargs), description)

    def test_repeats_kept(self):
        """
        Repeated keys are all returned, in order.
        """
        self.assertEqual(
            split_endpoint("tcp:1:interface=127.0.0.1:interface=0.0.0.0"),
            (["tcp", "1"], [("interface", "127.0.0.1"), ("interface", "0.0.0.0")]),
        )


class LoopbackTests(SynchronousTestCase):
    def test_loopback_accepted(self):
        """
        IPv4 and IPv6 loopback literals are accepted, on tcp, tcp6 and ssl.
        """
        for description in (
            "tcp:7122:interface=127.0.0.1",
            "tcp:7122:interface=127.8.9.10",
            "tcp6:7122:interface=\\:\\:1",
            "ssl:7122:interface=127.0.0.1:privateKey=k.pem",
        ):
            self.assertTrue(loopback_interface(description).is_loopback, description)

    def test_refused(self):
        """
        Every way the substring test was fooled, and the other ways not to
        be on loopback, are refused.
        """
        for description in (
            "tcp:7999:interface=127.0.0.1:interface=0.0.0.0",
            "tcp:7999:interface=0.0.0.0:interface=127.0.0.1",
            "ssl:7999:interface=0.0.0.0:privateKey=/keys/127.0.0.1.pem",
            "tcp:7999:interface=localhost.example.org",
            "tcp:7999:interface=localhost",
            "tcp:7999",
            "tcp:7999:0.0.0.0",
            "tcp:7999:interface=10.0.0.1",
            "unix:/tmp/127.0.0.1",
            "tcp:7999:interface=127.0.0.1\\",
        ):
            self.assertRaises(EndpointError, loopback_interface, description)
