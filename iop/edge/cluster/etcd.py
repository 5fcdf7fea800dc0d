"""
An etcd v3 client over etcd's JSON gateway (C{/v3/...}), with treq.

Why the gateway and not a gRPC client: every maintained Python etcd v3
client speaks gRPC through C{grpcio}, which brings its own threads and
event loop (or asyncio); none fits Twisted's reactor without blocking it
or bridging loops. The gateway is part of every etcd server since 3.3, is
plain HTTP/1.1 + JSON (keys and values base64, 64-bit integers as
strings), and treq already is a dependency. Only the calls the cluster
needs are here: lease grant, keep-alive and revoke; range; the three
transactions the cluster uses (create if absent, replace if unchanged,
delete if unchanged); and a watch (a streamed POST, one JSON object per
line).

Each call goes to one endpoint; a connection failure or timeout moves on
to the next endpoint of the list and tries once more there before
failing with L{EtcdUnavailable}. Nothing here blocks: every call returns a
Deferred, time comes from the reactor given.
"""

import base64
import json
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass
from typing import Any, cast

from twisted.internet import defer
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IPushProducer, IReactorTime
from twisted.internet.protocol import Protocol
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.client import Agent, HTTPConnectionPool, ResponseDone
from twisted.web.http import PotentialDataLoss
from twisted.web.iweb import IAgent, IResponse
from zope.interface import Attribute, Interface, implementer

#: How long one request (other than a watch) may take.
REQUEST_TIMEOUT_SEC = 2.0

#: A watch line longer than this closes the watch (nothing the cluster
#: writes comes near it).
MAX_WATCH_LINE = 4 * 1024 * 1024


class EtcdUnavailable(Exception):
    """
    No endpoint of etcd answered (refused, timed out, or an HTTP error).
    """


@dataclass(frozen=True)
class KeyValue:
    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    lease: int = 0


@dataclass(frozen=True)
class WatchEvent:
    """
    C{type} is C{"put"} or C{"delete"} (a delete's C{kv} has no value).
    """

    type: str
    kv: KeyValue


@dataclass(frozen=True)
class Created:
    """
    The answer of L{IEtcd.create}: C{created}, the store's C{revision}
    after it (the new key's revision when created), and the key as it was
    when it already existed.
    """

    created: bool
    revision: int
    existing: KeyValue | None = None


class IWatch(Interface):
    done = Attribute("A Deferred firing (or failing) when the watch ends.")

    def cancel() -> None:
        """
        End the watch; C{done} fires.
        """


class IEtcd(Interface):
    """
    What the cluster asks of etcd. Keys are text, values bytes; every
    method returns a Deferred failing with L{EtcdUnavailable} when etcd
    cannot be reached.
    """

    def grant(ttl: float) -> Deferred[int]:
        """
        A new lease of C{ttl} seconds: fires with its id.
        """

    def keepalive(lease: int) -> Deferred[int]:
        """
        Refresh C{lease}: fires with its remaining TTL, 0 if it is gone.
        """

    def revoke(lease: int) -> Deferred[None]:
        """
        End C{lease} now; every key under it is deleted.
        """

    def put(key: str, value: bytes, lease: int = 0) -> Deferred[int]:
        """
        Set C{key}: fires with the new revision.
        """

    def range(key: str, prefix: bool = False) -> Deferred[tuple[int, list[KeyValue]]]:
        """
        Fires with C{(revision, [KeyValue])}: the key, or every key under
        the prefix, in key order.
        """

    def create(key: str, value: bytes, lease: int) -> Deferred[Created]:
        """
        Set C{key} under C{lease} only if it does not exist: fires with a
        L{Created}.
        """

    def replace(key: str, value: bytes, lease: int, mod_revision: int) -> Deferred[int | None]:
        """
        Set C{key} only if its C{mod_revision} is still the one given:
        fires with the new revision, or C{None} if it changed (or is gone).
        """

    def delete_if(key: str, mod_revision: int) -> Deferred[bool]:
        """
        Delete C{key} only if its C{mod_revision} is the one given: fires
        with whether it was deleted.
        """

    def watch(prefix: str, start_revision: int, on_event: Callable[[WatchEvent], None]) -> IWatch:
        """
        Call C{on_event(WatchEvent)} for every change under C{prefix} from
        C{start_revision} on. @return: an L{IWatch}.
        """


def _b64(text: str | bytes) -> str:
    return base64.b64encode(text.encode("utf-8") if isinstance(text, str) else text).decode("ascii")


def _unb64(data: str | None) -> bytes:
    return base64.b64decode(data or "")


def prefix_end(prefix: str) -> bytes:
    """
    The C{range_end} that makes a range cover every key starting with
    C{prefix}.
    """
    raw = bytearray(prefix.encode("utf-8"))
    for i in range(len(raw) - 1, -1, -1):
        if raw[i] < 0xFF:
            raw[i] += 1
            return bytes(raw[: i + 1])
    return b"\0"


def _kv(data: dict[str, Any]) -> KeyValue:
    return KeyValue(
        key=_unb64(data.get("key")).decode("utf-8"),
        value=_unb64(data.get("value")),
        create_revision=int(data.get("create_revision", 0)),
        mod_revision=int(data.get("mod_revision", 0)),
        lease=int(data.get("lease", 0)),
    )


def _revision(answer: dict[str, Any]) -> int:
    return int(answer.get("header", {}).get("revision", 0))


@implementer(IEtcd)
class EtcdClient:
    """
    @param endpoints: etcd client URLs (C{http://127.0.0.1:2379}), tried in turn.
    @param reactor: the reactor (timers and connections).
    @param agent: an C{IAgent}; by default an L{Agent} with its own
        persistent connection pool.
    @param http: a treq C{HTTPClient} to use instead (tests: C{StubTreq}).
    """

    log = Logger()

    def __init__(
        self,
        endpoints: Iterable[str],
        reactor: IReactorTime,
        agent: IAgent | None = None,
        timeout: float = REQUEST_TIMEOUT_SEC,
        http: Any = None,
    ) -> None:
        if not endpoints:
            raise ValueError("at least one etcd endpoint is needed")
        self.endpoints = [e.rstrip("/") for e in endpoints]
        self.reactor = reactor
        self.timeout = timeout
        if http is None:
            if agent is None:
                pool = HTTPConnectionPool(reactor, persistent=True)
                pool.maxPersistentPerHost = 4
                agent = Agent(reactor, pool=pool)
            from treq.client import HTTPClient

            http = HTTPClient(agent)
        self._http = http
        self._current = 0

    # -- plumbing

    @defer.inlineCallbacks
    def _call(self, path: str, body: dict[str, Any]) -> Generator[Deferred[Any], Any, dict[str, Any]]:
        last = None
        for attempt in range(len(self.endpoints) + 1):
            index = (self._current + attempt) % len(self.endpoints)
            url = self.endpoints[index] + path
            try:
                d = self._http.post(
                    url, data=json.dumps(body).encode("utf-8"), headers={"content-type": ["application/json"]}
                )
                d.addTimeout(self.timeout, self.reactor)
                response = yield d
                d = response.content()
                d.addTimeout(self.timeout, self.reactor)
                data = yield d
            except defer.CancelledError:
                # Cancelled by its caller (a leave's deadline), not timed
                # out here: no other endpoint is asked.
                raise
            except Exception as e:
                last = f"{url}: {e.__class__.__name__}: {e}"
                continue
            if response.code != 200:
                last = f"{url}: HTTP {response.code}: {data[:200]!r}"
                if response.code < 500:
                    # etcd understood and refused: no other endpoint will differ.
                    raise EtcdUnavailable(last)
                continue
            self._current = index
            try:
                return json.loads(data)
            except ValueError:
                raise EtcdUnavailable(f"{url}: not JSON: {data[:200]!r}") from None
        raise EtcdUnavailable(last or "no endpoint")

    # -- leases

    @defer.inlineCallbacks
    def grant(self, ttl: float) -> Generator[Deferred[Any], Any, int]:
        answer = yield self._call("/v3/lease/grant", {"TTL": str(int(ttl))})
        if answer.get("error"):
            raise EtcdUnavailable(f"lease grant refused: {answer['error']}")
        return int(answer["ID"])

    @defer.inlineCallbacks
    def keepalive(self, lease: int) -> Generator[Deferred[Any], Any, int]:
        answer = yield self._call("/v3/lease/keepalive", {"ID": str(lease)})
        return int(answer.get("result", {}).get("TTL", 0))

    @defer.inlineCallbacks
    def revoke(self, lease: int) -> Generator[Deferred[Any], Any, None]:
        yield self._call("/v3/lease/revoke", {"ID": str(lease)})

    # -- keys

    @defer.inlineCallbacks
    def put(self, key: str, value: bytes, lease: int = 0) -> Generator[Deferred[Any], Any, int]:
        body = {"key": _b64(key), "value": _b64(value)}
        if lease:
            body["lease"] = str(lease)
        answer = yield self._call("/v3/kv/put", body)
        return _revision(answer)

    @defer.inlineCallbacks
    def range(self, key: str, prefix: bool = False) -> Generator[Deferred[Any], Any, tuple[int, list[KeyValue]]]:
        body = {"key": _b64(key)}
        if prefix:
            body["range_end"] = _b64(prefix_end(key))
        answer = yield self._call("/v3/kv/range", body)
        return _revision(answer), [_kv(kv) for kv in answer.get("kvs", [])]

    def _txn(
        self,
        compare: list[dict[str, Any]],
        success: Iterable[dict[str, Any]],
        failure: Iterable[dict[str, Any]] = (),
    ) -> Deferred[dict[str, Any]]:
        return self._call("/v3/kv/txn", {"compare": compare, "success": list(success), "failure": list(failure)})

    @defer.inlineCallbacks
    def create(self, key: str, value: bytes, lease: int) -> Generator[Deferred[Any], Any, Created]:
        answer = yield self._txn(
            [{"key": _b64(key), "target": "CREATE", "result": "EQUAL", "create_revision": "0"}],
            [{"request_put": {"key": _b64(key), "value": _b64(value), "lease": str(lease)}}],
            [{"request_range": {"key": _b64(key)}}],
        )
        if answer.get("succeeded"):
            return Created(True, _revision(answer))
        kvs = answer.get("responses", [{}])[0].get("response_range", {}).get("kvs", [])
        # Gone again between the compare and the range: report it as taken
        # by nobody in particular; the caller retries later.
        return Created(False, _revision(answer), _kv(kvs[0]) if kvs else None)

    @defer.inlineCallbacks
    def replace(
        self, key: str, value: bytes, lease: int, mod_revision: int
    ) -> Generator[Deferred[Any], Any, int | None]:
        answer = yield self._txn(
            [{"key": _b64(key), "target": "MOD", "result": "EQUAL", "mod_revision": str(mod_revision)}],
            [{"request_put": {"key": _b64(key), "value": _b64(value), "lease": str(lease)}}],
        )
        return _revision(answer) if answer.get("succeeded") else None

    @defer.inlineCallbacks
    def delete_if(self, key: str, mod_revision: int) -> Generator[Deferred[Any], Any, bool]:
        answer = yield self._txn(
            [{"key": _b64(key), "target": "MOD", "result": "EQUAL", "mod_revision": str(mod_revision)}],
            [{"request_delete_range": {"key": _b64(key)}}],
        )
        return bool(answer.get("succeeded"))

    # -- watch

    def watch(self, prefix: str, start_revision: int, on_event: Callable[[WatchEvent], None]) -> "_Watch":
        watch = _Watch(on_event)
        body = {
            "create_request": {
                "key": _b64(prefix),
                "range_end": _b64(prefix_end(prefix)),
                "start_revision": str(start_revision),
            }
        }
        url = self.endpoints[self._current] + "/v3/watch"
        d = self._http.post(url, data=json.dumps(body).encode("utf-8"), unbuffered=True)
        d.addTimeout(self.timeout, self.reactor)
        watch.connecting = d

        def connected(response: IResponse) -> None:
            watch.connecting = None
            if response.code != 200:
                raise EtcdUnavailable(f"{url}: HTTP {response.code}")
            response.deliverBody(watch)

        def failed(failure: Failure) -> None:
            watch.connecting = None
            if watch.done.called:
                return
            if watch.cancelled:
                watch.done.callback(None)
            else:
                watch.done.errback(EtcdUnavailable(f"{url}: watch: {failure.getErrorMessage()}"))

        d.addCallbacks(connected, failed)
        d.addErrback(failed)
        return watch


def body_producer(protocol: Protocol) -> IPushProducer:
    """
    The transport of a response body's protocol: the producer of that body
    (twisted.web's client gives one that can pause, resume and stop it).
    """
    return cast(IPushProducer, protocol.transport)


@implementer(IWatch)
class _Watch(Protocol):
    """
    The body of a watch: one JSON object per line, each with
    C{result.events}.
    """

    def __init__(self, on_event: Callable[[WatchEvent], None]) -> None:
        self.on_event = on_event
        self.done: Deferred[None] = Deferred()
        self.connecting: Deferred[IResponse] | None = None
        self.buffer = b""
        self.cancelled = False

    def dataReceived(self, data: bytes) -> None:
        self.buffer += data
        while b"\n" in self.buffer:
            line, self.buffer = self.buffer.split(b"\n", 1)
            if line.strip():
                self._line(line)
        if len(self.buffer) > MAX_WATCH_LINE:
            self._end(EtcdUnavailable("watch line too long"))

    def _line(self, line: bytes) -> None:
        try:
            result = json.loads(line).get("result") or {}
        except ValueError:
            self._end(EtcdUnavailable(f"watch: not JSON: {line[:200]!r}"))
            return
        if result.get("canceled"):
            self._end(EtcdUnavailable(f"watch cancelled by etcd: {result.get('cancel_reason', 'no reason')}"))
            return
        for event in result.get("events", []):
            kind = "delete" if event.get("type") == "DELETE" else "put"
            self.on_event(WatchEvent(kind, _kv(event.get("kv", {}))))

    def _end(self, error: Exception) -> None:
        if self.transport is not None:
            body_producer(self).stopProducing()
        if not self.done.called:
            self.done.errback(error)

    def connectionLost(self, reason: Failure | None = None) -> None:
        if self.done.called:
            return
        if self.cancelled:
            self.done.callback(None)
        elif reason is not None and reason.check(ResponseDone, PotentialDataLoss):
            self.done.errback(EtcdUnavailable("watch stream ended"))
        else:
            self.done.errback(EtcdUnavailable(f"watch stream lost: {reason.getErrorMessage() if reason else ''}"))

    def cancel(self) -> None:
        self.cancelled = True
        if self.connecting is not None:
            self.connecting.cancel()
        elif self.transport is not None:
            body_producer(self).stopProducing()
        if not self.done.called:
            self.done.callback(None)
