"""
Refusing a connection at the doors of a listener that speaks TLS.

A listener's factory refuses a connection by building no protocol
(C{None}): the listening port then closes the socket inside its accept
loop, before a byte is read (L{iop.edge.nodeport}, L{iop.edge.http.site}).
Twisted's TLS wrapper does not expect that: it wraps the C{None}, fails
in C{makeConnection}, and the socket stays open with no deadline, one
more descriptor for every connection a stranger opens. So:

  - the Edge's own TLS wrapping (C{node_tls}) is a L{RefusingTLSFactory},
    which asks the wrapped factory first and builds nothing for a
    refusal: the socket is closed in the accept loop as without TLS;
  - a listener whose endpoint wraps connections itself (an C{ssl:}
    string, L{endpoint_wraps}) cannot be asked first: its factory gives a
    refused connection a L{Refused} protocol, which aborts it as soon as
    it has a transport.
"""

from twisted.internet.interfaces import IAddress, ITransport
from twisted.internet.protocol import Protocol
from twisted.protocols.tls import TLSMemoryBIOFactory, TLSMemoryBIOProtocol


class RefusingTLSFactory(TLSMemoryBIOFactory):
    """
    A L{TLSMemoryBIOFactory} that builds no protocol for a connection its
    wrapped factory refuses (C{None}).
    """

    def buildProtocol(self, addr: IAddress | None) -> TLSMemoryBIOProtocol | None:  # type: ignore[override]
        wrapped = self.wrappedFactory.buildProtocol(addr)
        if wrapped is None:
            return None
        return self.protocol(self, wrapped)


class Refused(Protocol):
    """
    The protocol of a connection refused behind a TLS wrapper the endpoint
    added: it aborts its connection at once (nothing is read or written).
    """

    def makeConnection(self, transport: ITransport) -> None:
        super().makeConnection(transport)
        transport.abortConnection()  # type: ignore[attr-defined]


def endpoint_wraps(description: str) -> bool:
    """
    Whether the server endpoint string C{description} wraps each
    connection's protocol itself (TLS: C{ssl:}), so that its factory must
    give a refused connection a protocol (L{Refused}).
    """
    return description.split(":", 1)[0] == "ssl"
