"""
A fault-injecting provider in memory: the real C{openai_compat} adapter
(its deadlines, decoders, tunnel body, Retry-After and context-length
reading) in front of a scripted provider that answers on a L{Clock}, with
no socket and no thread. For tests of the whole gateway
(L{iop.testing.gateway}) under back-end failure.

The provider's answer is chosen by the request's C{model} (a run's target,
or a tunnel body's C{model}), with the names of the real fault server of
the integration tests (tests/support/fake_providers.py):

  - C{silent-model}: nothing at all, not even headers;
  - C{slow-model}: headers, then nothing (a slow first token);
  - C{cut-model}: a word, then the connection drops (not streamed: half
    of a body, then it drops);
  - C{stall-model}: a word, then silence (not streamed: half a body);
  - C{lossy-model}: half a JSON body, then the connection closes as if
    that were the end (a body without a length);
  - C{malformed-model}: a word, then an event that is not JSON;
  - C{nodone-model}: a whole answer with its finish reason, no C{[DONE]},
    the connection left open;
  - C{context-model}: HTTP 400 C{context_length_exceeded};
  - C{busy-model}: HTTP 429 with C{Retry-After: 2};
  - C{error-model}: HTTP 500;
  - anything else: the whole answer C{"a whole answer"}.

L{FaultyAdapter.down} makes every request answer 503 (an outage), which
its C{probe} sees too. A gateway test builds it where it would build an
C{openai_compat} adapter; its answers play synchronously, and its waits
and deadlines on the clock it is given.
"""

import json
from typing import Any, cast

from twisted.internet import defer
from twisted.internet.error import ConnectionAborted, ConnectionDone
from twisted.internet.interfaces import IPushProducer, IReactorTime
from twisted.internet.protocol import Protocol
from twisted.python.failure import Failure
from twisted.web.client import PotentialDataLoss, ResponseDone, ResponseFailed
from twisted.web.http_headers import Headers
from twisted.web.iweb import UNKNOWN_LENGTH, IResponse
from zope.interface import implementer

from iop.adapters.openai_compat import OpenAICompatAdapter

#: One step of a scripted answer: C{("write", bytes)}, C{("wait", seconds)},
#: C{("end",)} (the body ends), C{("close",)} (the connection closes, the
#: end of a body without a length), C{("cut",)} (the connection drops) or
#: C{("hold",)} (nothing more, the connection stays open).
Step = tuple[Any, ...]

WORDS = ["a ", "whole ", "answer"]


def event(delta: dict[str, Any], finish: str | None = None) -> bytes:
    choice = {"index": 0, "delta": delta, "finish_reason": finish}
    chunk = {"object": "chat.completion.chunk", "model": "faulty", "choices": [choice]}
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


ROLE = event({"role": "assistant", "content": ""})
WORD = event({"content": "partial "})
WHOLE_STREAM = [ROLE, *(event({"content": w}) for w in WORDS), event({}, "stop")]
WHOLE_BODY = json.dumps(
    {
        "object": "chat.completion",
        "model": "faulty",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(WORDS)}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 2, "completion_tokens": 3},
    }
).encode()
SSE = [(b"content-type", b"text/event-stream")]
JSON = [(b"content-type", b"application/json")]


Answer = tuple[int, list[tuple[bytes, bytes]], list[Step]]


def error_answer(
    status: int, message: str, code: str | None = None, extra: tuple[tuple[bytes, bytes], ...] = ()
) -> Answer:
    body = json.dumps({"error": {"message": message, "type": "error", "code": code}}).encode()
    return status, JSON + list(extra), [("write", body), ("end",)]


def answer(model: str, stream: bool) -> Answer | None:
    """
    The scripted answer to a request for C{model}: C{(status, headers,
    steps)}, or C{None} for no answer at all.
    """
    half: list[Step] = [("write", WHOLE_BODY[: len(WHOLE_BODY) // 2])]
    if model == "silent-model":
        return None
    if model == "slow-model":
        return 200, SSE if stream else JSON, [("hold",)]
    if model == "cut-model":
        return (200, SSE, [("write", ROLE + WORD), ("cut",)]) if stream else (200, JSON, [*half, ("cut",)])
    if model == "lossy-model":
        return 200, JSON, [*half, ("close",)]
    if model == "stall-model":
        return (200, SSE, [("write", ROLE + WORD), ("hold",)]) if stream else (200, JSON, [*half, ("hold",)])
    if model == "malformed-model":
        return 200, SSE, [("write", ROLE + WORD), ("wait", 0.01), ("write", b"data: {nope\n\n"), ("end",)]
    if model == "nodone-model":
        return 200, SSE, [("write", b"".join(WHOLE_STREAM)), ("hold",)]
    if model == "context-model":
        return error_answer(400, "the prompt is longer than the maximum context length", "context_length_exceeded")
    if model == "busy-model":
        return error_answer(429, "busy", extra=((b"retry-after", b"2"),))
    if model == "error-model":
        return error_answer(500, "the provider failed")
    if stream:
        return 200, SSE, [("write", b"".join(WHOLE_STREAM) + b"data: [DONE]\n\n"), ("end",)]
    return 200, JSON, [("write", WHOLE_BODY), ("end",)]


@implementer(IPushProducer)
class _BodyTransport:
    """
    What a body protocol is connected to: pausing holds the script,
    stopping drops the connection.
    """

    def __init__(self, answer: "ScriptedResponse") -> None:
        self.answer = answer

    def pauseProducing(self) -> None:
        self.answer.paused = True

    def resumeProducing(self) -> None:
        self.answer.paused = False
        self.answer.step()

    def stopProducing(self) -> None:
        self.answer.lose(Failure(ResponseFailed([Failure(ConnectionAborted())])))


@implementer(IResponse)
class ScriptedResponse:
    """
    An C{IResponse} whose body plays C{steps} on C{clock}.
    """

    version = (b"HTTP", 1, 1)
    previousResponse = None
    request = None

    def __init__(self, code: int, headers: list[tuple[bytes, bytes]], steps: list[Step], clock: IReactorTime) -> None:
        self.code = code
        self.phrase = b"OK" if code < 400 else b"ERROR"
        self.headers = Headers()
        for name, value in headers:
            self.headers.addRawHeader(name, value)
        self.length = UNKNOWN_LENGTH
        self.steps = list(steps)
        self.clock = clock
        self.protocol: Protocol | None = None
        self.paused = False
        self.waiting = False
        self.over = False

    def deliverBody(self, protocol: Protocol) -> None:
        self.protocol = protocol
        # The HTTP client hands a body protocol a producer, not a socket.
        protocol.makeConnection(cast(Any, _BodyTransport(self)))
        self.step()

    def setPreviousResponse(self, response: IResponse) -> None:
        pass

    def step(self) -> None:
        while self.steps and not (self.paused or self.waiting or self.over):
            kind, *args = self.steps.pop(0)
            if kind == "write":
                assert self.protocol is not None
                self.protocol.dataReceived(args[0])
            elif kind == "wait":
                self.waiting = True
                self.clock.callLater(args[0], self._waited)
            elif kind == "end":
                self.lose(Failure(ResponseDone()))
            elif kind == "close":
                # The end of a body delimited by the connection closing.
                self.lose(Failure(PotentialDataLoss()))
            elif kind == "cut":
                self.lose(Failure(ResponseFailed([Failure(ConnectionDone("cut"))])))
            elif kind == "hold":
                self.steps.insert(0, (kind,))
                return

    def _waited(self) -> None:
        self.waiting = False
        self.step()

    def lose(self, reason: Failure) -> None:
        if self.over or self.protocol is None:
            return
        self.over = True
        self.protocol.connectionLost(reason)


class FaultyAdapter(OpenAICompatAdapter):
    """
    The C{openai_compat} adapter with a scripted provider in memory (see
    the module docstring); it takes the adapter's options (deadlines
    included) and runs on the reactor (a L{Clock}) it is given.

    @ivar requests: C{(method, path, payload)} of every request, in order.
    @ivar down: while true, every request answers 503.
    """

    def __init__(self, name: str, max_concurrency: int, options: dict[str, Any] | None, reactor: Any) -> None:
        options = dict(options or {})
        options.setdefault("base_url", "http://faulty.invalid/v1")
        super().__init__(name, max_concurrency, options, reactor)
        self.requests: list[tuple[str, str, Any]] = []
        self.down = False

    def request(self, method: str, path: str, headers: Any = None, **kwargs: Any) -> "defer.Deferred[IResponse]":
        payload = kwargs.get("json")
        return self._answer(method, path, payload)

    def raw_request(self, method: str, path: str, headers: Any, body: bytes = b"") -> "defer.Deferred[IResponse]":
        try:
            payload = json.loads(body) if body else None
        except ValueError:
            payload = None
        return self._answer(method, path, payload)

    def _answer(self, method: str, path: str, payload: Any) -> "defer.Deferred[IResponse]":
        self.requests.append((method, path, payload))
        payload = payload if isinstance(payload, dict) else {}
        scripted: Answer | None
        if self.down:
            scripted = error_answer(503, "the provider is down")
        elif path.endswith("/models"):
            scripted = (200, JSON, [("write", b'{"data": []}'), ("end",)])
        else:
            scripted = answer(str(payload.get("model") or ""), payload.get("stream") is True)
        if scripted is None:
            # Never answered; cancelling it (a deadline, the caller) fails it.
            return defer.Deferred()
        status, headers, steps = scripted
        return defer.succeed(ScriptedResponse(status, headers, steps, self.clock))

    def stop(self) -> "defer.Deferred[None]":
        return defer.succeed(None)
