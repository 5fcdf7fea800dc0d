"""
Connections refused at the doors of a listener that speaks TLS
(L{iop.edge.tlsdoors}): closed at once, as without TLS, instead of left
open by Twisted's TLS wrapper.
"""

from twisted.internet.address import IPv4Address
from twisted.internet.protocol import Factory, Protocol
from twisted.internet.ssl import CertificateOptions
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.protocols.tls import TLSMemoryBIOProtocol
from twisted.trial.unittest import SynchronousTestCase

from iop.edge.http.site import EdgeSite
from iop.edge.limits import Limits
from iop.edge.test.test_http_limits import Recording
from iop.edge.tlsdoors import Refused, RefusingTLSFactory, endpoint_wraps

ADDRESS = IPv4Address("TCP", "192.0.2.66", 40000)


class Doorman(Factory):
    """A factory that refuses every other connection (C{None})."""

    def __init__(self) -> None:
        self.count = 0

    def buildProtocol(self, addr: object) -> Protocol | None:
        self.count += 1
        return Protocol() if self.count % 2 else None


class RefusingTLSFactoryTests(SynchronousTestCase):
    def test_refusal_is_no_protocol(self) -> None:
        """
        A connection the wrapped factory refuses gets no protocol at all
        (the port closes it in its accept loop); one it takes is wrapped in
        TLS.
        """
        factory = RefusingTLSFactory(CertificateOptions(), False, Doorman())
        self.assertIsInstance(factory.buildProtocol(ADDRESS), TLSMemoryBIOProtocol)
        self.assertIsNone(factory.buildProtocol(ADDRESS))


class RefusedTests(SynchronousTestCase):
    def test_site_behind_an_endpoints_tls(self) -> None:
        """
        A site whose endpoint wraps connections (ssl:) gives a connection
        over its cap a protocol that aborts it at once; without, none.
        """
        site = EdgeSite(Recording(), limits=Limits(max_http_connections=1), reactor=Clock())
        self.assertIsNotNone(site.buildProtocol(ADDRESS))
        self.assertIsNone(site.buildProtocol(ADDRESS))
        site.refuse_with_protocol = True
        refused = site.buildProtocol(ADDRESS)
        self.assertIsInstance(refused, Refused)
        assert refused is not None
        transport = StringTransport()
        refused.makeConnection(transport)
        self.assertTrue(transport.disconnected)

    def test_endpoint_wraps(self) -> None:
        self.assertTrue(endpoint_wraps("ssl:8443:privateKey=k.pem"))
        self.assertFalse(endpoint_wraps("tcp:8080:interface=127.0.0.1"))
        self.assertFalse(endpoint_wraps("unix:/run/iop.sock"))
