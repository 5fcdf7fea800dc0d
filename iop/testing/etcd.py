"""
etcd in memory: the L{iop.edge.cluster.etcd.IEtcd} calls the cluster
makes, answered at once from a dictionary, with revisions, leases that
expire on a clock, and watches. No process, thread or socket.

One L{MemoryEtcd} is the server; each Edge gets its own
L{MemoryEtcd.client}, which can be cut off alone (a partition) while
L{MemoryEtcd.stop} takes the whole server down (an outage). Like a real
etcd, a server that starts again gives every lease its whole TTL back.
A client can also lose the answers of calls the server applied
(L{MemoryEtcdClient.lose_answers}: a timeout after the request landed).
"""

from collections.abc import Callable
from typing import Any

from twisted.internet import defer
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from zope.interface import implementer

from iop.edge.cluster.etcd import Created, EtcdUnavailable, IEtcd, IWatch, KeyValue, WatchEvent


class MemoryEtcd:
    def __init__(self, clock: IReactorTime) -> None:
        self.clock = clock
        self.revision = 1
        self.data: dict[str, KeyValue] = {}
        #: lease id -> C{[ttl, its expiry or None]}
        self.leases: dict[int, list[Any]] = {}
        self.watches: list[MemoryWatch] = []
        self.up = True
        self._next_lease = 1000

    def client(self) -> "MemoryEtcdClient":
        return MemoryEtcdClient(self)

    # -- outages

    def stop(self) -> None:
        """
        The server goes down: every call fails, watches end, lease expiry
        pauses.
        """
        self.up = False
        for lease in self.leases.values():
            if lease[1] is not None and lease[1].active():
                lease[1].cancel()
            lease[1] = None
        for watch in list(self.watches):
            watch.end(EtcdUnavailable("etcd stopped"))

    def start(self) -> None:
        """
        The server is back; every lease gets its whole TTL again.
        """
        self.up = True
        for lease_id in self.leases:
            self._arm(lease_id)

    # -- the store

    def _arm(self, lease_id: int) -> None:
        lease = self.leases[lease_id]
        if lease[1] is not None and lease[1].active():
            lease[1].cancel()
        lease[1] = self.clock.callLater(lease[0], self.expire, lease_id)

    def expire(self, lease_id: int) -> None:
        """
        The lease ends (its TTL passed, or it was revoked): its keys go.
        """
        lease = self.leases.pop(lease_id, None)
        if lease is None:
            return
        if lease[1] is not None and lease[1].active():
            lease[1].cancel()
        for key in [k for k, kv in self.data.items() if kv.lease == lease_id]:
            self._delete(key)

    def _put(self, key: str, value: bytes, lease: int) -> int:
        self.revision += 1
        old = self.data.get(key)
        kv = KeyValue(key, value, old.create_revision if old else self.revision, self.revision, lease)
        self.data[key] = kv
        self._notify(WatchEvent("put", kv))
        return self.revision

    def _delete(self, key: str) -> None:
        self.revision += 1
        self.data.pop(key)
        self._notify(WatchEvent("delete", KeyValue(key, b"", 0, self.revision)))

    def _notify(self, event: WatchEvent) -> None:
        for watch in list(self.watches):
            if event.kv.key.startswith(watch.prefix):
                watch.on_event(event)


@implementer(IEtcd)
class MemoryEtcdClient:
    """
    One Edge's connection to a L{MemoryEtcd}; C{reachable = False} cuts it
    off alone.

    @ivar lost: C{{call name: count}}, how many of the next calls of that
        name the server applies but whose answer is lost.
    """

    def __init__(self, server: MemoryEtcd) -> None:
        self.server = server
        self.reachable = True
        self.calls: list[str] = []
        self.watches: list[MemoryWatch] = []
        self.lost: dict[str, int] = {}

    def lose_answers(self, name: str, count: int = 1) -> None:
        """
        The next C{count} calls of C{name} (C{"create"}, C{"put"}, ...)
        are applied by the server, and then fail here with
        L{EtcdUnavailable}, as a request that timed out after it landed.
        """
        self.lost[name] = self.lost.get(name, 0) + count

    def cut(self) -> None:
        """
        This client alone loses etcd (a partition): calls fail, its
        watches end.
        """
        self.reachable = False
        for watch in list(self.watches):
            watch.end(EtcdUnavailable("etcd is not reachable"))

    def heal(self) -> None:
        self.reachable = True

    def _check(self, name: str) -> MemoryEtcd:
        self.calls.append(name)
        if not (self.server.up and self.reachable):
            raise EtcdUnavailable("etcd is not reachable")
        return self.server

    def _answer(self, name: str, f: Callable[..., Any], *args: object) -> Deferred[Any]:
        try:
            answer = f(self._check(name), *args)
        except EtcdUnavailable as e:
            return defer.fail(e)
        if self.lost.get(name):
            self.lost[name] -= 1
            return defer.fail(EtcdUnavailable(f"{name}: timed out (applied, its answer lost)"))
        return defer.succeed(answer)

    def grant(self, ttl: float) -> Deferred[int]:
        def grant(server: MemoryEtcd) -> int:
            server._next_lease += 1
            server.leases[server._next_lease] = [ttl, None]
            server._arm(server._next_lease)
            return server._next_lease

        return self._answer("grant", grant)

    def keepalive(self, lease: int) -> Deferred[int]:
        def keepalive(server: MemoryEtcd) -> int:
            if lease not in server.leases:
                return 0
            server._arm(lease)
            return server.leases[lease][0]

        return self._answer("keepalive", keepalive)

    def revoke(self, lease: int) -> Deferred[None]:
        return self._answer("revoke", lambda server: server.expire(lease))

    def put(self, key: str, value: bytes, lease: int = 0) -> Deferred[int]:
        def put(server: MemoryEtcd) -> int:
            if lease and lease not in server.leases:
                raise EtcdUnavailable("requested lease not found")
            return server._put(key, value, lease)

        return self._answer("put", put)

    def range(self, key: str, prefix: bool = False) -> Deferred[tuple[int, list[KeyValue]]]:
        def range_(server: MemoryEtcd) -> tuple[int, list[KeyValue]]:
            if prefix:
                kvs = [server.data[k] for k in sorted(server.data) if k.startswith(key)]
            else:
                kvs = [server.data[key]] if key in server.data else []
            return server.revision, kvs

        return self._answer("range", range_)

    def create(self, key: str, value: bytes, lease: int) -> Deferred[Created]:
        def create(server: MemoryEtcd) -> Created:
            if key in server.data:
                return Created(False, server.revision, server.data[key])
            if lease not in server.leases:
                raise EtcdUnavailable("requested lease not found")
            return Created(True, server._put(key, value, lease))

        return self._answer("create", create)

    def replace(self, key: str, value: bytes, lease: int, mod_revision: int) -> Deferred[int | None]:
        def replace(server: MemoryEtcd) -> int | None:
            kv = server.data.get(key)
            if kv is None or kv.mod_revision != mod_revision:
                return None
            return server._put(key, value, lease)

        return self._answer("replace", replace)

    def delete_if(self, key: str, mod_revision: int) -> Deferred[bool]:
        def delete_if(server: MemoryEtcd) -> bool:
            kv = server.data.get(key)
            if kv is None or kv.mod_revision != mod_revision:
                return False
            server._delete(key)
            return True

        return self._answer("delete_if", delete_if)

    def watch(self, prefix: str, start_revision: int, on_event: Callable[[WatchEvent], object]) -> "MemoryWatch":
        watch = MemoryWatch(self.server, prefix, on_event)
        try:
            self._check("watch")
        except EtcdUnavailable as e:
            watch.done.errback(e)
            return watch
        # Only the present is kept: start_revision must be the next one.
        self.server.watches.append(watch)
        self.watches.append(watch)

        def forget(result: object) -> object:
            self.watches.remove(watch)
            return result

        watch.done.addBoth(forget)
        return watch


@implementer(IWatch)
class MemoryWatch:
    def __init__(self, server: MemoryEtcd, prefix: str, on_event: Callable[[WatchEvent], object]) -> None:
        self.server = server
        self.prefix = prefix
        self.on_event = on_event
        self.done: Deferred[None] = defer.Deferred()

    def end(self, error: Exception | None = None) -> None:

        if self in self.server.watches:
            self.server.watches.remove(self)
        if not self.done.called:
            if error is None:
                self.done.callback(None)
            else:
                self.done.errback(error)

    def cancel(self) -> None:
        self.end()
