"""
Connections refused at the doors of a listener that speaks TLS
(L{iop.edge.tlsdoors}): closed at once, as without TLS, instead of left
open by Twisted's TLS wrapper.
"""

from OpenSSL import crypto
from twisted.internet.address import IPv4Address
from twisted.internet.interfaces import IPushProducer
from twisted.internet.protocol import Factory, Protocol
from twisted.internet.ssl import CertificateOptions
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.protocols.tls import TLSMemoryBIOFactory, TLSMemoryBIOProtocol
from twisted.python.failure import Failure
from twisted.test import iosim
from twisted.trial.unittest import SynchronousTestCase
from zope.interface import implementer

from iop.edge.http.site import EdgeSite
from iop.edge.limits import Limits
from iop.edge.test.test_http_limits import Recording
from iop.edge.tlsdoors import Refused, RefusingTLSFactory, endpoint_wraps
from iop.testing.tls import self_signed

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


def server_options() -> CertificateOptions:
    """
    TLS options with a throwaway self-signed certificate.
    """
    key, certificate = self_signed("edge")
    return CertificateOptions(
        privateKey=crypto.PKey.from_cryptography_key(key), certificate=crypto.X509.from_cryptography(certificate)
    )


@implementer(IPushProducer)
class SocketLike(iosim.FakeTransport):
    """
    An in-memory connection that, as a TCP one does, can be paused: so the
    HTTP channel registers itself as its TLS transport's producer.
    """

    def setTcpNoDelay(self, enabled: bool) -> None:
        pass


class Caller(Protocol):
    def __init__(self) -> None:
        self.received = b""
        self.lost = False

    def dataReceived(self, data: bytes) -> None:
        self.received += data

    def connectionLost(self, reason: Failure | None = None) -> None:
        self.lost = True


class SiteOverTLSTests(SynchronousTestCase):
    """
    The HTTP site behind an C{ssl:} listener's TLS (a
    L{TLSMemoryBIOFactory} around it), with a TLS caller, in memory.
    """

    def setUp(self) -> None:
        self.clock = Clock()
        self.resource = Recording()
        self.site = EdgeSite(
            self.resource, limits=Limits(max_body_bytes=1024, header_timeout_sec=10), reactor=self.clock
        )
        server = TLSMemoryBIOFactory(server_options(), False, self.site, self.clock).buildProtocol(ADDRESS)
        self.caller = Caller()
        client = TLSMemoryBIOFactory(
            CertificateOptions(verify=False), True, Factory.forProtocol(lambda: self.caller), self.clock
        ).buildProtocol(ADDRESS)
        assert server is not None and client is not None
        server_side, client_side = SocketLike(server, isServer=True), SocketLike(client, isServer=False)
        server.makeConnection(server_side)
        client.makeConnection(client_side)
        self.client = client
        self.pump = iosim.IOPump(client, server, client_side, server_side, False, self.clock)
        self.pump.flush()

    def send(self, data: bytes) -> None:
        self.client.write(data)
        self.pump.pump(advanceClock=True)
        self.pump.flush()

    def test_drain_closes_an_idle_connection_at_once(self) -> None:
        """
        A draining Edge's close of an idle keep-alive connection reaches
        its caller at once (TLS's close), not after the abort.
        """
        self.send(b"GET /x HTTP/1.1\r\nHost: e\r\n\r\n")
        self.resource.held[0].finish()
        self.pump.pump(advanceClock=True)
        self.assertTrue(self.caller.received.startswith(b"HTTP/1.1 200 "))
        closed: list[object] = []
        self.site.close_connections(self.clock, 5).addBoth(closed.append)
        self.pump.flush()
        self.assertEqual(closed, [None])
        self.assertTrue(self.caller.lost)
        self.assertEqual(self.site.doors.count, 0)

    def test_413_closes_at_once(self) -> None:
        """
        A 413 is followed by TLS's close at once, not by a connection left
        open until its deadline.
        """
        self.send(b"POST /x HTTP/1.1\r\nHost: e\r\nContent-Length: 300000000\r\n\r\n")
        self.assertTrue(self.caller.received.startswith(b"HTTP/1.1 413 "))
        self.assertTrue(self.caller.lost)
        self.assertEqual(self.site.doors.count, 0)
