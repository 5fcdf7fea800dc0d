"""
Twisted's HTTP client, made cheaper per response for a relay.

A provider streams its answer in chunked encoding, one chunk per event.
Twisted's C{_ChunkedTransferDecoder} hands the body over chunk by chunk:
for a 64-event burst that arrives in one read, some 64 trips through a
state machine, the response's state dispatcher and the body protocol
(about a fifth of a Node's CPU per request, under cProfile). L{ChunkedDecoder}
decodes every complete chunk of a read in one pass and hands the read's
body over in one piece, with the same checks (hexadecimal sizes, a
bounded size line, chunk extensions, the CRLF after each chunk, bounded
trailers) and the same errors.

L{BytesBody} is a request body of bytes written in the turn the request
is: Twisted's C{FileBodyProducer} (treq's, too, for bytes and JSON)
writes through a cooperator, a turn after the headers, so the provider
got every request in two sends and woke up twice for it.

L{LeanConnectionPool} is an C{HTTPConnectionPool} whose connections decode
chunked bodies with it; L{lean_agent} is an C{Agent} on such a pool that
also builds the endpoint of a host once, not on every request (Twisted
encodes the host name with IDNA each time).

Both rest on names Twisted keeps private (the pool's C{_factory}, the
parser's C{_transferDecoders}, the agent's C{_endpointFactory}); the tests
in L{iop.test.test_httpclient} check that a response really goes through
L{ChunkedDecoder}, so a Twisted that changes them fails there, not in
production.
"""

import re
from collections.abc import Callable
from typing import Any

from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IAddress, IConsumer, IReactorTime, IStreamClientEndpoint
from twisted.web._newclient import HTTP11ClientProtocol
from twisted.web.client import URI, Agent, HTTPConnectionPool, _HTTP11ClientFactory
from twisted.web.http import _DataLoss, _MalformedChunkedDataError
from twisted.web.iweb import IAgentEndpointFactory, IBodyProducer
from zope.interface import implementer

#: The longest chunk-size line (with its extensions) accepted, as Twisted's.
MAX_SIZE_LINE = 1024
#: The most trailer bytes accepted, as Twisted's.
MAX_TRAILER_BYTES = 2**16

_HEX_DIGITS = b"0123456789abcdefABCDEF"
#: What a chunk extension may hold (Twisted's C{_chunkExtChars}: visible
#: ASCII but DEL, tab and space, and any byte over 127).
_EXTENSION_BYTES = b"\t" + bytes(range(0x20, 0x7F)) + bytes(range(0x80, 0x100))

#: A size line without extensions, the usual one: found and checked in
#: one match.
_PLAIN_SIZE_LINE = re.compile(rb"([0-9A-Fa-f]{1,%d})\r\n" % (MAX_SIZE_LINE - 1))

_SIZE, _DATA, _CRLF, _TRAILER, _DONE = range(5)


def _chunk_size(line: bytes) -> int:
    """
    The size of a chunk from its size line (without the CRLF).

    @raise _MalformedChunkedDataError: if the size is not hexadecimal
        digits only or an extension holds a byte no extension may.
    """
    size, _, extension = line.partition(b";")
    if not size or size.translate(None, _HEX_DIGITS):
        raise _MalformedChunkedDataError("Chunk-size must be an integer.")
    if extension and extension.translate(None, _EXTENSION_BYTES):
        raise _MalformedChunkedDataError(f"Invalid characters in chunk extensions: {extension!r}.")
    return int(size, 16)


class ChunkedDecoder:
    """
    A chunked transfer-encoded body, decoded a read at a time: what the
    complete chunks of one read carry (and the start of an incomplete
    one) goes to C{data_callback} in one call.

    Only a size line or a CRLF cut by a read is kept between reads (at
    most L{MAX_SIZE_LINE} bytes); trailers are kept up to
    L{MAX_TRAILER_BYTES} and searched from where the last search ended,
    so no input makes the work grow faster than its size.

    @param data_callback: called with body bytes.
    @param finish_callback: called once, after the last chunk and its
        trailers, with the bytes that followed them (the next response's).
    """

    def __init__(self, data_callback: Callable[[bytes], None], finish_callback: Callable[[bytes], None]) -> None:
        self.data_callback = data_callback
        self.finish_callback = finish_callback
        self._state = _SIZE
        #: Bytes of the current chunk still to come.
        self._left = 0
        #: The part of a size line or CRLF that the last read cut.
        self._rest = b""
        #: The trailers not yet read through, and where to search them on.
        self._trailer = bytearray()
        self._searched = 0
        self._trailer_bytes = 0

    def dataReceived(self, data: bytes) -> None:
        if not data:
            return
        if self._state == _DONE:
            raise RuntimeError("ChunkedDecoder.dataReceived called after the last chunk")
        if self._state == _TRAILER:
            self._trailers(data)
            return
        buf = self._rest + data if self._rest else data
        self._rest = b""
        view = memoryview(buf)
        pieces: list[memoryview] = []
        try:
            position = self._chunks(buf, view, pieces)
        finally:
            # What came before a malformed chunk is body all the same.
            if pieces:
                self.data_callback(pieces[0].tobytes() if len(pieces) == 1 else b"".join(pieces))
        if self._state == _TRAILER:
            self._trailers(buf[position:])
        else:
            self._rest = buf[position:]

    def _chunks(self, buf: bytes, view: memoryview, pieces: list[memoryview]) -> int:
        """
        Walk C{buf} from chunk to chunk, putting body bytes in C{pieces};
        @return: where the walk stopped (the end, an incomplete size line
            or CRLF, or the start of the trailers).
        """
        position, end = 0, len(buf)
        state, left = self._state, self._left
        try:
            while position < end:
                if state == _DATA:
                    take = min(left, end - position)
                    pieces.append(view[position : position + take])
                    position += take
                    left -= take
                    if left:
                        break
                    state = _CRLF
                elif state == _CRLF:
                    if end - position < 2:
                        break
                    if buf[position : position + 2] != b"\r\n":
                        raise _MalformedChunkedDataError("Chunk did not end with CRLF")
                    position += 2
                    state = _SIZE
                else:
                    plain = _PLAIN_SIZE_LINE.match(buf, position)
                    if plain is not None:
                        left = int(plain.group(1), 16)
                        position = plain.end()
                    else:
                        eol = buf.find(b"\r\n", position, position + MAX_SIZE_LINE + 1)
                        if eol == -1:
                            if end - position > MAX_SIZE_LINE:
                                raise _MalformedChunkedDataError(
                                    f"Chunk size line exceeds maximum of {MAX_SIZE_LINE} bytes."
                                )
                            break
                        left = _chunk_size(buf[position:eol])
                        position = eol + 2
                    if left == 0:
                        state = _TRAILER
                        break
                    stop = position + left
                    if buf[stop : stop + 2] == b"\r\n":
                        # The whole chunk and its CRLF are here: one step.
                        pieces.append(view[position:stop])
                        position, left = stop + 2, 0
                    else:
                        state = _DATA
        finally:
            self._state, self._left = state, left
        return position

    def _trailers(self, data: bytes) -> None:
        """
        Trailer lines up to the empty one that ends the body (their content
        is not used, as with Twisted's client); then the finish callback.
        """
        self._trailer += data
        while True:
            eol = self._trailer.find(b"\r\n", self._searched)
            if eol == -1:
                self._searched = max(len(self._trailer) - 1, 0)
                if self._trailer_bytes + len(self._trailer) > MAX_TRAILER_BYTES:
                    raise _MalformedChunkedDataError("Trailer headers data is too long.")
                return
            if eol == 0:
                rest = bytes(self._trailer[2:])
                self._trailer.clear()
                self._state = _DONE
                self.finish_callback(rest)
                return
            self._trailer_bytes += eol + 2
            if self._trailer_bytes > MAX_TRAILER_BYTES:
                raise _MalformedChunkedDataError("Trailer headers data is too long.")
            del self._trailer[: eol + 2]
            self._searched = 0

    def noMoreData(self) -> None:
        """
        The connection ended: an error unless the last chunk was read.

        @raise _DataLoss: if the body was cut short.
        """
        if self._state != _DONE:
            raise _DataLoss("Chunked decoder still expecting more data: the body was cut short.")


@implementer(IBodyProducer)
class BytesBody:
    """
    A request body held in memory, written whole when the request is
    (Twisted's C{FileBodyProducer} writes it a turn later, through a
    cooperator: a second send, and a second wake-up of the provider).
    """

    def __init__(self, body: bytes) -> None:
        self.body = body
        self.length = len(body)

    def startProducing(self, consumer: IConsumer) -> "Deferred[None]":
        consumer.write(self.body)
        return succeed(None)

    def pauseProducing(self) -> None:
        """
        Nothing to pause: the body is written at once.
        """

    def resumeProducing(self) -> None:
        """
        Nothing to resume: the body is written at once.
        """

    def stopProducing(self) -> None:
        """
        Nothing to stop: the body is written at once.
        """


def body_producer(data: Any) -> IBodyProducer:
    """
    treq's C{data_to_body_producer}: bytes (treq's JSON bodies among them)
    as a L{BytesBody}, anything else as treq would.
    """
    return BytesBody(data) if isinstance(data, bytes) else IBodyProducer(data)


#: The transfer decoders of a L{LeanConnectionPool}'s responses.
_DECODERS: dict[bytes, Any] = {b"chunked": ChunkedDecoder}


class _LeanClientProtocol(HTTP11ClientProtocol):
    """
    Twisted's HTTP/1.1 client protocol whose responses decode chunked
    bodies with L{ChunkedDecoder}.
    """

    _parser: Any

    def request(self, request: Any) -> Any:
        started = super().request(request)
        if self._parser is not None:
            # Set before any byte of the response can arrive (this is the
            # same turn); the parser looks the decoder up when the headers
            # are in.
            self._parser._transferDecoders = _DECODERS
        return started


class _LeanClientFactory(_HTTP11ClientFactory):
    def buildProtocol(self, addr: IAddress | None) -> HTTP11ClientProtocol:
        return _LeanClientProtocol(self._quiescentCallback)


class LeanConnectionPool(HTTPConnectionPool):
    """
    An C{HTTPConnectionPool} whose connections decode chunked bodies a
    read at a time (L{ChunkedDecoder}).
    """

    _factory = _LeanClientFactory


@implementer(IAgentEndpointFactory)
class _KnownEndpoints:
    """
    The endpoint of each scheme, host and port, built once by C{factory}
    and kept (an endpoint connects as often as asked). A relay talks to a
    few fixed hosts; more than L{LIMIT} forget the others.
    """

    LIMIT = 64

    def __init__(self, factory: IAgentEndpointFactory) -> None:
        self.factory = factory
        self.known: dict[tuple[bytes, bytes, int], IStreamClientEndpoint] = {}

    def endpointForURI(self, uri: URI) -> IStreamClientEndpoint:
        key = (uri.scheme, uri.host, uri.port)
        endpoint = self.known.get(key)
        if endpoint is None:
            if len(self.known) >= self.LIMIT:
                self.known.clear()
            endpoint = self.known[key] = self.factory.endpointForURI(uri)
        return endpoint


def lean_agent(reactor: IReactorTime, pool: HTTPConnectionPool, connect_timeout: float | None = None) -> Agent:
    """
    An C{Agent} on C{pool} (a L{LeanConnectionPool}, usually) that builds
    each host's endpoint once.
    """
    standard = Agent(reactor, connectTimeout=connect_timeout, pool=pool)
    return Agent.usingEndpointFactory(reactor, _KnownEndpoints(standard._endpointFactory), pool=pool)
