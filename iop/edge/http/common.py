"""
What every Edge HTTP surface shares: OpenAI-style error bodies, JSON
request parsing with a size cap, API-key checks, server-sent events, and
L{Call}, which ties one HTTP request to the work it started so that a
caller who goes away cancels that work (or leaves the queue).
"""

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Protocol, cast

from twisted.internet import defer
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.interfaces import IPushProducer, ITCPTransport, ITransport
from twisted.logger import Logger, LogLevel
from twisted.python.failure import Failure
from twisted.web.http import RESPONSES
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request

from iop.edge.errors import ServiceError
from iop.edge.flow import ReceiveWindow
from iop.edge.http.api import EdgeAPI, ListenerFor, OnQueued
from iop.edge.http.notes import note
from iop.edge.http.request import EdgeRequest
from iop.edge.http.validate import HTTPError, parse_body
from iop.edge.keys import KeyLimiter, KeySpec, find
from iop.edge.seam import Forward
from iop.edge.spec import RunSpec, new_id
from iop.edge.tenants import ANONYMOUS, Tenant
from iop.edge.tracing import TRACEPARENT, outgoing_traceparent
from iop.httpheaders import caller_request_headers, header_pairs, relay_headers

log = Logger()


#: The one table from a failure's kind (L{ServiceError.kind}) to its HTTP
#: status and OpenAI error type. Anything else is a 500 C{api_error}.
ERRORS_BY_KIND = {
    "invalid": (400, "invalid_request_error"),
    "unauthorized": (401, "authentication_error"),
    "forbidden": (403, "permission_error"),
    "not_found": (404, "not_found_error"),
    "method": (405, "invalid_request_error"),
    "conflict": (409, "invalid_request_error"),
    "too_large": (413, "invalid_request_error"),
    "busy": (429, "rate_limit_error"),
    "failed": (502, "api_error"),
    "unavailable": (503, "api_error"),
    "timeout": (504, "api_error"),
}


def error_body(kind: str, message: str, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": ERRORS_BY_KIND.get(kind, (500, "api_error"))[1],
            "code": code or kind,
            "param": param,
        }
    }


def release_producer(request: Request) -> None:
    """
    Unregister the response's producer (a stream's flow-control window),
    which twisted.web wants gone before the request finishes.
    """
    if getattr(request, "producer", None) is not None:
        request.unregisterProducer()


def register_producer(request: Request, producer: IPushProducer) -> None:
    """
    Register C{producer} as the response's producer, paused at once when
    the caller's connection is paused already (it did not drain what was
    written before): twisted.web pauses a producer only as its transport
    fills, never one registered while it is full, which would then write
    (or grant credit) and never see its stall timeout start. (twisted.web
    keeps that state in a private flag of the HTTP/1 channel; this is the
    one place that reads it.)
    """
    request.registerProducer(producer, True)
    if getattr(request.channel, "_waitingForTransport", False):
        producer.pauseProducing()


def answered_or_gone(request: Request) -> bool:
    """
    Whether nothing more may be written to C{request}: it was finished, or
    its caller hung up (twisted.web keeps that in a private flag; this is
    the one place that reads it).
    """
    return bool(request.finished or request._disconnected)


def cut_off(transport: ITransport | None) -> None:
    """
    Abort a connection at once, what it still buffers dropped: the only
    honest end left for an answer cut mid-way, or for a peer the Edge will
    not serve. (twisted declares a protocol's transport an C{ITransport};
    the Edge's connections are TCP or TLS ones, which abort.)
    """
    cast(ITCPTransport, transport).abortConnection()


def set_status(request: Request, code: int) -> None:
    """
    Set the response's status with its reason phrase: twisted.web's
    table lacks some codes the Edge answers (429 among them), for which it
    would say C{Unknown Status}; the standard library's table has them.
    """
    phrase = None
    if code not in RESPONSES:
        try:
            phrase = HTTPStatus(code).phrase.encode("ascii")
        except ValueError:
            pass  # (a code no table knows: twisted.web's default)
    request.setResponseCode(code, phrase)


#: OpenAI's header naming an answer (its SDKs show it as C{request_id}).
REQUEST_ID_HEADER = b"x-request-id"


def identify(request: Request, request_id: str | None = None) -> None:
    """
    Give the answer an C{x-request-id}, unless it has one already (a run's,
    or a provider's relayed by a tunnel): C{request_id}, else a fresh id,
    so that a caller can quote any answer of the Edge's own in a report.
    """
    if not request.responseHeaders.hasHeader(REQUEST_ID_HEADER):
        request.setHeader(REQUEST_ID_HEADER, (request_id or new_id("req")).encode("ascii"))


def write_json(request: Request, status: int, obj: object) -> None:
    release_producer(request)
    data = json.dumps(obj).encode("utf-8")
    set_status(request, status)
    request.setHeader(b"content-type", b"application/json")
    request.setHeader(b"content-length", str(len(data)).encode())
    request.write(data)
    request.finish()


def _as_service_error(failure: Failure) -> ServiceError:
    """
    The caller's view of a failure: a L{ServiceError} as it is; anything
    else is a bug on our side, a 500 C{internal_error} that names nothing
    internal (the traceback goes to the log).
    """
    if isinstance(failure.value, ServiceError):
        return failure.value
    return ServiceError("internal", "internal error", code="internal_error", status=500)


#: Answers that refuse work the Edge could not take now (counted by
#: reason in C{iop_edge_refusals_total}).
REFUSAL_STATUSES = frozenset({429, 503})


def refused(request: EdgeRequest, reason: str) -> None:
    """
    Mark C{request} as work the Edge refused for C{reason} (an error
    code), for its access log line and C{iop_edge_refusals_total}.
    """
    request.refused = reason
    note(request, refused=reason)


def write_error(request: EdgeRequest, error: ServiceError) -> None:
    """
    Answer with the OpenAI-style error JSON for a L{ServiceError}.
    """
    status = error.status or ERRORS_BY_KIND.get(error.kind, (500, None))[0]
    if status in REFUSAL_STATUSES:
        refused(request, error.code)
    if error.retry_after is not None:
        request.setHeader(b"retry-after", str(error.retry_after).encode("ascii"))
    identify(request)
    write_json(request, status, error_body(error.kind, error.message, error.code, getattr(error, "param", None)))


def read_json(request: EdgeRequest, max_bytes: int) -> dict[str, Any]:
    """
    The request body as a checked JSON object (L{parse_body}).

    The HTTP channel already refused a larger C{Content-Length} before
    reading (L{iop.edge.http.limits}); this is the last guard.

    @raise HTTPError: for an oversize, non-JSON or non-object body, or one
        nested too deeply or carrying strings that are not UTF-8.
    """
    assert request.content is not None  # (a request is handled once its body is read)
    data = request.content.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise HTTPError("too_large", f"request body exceeds {max_bytes} bytes (limits.max_body_bytes)")
    body = parse_body(data)
    # Kept for a tunnel that can forward the caller's bytes unchanged.
    request.raw_body = data
    return body


def caller_headers(request: Request, streamed: bool = False) -> list[tuple[str, str]]:
    """
    The caller's request headers that travel on to a provider through a
    tunnel (see L{iop.httpheaders}), with the Edge's own trace context in
    place of the caller's when tracing is on (L{iop.edge.tracing}).

    @param streamed: the request asks for an event stream: its
        C{Accept-Encoding} stays here, so the provider answers it
        uncompressed. Compression would hold each event in the provider's
        compressor, and the Edge writes a stream by whole events: it must
        see where one ends, to end a stream cut mid-way with an error event
        (and a caller told its place in the queue has its headers already,
        none of them a content coding).
    """
    pairs = caller_request_headers(header_pairs(request.requestHeaders))
    if streamed:
        pairs = [(name, value) for name, value in pairs if name.lower() != "accept-encoding"]
    own = getattr(request, "traceparent", None)
    if not own:
        return pairs
    return [(name, value) for name, value in pairs if name.lower() != TRACEPARENT] + [(TRACEPARENT, own)]


#: Headers the Edge sets on its own answers (its HTTP server on every
#: one, L{identify} on some); a relayed response carries those of the hop
#: it relays instead (or none).
_OWN_HEADERS = ("date", "server", REQUEST_ID_HEADER.decode())


def relay_response_headers(request: Request, pairs: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """
    Give C{request}'s response exactly the headers C{pairs} of the response
    it relays (a provider's, through a tunnel, or another Edge's), minus
    hop-by-hop ones: same-named ones the Edge's server set (Server, Date)
    are replaced, or removed when C{pairs} has none.

    @return: the pairs set.
    """
    response_headers = request.responseHeaders
    for name in _OWN_HEADERS:
        response_headers.removeHeader(name)
    relayed = relay_headers(list(pairs))
    for name, value in relayed:
        response_headers.addRawHeader(name, value)
    return relayed


def forwarded(request: Request) -> bool:
    """
    Whether C{request} came from another Edge of the cluster, on this
    Edge's peer listener (L{iop.edge.cluster.forward.PeerGate}).
    """
    return bool(getattr(request, "iop_forwarded", False))


def bearer(request: Request) -> str | None:
    header = (request.getHeader(b"authorization") or b"").decode("latin-1")
    if header.lower().startswith("bearer "):
        return header[7:].strip()
    return None


class KeySet(Protocol):
    """
    Where L{Keys} reads the keys from: the running L{EdgeConfig} (so a
    reloaded one's keys apply from the next request), or a fixed set.
    """

    @property
    def api_keys(self) -> tuple[KeySpec, ...]: ...

    @property
    def admin_keys(self) -> tuple[KeySpec, ...]: ...


@dataclass(frozen=True)
class FixedKeys:
    """A L{KeySet} that never changes."""

    api_keys: tuple[KeySpec, ...]
    admin_keys: tuple[KeySpec, ...]


class Keys:
    """
    Caller and admin API keys (L{iop.edge.keys}). With no caller keys
    configured the caller API is open; admin operations always need an
    admin key. A key with limits is held to them for each request it makes.

    @param api_keys: caller keys, as L{KeySpec}s or plain strings.
    @param admin_keys: admin keys, likewise.
    @param seconds: the clock of the per-minute limits.
    """

    def __init__(
        self,
        api_keys: Iterable[KeySpec | str],
        admin_keys: Iterable[KeySpec | str],
        seconds: Callable[[], float] | None = None,
    ) -> None:
        fixed = FixedKeys(tuple(_spec(k) for k in api_keys), tuple(_spec(k) for k in admin_keys))
        self._source: Callable[[], KeySet] = lambda: fixed
        self.limiter = KeyLimiter() if seconds is None else KeyLimiter(seconds)

    @classmethod
    def following(cls, source: Callable[[], KeySet], seconds: Callable[[], float] | None = None) -> "Keys":
        """
        Keys that are always C{source()}'s: a reload (SIGHUP) adds, removes
        or changes keys from the next request. What a key is spending (its
        requests in progress, its per-minute bucket) is kept by digest, so
        it stays counted across the change.
        """
        keys = cls((), (), seconds)
        keys._source = source
        return keys

    @property
    def api_keys(self) -> tuple[KeySpec, ...]:
        return self._source().api_keys

    @property
    def admin_keys(self) -> tuple[KeySpec, ...]:
        return self._source().admin_keys

    def check_caller(self, request: Request) -> KeySpec | None:
        """
        @return: the caller's L{KeySpec}, or C{None} when the API is open.
        @raise HTTPError: for a missing or unknown key.
        """
        if not self.api_keys:
            return None
        key = bearer(request)
        if key is None:
            raise HTTPError(
                "unauthorized", "an API key is required (Authorization: Bearer ...)", code="missing_api_key"
            )
        spec = find(self.api_keys, key) or find(self.admin_keys, key)
        if spec is None:
            raise HTTPError("unauthorized", "the API key is not valid", code="invalid_api_key")
        return spec

    def is_admin(self, spec: KeySpec | None) -> bool:
        """
        Whether C{spec} (a caller's L{KeySpec}) is an admin key.
        """
        return spec is not None and any(spec.digest == admin.digest for admin in self.admin_keys)

    def check_admin(self, request: Request) -> KeySpec:
        """
        @return: the admin key's L{KeySpec}.
        @raise HTTPError: unless an admin key is presented.
        """
        if not self.admin_keys:
            raise HTTPError("forbidden", "admin operations are disabled: configure admin_keys", code="admin_disabled")
        spec = find(self.admin_keys, bearer(request))
        if spec is None:
            raise HTTPError("forbidden", "this operation needs an admin API key", code="admin_key_required")
        return spec

    def admit(self, spec: KeySpec, request: EdgeRequest, runs_work: bool = True, per_minute: bool = True) -> None:
        """
        Hold C{request} to the limits of its key: C{requests_per_minute}
        (unless not C{per_minute}), and when it C{runs_work},
        C{max_concurrent} until it finishes or until the background run it
        started ends (L{hold_until_ended}); such work is counted even for
        a key without a C{max_concurrent}, which a reload may give it.

        @raise RateLimited: if the key is over a limit.
        """
        if not runs_work and (spec.requests_per_minute is None or not per_minute):
            return
        # Work is counted whatever the key's limits: a reload that gives it
        # a max_concurrent counts what it has running already.
        release: Callable[[], None] = self.limiter.admit(spec, runs_work, per_minute)
        request.key_hold = release

        def finished(_: object) -> None:
            if request.key_hold is release:
                release()

        request.notifyFinish().addBoth(finished)


def hold_until_ended(request: EdgeRequest, service: EdgeAPI, run_id: str | None) -> None:
    """
    Keep the key's count of requests in progress (C{max_concurrent}) for
    the background run C{run_id} that C{request} started until the run
    ends, not only until the request's response ends (a 202, or a caller
    who left): a key cannot escape its limit with background runs.
    """
    release = getattr(request, "key_hold", None)
    record = service.runs.get(run_id) if run_id else None
    if release is None or record is None:
        return
    request.key_hold = None
    service.runs.when_ended(record, release)


def proxy(service: EdgeAPI, request: EdgeRequest, failure: Failure) -> None:
    """
    Relay C{request} to the Edge the L{Forward} C{failure} names (the
    service answers so only in a cluster).
    """
    forward = failure.value
    assert isinstance(forward, Forward)
    service.cluster.proxy(request, forward)


def _spec(key: KeySpec | str) -> KeySpec:
    return key if isinstance(key, KeySpec) else KeySpec.plain(key)


def caller_name(request: Request) -> str:
    """
    The name of the key a request was admitted with (the label of the
    token metrics; never the key itself), or C{anonymous}.
    """
    return getattr(getattr(request, "caller_key", None), "name", None) or ANONYMOUS


#: The request header that asks for a priority class: an integer, capped
#: at the caller key's own C{priority} (docs/edge.md, "Tenants").
PRIORITY_HEADER = b"x-iop-priority"


def claim(spec: RunSpec, request: Request) -> RunSpec:
    """
    Make C{spec} the work of the request's caller key: its name (token
    metrics), its tenant (share, priority, token budgets) and the priority
    the request asks for with C{x-iop-priority} (never above the key's).

    @return: C{spec}.
    @raise HTTPError: a priority that is not an integer.
    """
    key = getattr(request, "caller_key", None)
    tenant = key.tenant() if key is not None else Tenant()
    spec.caller = tenant.name
    spec.tenant = tenant
    asked = request.getHeader(PRIORITY_HEADER)
    if asked is not None:
        try:
            spec.priority = min(int(asked.strip()), tenant.priority)
        except ValueError:
            raise HTTPError("invalid", "x-iop-priority must be an integer", code="invalid_priority") from None
    return spec


def run_owner(request: Request) -> str | None:
    """
    Whose runs a request may see, cancel and follow (docs/edge.md,
    "Isolation"): the name of its caller key, or C{None} for every run
    (an admin key, or an open caller API where everyone is C{anonymous}).
    """
    if getattr(request, "sees_all", True):
        return None
    return caller_name(request)


def query(request: Request, name: str) -> str | None:
    """
    A query parameter as text, or C{None}.
    """
    args: dict[bytes, list[bytes]] = request.args or {}
    values = args.get(name.encode("ascii"))
    if not values:
        return None
    return values[-1].decode("utf-8", "replace")


def query_int(request: Request, name: str, default: int, low: int, high: int) -> int:
    """
    An integer query parameter in C{[low, high]}.

    @raise HTTPError: for anything else.
    """
    text = query(request, name)
    if text is None or text == "":
        return default
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or not low <= value <= high:
        raise HTTPError("invalid", f"{name} must be an integer from {low} to {high}", code="invalid_" + name)
    return value


class JSONResource(Resource):
    """
    A leaf resource whose C{handle_<METHOD>(request)} return a JSON-able
    object (answered 200), a C{(status, object)} pair, a Deferred of
    either, or C{NOT_DONE_YET}; L{ServiceError}s become OpenAI-style
    errors. Unsupported methods get a JSON 405.
    """

    isLeaf = True
    admin = False
    #: Whether a POST here runs work (counted against its key's
    #: C{max_concurrent}); other requests count only per minute.
    runs_work = False

    def __init__(self, service: EdgeAPI, keys: Keys) -> None:
        super().__init__()
        self.service = service
        self.keys = keys

    def render(self, request: EdgeRequest) -> int:
        handler = getattr(self, "handle_" + request.method.decode("ascii", "replace"), None)
        if handler is None:
            write_error(request, HTTPError("method", f"{request.method.decode()} is not allowed here"))
            return NOT_DONE_YET
        d = defer.maybeDeferred(self._handle, handler, request)
        d.addCallback(self._respond, request)
        d.addErrback(self._failed, request)
        return NOT_DONE_YET

    def _handle(self, handler: Callable[[EdgeRequest], object], request: EdgeRequest) -> object:
        spec = (self.keys.check_admin if self.admin else self.keys.check_caller)(request)
        request.caller_key = spec
        request.sees_all = spec is None or self.admin or self.keys.is_admin(spec)
        runs_work = self.runs_work and request.method == b"POST"
        if spec is not None and not forwarded(request):
            self.keys.admit(spec, request, runs_work)
        elif spec is not None and runs_work:
            # Another Edge of the cluster forwarded it, counted per minute
            # there; the work runs here, and counts here against
            # max_concurrent (a background run until it ends: the other
            # Edge's hold ends with the 202 it relays).
            self.keys.admit(spec, request, per_minute=False)
        return handler(request)

    def read_json(self, request: EdgeRequest) -> dict[str, Any]:
        """
        The request body as a checked JSON object, under
        C{limits.max_body_bytes}.
        """
        return read_json(request, self.service.config.limits.max_body_bytes)

    def _respond(self, result: object, request: EdgeRequest) -> None:
        if result is NOT_DONE_YET or answered_or_gone(request):
            return
        if isinstance(result, tuple):
            status, body = result
            if status >= 400:
                # An error answer a handler returned (a session that could
                # not be ended) is the Edge's own, which always has an id.
                identify(request)
            write_json(request, status, body)
        else:
            write_json(request, 200, result)

    def _failed(self, failure: Failure, request: EdgeRequest) -> None:
        if not failure.check(ServiceError):
            # A bug on our side: logged with its traceback, answered 500.
            log.failure("request failed", failure, level=LogLevel.error)
        if not answered_or_gone(request):
            write_error(request, _as_service_error(failure))


class RequireKey(Resource):
    """
    A resource behind one key (C{metrics_key}): any other request is a
    JSON 401.
    """

    isLeaf = True

    def __init__(self, resource: Resource, spec: KeySpec) -> None:
        super().__init__()
        self.resource = resource
        self.spec = spec

    def render(self, request: EdgeRequest) -> bytes | int:
        if find((self.spec,), bearer(request)) is None:
            error = HTTPError(
                "unauthorized", "this endpoint needs its key (Authorization: Bearer ...)", code="missing_key"
            )
            request.setHeader(b"www-authenticate", b"Bearer")
            write_error(request, error)
            return NOT_DONE_YET
        return self.resource.render(request)


class NotFound(Resource):
    """
    A JSON 404 for every unknown path.
    """

    isLeaf = True

    def render(self, request: Request) -> bytes:
        path = request.path.decode("utf-8", "replace")
        data = json.dumps(error_body("not_found", f"no such endpoint: {path}")).encode()
        set_status(request, 404)
        request.setHeader(b"content-type", b"application/json")
        identify(request)
        return data


class Call:
    """
    One HTTP request and the work it started. When the caller goes away,
    a waiting submission is cancelled (the waiter leaves the queue) and
    started work is cancelled on its Node — unless it is a background run,
    which goes on (queued or running) until it ends.
    """

    def __init__(self, service: EdgeAPI, request: EdgeRequest, background: bool = False) -> None:
        self.service = service
        self.request = request
        self.background = background
        self.gone = False
        self.submitting: Deferred[str] | None = None
        self.work_id: str | None = None
        #: How a stream that began while the work waited (queue comments)
        #: ends when the work never starts: C{end_stream(ServiceError)}.
        self.end_stream: Callable[[ServiceError], None] | None = None
        request.notifyFinish().addErrback(self._caller_gone)

    def _caller_gone(self, failure: Failure) -> None:
        self.gone = True
        if self.background:
            return
        if self.work_id is not None:
            self.service.cancel(self.work_id)
        elif self.submitting is not None:
            # Not started: waiting for room, or for a node still
            # registering, in which case the submission has fired but is
            # chained to the pool's waiter, and cancel reaches that.
            self.submitting.cancel()

    def submit(self, spec: RunSpec, listener_for: ListenerFor, on_queued: OnQueued | None = None) -> int:
        """
        Submit C{spec} to the service for this request; errors before the
        work starts are answered here.

        @param on_queued: C{on_queued(position, eta_ms)}, told while the
            work waits for room (see L{queued_stream}).
        @return: C{NOT_DONE_YET}.
        """
        note(self.request, model=spec.model or spec.adapter)
        timing = getattr(self.request, "timing", None)
        if timing is not None:
            spec.timing = timing
        spec.traceparent = outgoing_traceparent(self.request)
        self.submitting = submitting = self.service.submit(
            spec, listener_for, may_forward=not forwarded(self.request), on_queued=on_queued
        )
        if spec.background:
            hold_until_ended(self.request, self.service, spec.run_id)
        submitting.addCallback(self._started)
        submitting.addErrback(self.fail)
        return NOT_DONE_YET

    def _started(self, work_id: str) -> None:
        self.work_id = work_id
        self.request.waiting = False
        dispatch = self.service.inflight.for_caller(work_id)
        if dispatch is not None:
            note(self.request, id=work_id, node=dispatch.placement.node_id, provider=dispatch.placement.provider_id)
        if self.gone and not self.background:
            self.service.cancel(work_id)

    def fail(self, failure: Failure) -> None:
        """
        Errback: answer with an error unless the response already began
        (then just end it) or the caller is gone.
        """
        if failure.check(Forward):
            # Another Edge of the cluster serves it (iop.edge.cluster.forward).
            if not self.gone:
                proxy(self.service, self.request, failure)
            return None
        if not failure.check(ServiceError, CancelledError):
            log.failure("call failed", failure, level=LogLevel.error)
        if self.gone or self.request.finished:
            return None
        if self.request.startedWriting:
            if self.end_stream is not None:
                error = _as_service_error(failure)
                refused(self.request, error.code)
                self.end_stream(error)
            self.finish()
            return None
        write_error(self.request, _as_service_error(failure))
        return None

    def queued_stream(
        self,
        tell: Callable[["EventStream", int, int], None],
        end: Callable[["EventStream", ServiceError], None],
    ) -> OnQueued:
        """
        Tell the caller of a streamed request where its work stands while
        it waits for room: C{tell(stream, position, eta_ms)} writes it on
        the response's event stream (which it begins), and
        C{end(stream, error)} ends that stream if the work never starts.

        @return: the C{on_queued} to submit with.
        """
        stream = EventStream(self.request)
        self.end_stream = lambda error: end(stream, error)

        def on_queued(position: int, eta_ms: int) -> None:
            if not (self.gone or self.request.finished):
                if not self.request.startedWriting:
                    # (The headers go with the first word of the queue.)
                    identify(self.request)
                self.request.waiting = True
                tell(stream, position, eta_ms)

        return on_queued

    def use_producer(self, producer: ReceiveWindow) -> None:
        """
        Let C{producer} (a stream's L{iop.edge.flow.ReceiveWindow}) be
        paused while the caller's connection does not drain (at once, when
        it is paused already: the window of a retried attempt continuing an
        answer the caller stopped reading); a caller that takes nothing for
        its stall timeout is cut off (which cancels the work).
        """
        if self.gone or self.request.finished:
            return
        if getattr(self.request.producer, "closed", False):
            # The window of an attempt whose answer another one continues.
            self.request.unregisterProducer()
        if self.request.producer is None:
            producer.on_stall = self._stalled
            register_producer(self.request, producer)

    def _stalled(self) -> None:
        if not self.gone and not self.request.finished:
            log.info("caller of {id} took nothing for too long; closing its connection", id=self.work_id)
            cut_off(self.request.channel.transport)

    def finish(self) -> None:
        if not self.gone and not self.request.finished:
            release_producer(self.request)
            self.request.finish()


class EventStream:
    """
    Server-sent events on an HTTP response: headers on the first event.
    """

    def __init__(self, request: Request) -> None:
        self.request = request
        # A response already begun (the caller was told its place in a
        # queue) continues as this stream.
        self.open = bool(getattr(request, "startedWriting", False))

    def start(self) -> None:
        if not self.open:
            self.open = True
            self.request.setResponseCode(200)
            self.request.setHeader(b"content-type", b"text/event-stream")
            self.request.setHeader(b"cache-control", b"no-cache")
            self.request.setHeader(b"x-accel-buffering", b"no")

    def send(self, obj: object) -> None:
        self.start()
        self.send_raw(json.dumps(obj))

    def send_raw(self, text: str) -> None:
        self.start()
        self.request.write(f"data: {text}\n\n".encode())

    def send_event(self, obj: object, event_id: int | None = None, name: str | None = None) -> None:
        """
        One event with its C{id:} (what C{Last-Event-ID} resumes from) and
        C{event:} name, when given.
        """
        self.start()
        head = ""
        if event_id is not None:
            head += f"id: {event_id}\n"
        if name is not None:
            head += f"event: {name}\n"
        self.request.write(f"{head}data: {json.dumps(obj)}\n\n".encode())

    def comment(self, text: str) -> None:
        """
        A comment line (ignored by readers): sends the headers, keeps
        proxies from timing the stream out.
        """
        self.start()
        self.request.write(f": {text}\n\n".encode())

    def done(self) -> None:
        """
        OpenAI's end-of-stream marker, C{data: [DONE]}.
        """
        self.send_raw("[DONE]")

    def fail(self, error: ServiceError, usage: dict[str, Any] | None = None) -> None:
        """
        End a stream that already began with an error event for C{error}:
        the body its HTTP error answer would have (so its C{type} is by its
        kind, L{ERRORS_BY_KIND}), with C{usage} (the usage so far as the
        caller's dialect shows it, when known: an answer cut mid-way, code
        C{incomplete}), then the end-of-stream marker, so an SDK ends its
        iteration cleanly and never takes it for a whole answer.
        """
        event = error_body(error.kind, error.message, error.code, getattr(error, "param", None))
        if usage is not None:
            event["usage"] = usage
        self.send(event)
        self.done()

    def send_bytes(self, event: bytes) -> None:
        """
        One event already rendered as bytes (C{data: ...\n\n}).
        """
        self.start()
        self.request.write(event)
