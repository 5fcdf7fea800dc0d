"""
A lean load generator for streamed HTTP answers: asyncio with raw sockets,
one event loop, no HTTP library.

Why not threads and C{http.client}: a thousand concurrent streams would be
a thousand threads, and on a 2-core machine the caller's own cost would
hide the cost being measured. Here a stream costs one socket and a few
method calls per read. Each request opens its own connection
(C{Connection: close}), as independent callers do.

Per stream it records the time to the first body byte, to the end, how
many events arrived (an event ends with C{separator}: a blank line for
server-sent events, a newline for NDJSON), and the longest gap between
two reads that brought events; optionally the body itself, to check it.
"""

import asyncio
import json
import time
from dataclasses import dataclass

SSE = b"\n\n"
NDJSON = b"\n"


def post(port, path, body, extra_headers=()):
    """
    The bytes of one HTTP/1.1 JSON POST (built once, sent many times).
    """
    data = json.dumps(body).encode()
    head = [
        f"POST {path} HTTP/1.1",
        f"Host: 127.0.0.1:{port}",
        "Content-Type: application/json",
        f"Content-Length: {len(data)}",
        "Connection: close",
        *extra_headers,
    ]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + data


@dataclass
class Result:
    """
    One request's outcome. Times are seconds from the start of the request
    (before connecting); C{first} and C{end} are C{None} if never reached.
    """

    status: int = 0
    first: float | None = None
    end: float | None = None
    events: int = 0
    max_gap: float = 0.0
    error: str | None = None
    body: bytes | None = None

    @property
    def ok(self):
        return self.error is None and self.status == 200 and self.end is not None


class _Stream(asyncio.Protocol):
    """
    Reads one response: its head, then its body (de-chunked when
    C{Transfer-Encoding: chunked}), counting events as they arrive.
    """

    def __init__(self, request, separator, keep, done):
        self.request = request
        self.separator = separator
        self.keep = keep
        self.done = done
        self.result = Result()
        self.start = time.perf_counter()
        self.head = b""
        self.in_body = False
        self.chunked = False
        self.pending = b""  # chunked framing not yet parsed
        self.chunk_left = 0  # body bytes left in the current chunk (+2 for its CRLF)
        self.tail = b""  # the end of the body so far, to find separators across reads
        self.last_event = None
        self.body = []

    def connection_made(self, transport):
        self.transport = transport
        transport.write(self.request)

    def data_received(self, data):
        if not self.in_body:
            self.head += data
            end = self.head.find(b"\r\n\r\n")
            if end < 0:
                return
            head, data = self.head[:end], self.head[end + 4 :]
            self.head = b""
            self.in_body = True
            try:
                self.result.status = int(head[9:12])
            except ValueError:
                self.result.error = "bad status line"
            self.chunked = b"transfer-encoding: chunked" in head.lower()
            if not data:
                return
        if self.chunked:
            self._dechunk(data)
        else:
            self._body(data)

    def _dechunk(self, data):
        buffer = self.pending + data if self.pending else data
        pos = 0
        pieces = []
        while pos < len(buffer):
            if self.chunk_left:
                take = min(self.chunk_left, len(buffer) - pos)
                pieces.append(buffer[pos : pos + take])
                self.chunk_left -= take
                pos += take
                continue
            line_end = buffer.find(b"\r\n", pos)
            if line_end < 0:
                break
            line = buffer[pos:line_end]
            pos = line_end + 2
            if not line:  # the CRLF that closes a chunk
                continue
            size = int(line.split(b";")[0], 16)
            if size == 0:
                self._body(b"".join(pieces))
                pieces = []
                self._finished()
                pos = len(buffer)
                break
            self.chunk_left = size
        self.pending = buffer[pos:]
        if pieces:
            self._body(b"".join(pieces))

    def _body(self, data):
        if not data:
            return
        now = time.perf_counter() - self.start
        result = self.result
        if result.first is None:
            result.first = now
        if self.keep:
            self.body.append(data)
        found = (self.tail + data).count(self.separator)
        if found:
            result.events += found
            if self.last_event is not None:
                gap = now - self.last_event
                if gap > result.max_gap:
                    result.max_gap = gap
            self.last_event = now
        self.tail = data[-(len(self.separator) - 1) :] if len(self.separator) > 1 else b""

    def _finished(self):
        if self.result.end is None:
            self.result.end = time.perf_counter() - self.start
        self.transport.close()

    def connection_lost(self, exc):
        if self.in_body and not self.chunked and self.result.end is None and exc is None:
            self._finished()  # a body delimited by the close
        if self.result.end is None and self.result.error is None:
            self.result.error = type(exc).__name__ if exc else "closed before the end"
        if self.keep:
            self.result.body = b"".join(self.body)
        if not self.done.done():
            self.done.set_result(self.result)


async def fetch(port, request, separator=SSE, keep=False, timeout=60.0):
    """
    Send C{request} (bytes from L{post}) to 127.0.0.1:C{port} and read the
    streamed answer to its end. Never raises: failures are in the result.
    """
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    stream = _Stream(request, separator, keep, done)
    transport = None
    try:
        transport, _ = await asyncio.wait_for(
            loop.create_connection(lambda: stream, "127.0.0.1", port), timeout=timeout
        )
        return await asyncio.wait_for(done, timeout=timeout)
    except (TimeoutError, OSError) as e:
        stream.result.error = type(e).__name__
        if transport is not None:
            transport.abort()
        return stream.result


async def load(port, requests, concurrency, separator=SSE, keep=False, timeout=60.0):
    """
    Send every request of C{requests} (a list of bytes), at most
    C{concurrency} at a time, each worker starting its next request when
    the previous one ended. @return: C{(results in request order, wall
    seconds)}.
    """
    results = [None] * len(requests)
    position = iter(range(len(requests)))

    async def worker():
        for i in position:
            results[i] = await fetch(port, requests[i], separator, keep, timeout)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(requests)))))
    return results, time.perf_counter() - start


def run_load(*args, **kwargs):
    """
    L{load} on a fresh event loop (from synchronous code).
    """
    return asyncio.run(load(*args, **kwargs))


def sse_payloads(body):
    """
    The C{data:} payloads of a server-sent event stream body, as text.
    """
    return [line[6:] for line in body.decode("utf-8").split("\n") if line.startswith("data: ")]


def chat_stream(body):
    """
    Read a streamed OpenAI chat completion: C{(text, finish_reason,
    ended)}, where C{ended} says the stream ended with C{data: [DONE]}.
    """
    payloads = sse_payloads(body)
    ended = bool(payloads) and payloads[-1] == "[DONE]"
    text, finish = [], None
    for payload in payloads[:-1] if ended else payloads:
        chunk = json.loads(payload)
        for choice in chunk.get("choices") or []:
            text.append((choice.get("delta") or {}).get("content") or "")
            finish = choice.get("finish_reason") or finish
    return "".join(text), finish, ended
