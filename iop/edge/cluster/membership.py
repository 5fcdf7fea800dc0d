"""
This Edge as a member of the cluster: its etcd lease, its membership key,
the nodes it owns, and the view of every other Edge it watches.

Keys (under C{cluster.prefix}, default C{/iop/}):

  - C{edges/<edge_id>}: this Edge (C{advertise}, C{state} up or
    draining), under its lease;
  - C{nodes/<node_id>}: the Edge that owns the node (C{edge}), under the
    owner's lease, created by a transaction that succeeds only if the key
    does not exist: so a node id is owned by one Edge at a time;
  - C{load/<edge_id>}: the room this Edge has per model group, under its
    lease (L{iop.edge.cluster.load}).

The revision etcd gives C{nodes/<id>} when this Edge claims it is the
connection's generation: it grows across the whole cluster, and the key
is released only by a transaction that names it, so a stale owner (whose
claim was taken over or expired) can never release or act for a node
another Edge owns.

The session: the lease is kept alive every third of its TTL. While etcd
does not answer, the session is C{lost}: the Edge refuses registrations
and keeps serving the nodes it owns (no other Edge can take them while
etcd is down; etcd gives leases their whole TTL back when it starts
again). When etcd answers that the lease is gone, every claim is void:
the Edge closes every Node link (C{on_void}) so its Nodes register again,
here or elsewhere, and joins again with a new lease.

What etcd is told is put again until it holds: this Edge's state (up or
draining) at every keep-alive until a put of it landed, a release at every
keep-alive until etcd answered it, and a claim whose answer was lost (etcd
may have applied it) is read back and, if etcd did create the key for no
connection, deleted, fenced on its revision. An unexpected error in the
join, the watch or one of the loops (keep-alive, load) is logged and that
step tried again after L{RETRY_SEC}, as when etcd does not answer.

The view is listed again every C{cluster.relist_sec} (anti-entropy): a
watch that stays open and silently delivers nothing shows no error, and
the view would stay stale for ever. A listing newer than what the watch
has shown is reconciled with the view as after a watch restart; if it
changed the view, the watch missed it, and is restarted.
"""

import json
from collections.abc import Callable
from typing import Any, NoReturn

from twisted.application.service import Service
from twisted.internet import defer
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.python.failure import Failure

from iop.edge.cluster.config import ClusterSpec
from iop.edge.cluster.etcd import Created, EtcdUnavailable, IEtcd, IWatch, KeyValue, WatchEvent
from iop.edge.seam import NotOwner

#: How soon a failed join or watch is tried again.
RETRY_SEC = 1.0

#: How often this Edge's load is looked at (and published when changed).
PUBLISH_INTERVAL_SEC = 0.25

#: How long a draining Edge waits for etcd to revoke its lease.
LEAVE_TIMEOUT_SEC = 3.0

OK = "ok"
LOST = "lost"
STARTING = "starting"


def _json(value: bytes) -> dict[str, Any]:
    try:
        data = json.loads(value)
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


class Membership(Service):
    """
    @param spec: the L{iop.edge.cluster.config.ClusterSpec}.
    @param etcd: an L{iop.edge.cluster.etcd.IEtcd}.
    @param clock: an C{IReactorTime}.
    @param on_void: C{on_void(reason)}, called when this Edge's lease is
        gone: every claim is void and every Node link must close.
    @param load: C{load()} returns the document this Edge publishes about
        its room (L{iop.edge.cluster.load.local_load}), or C{None}.
    @param on_moved: C{on_moved(node_id)}, called when another Edge claims
        a node (it registered there).
    @param on_gone: C{on_gone(edge_id)}, called when another Edge's
        membership key is gone (its lease expired or was revoked), seen by
        the watch or by a new listing after a gap in it (also when the key
        is back with a new lease: the Edge left and joined again).

    @ivar session: L{STARTING}, L{OK} or L{LOST}.
    @ivar claims: C{{node_id: revision}} of the nodes this Edge owns.
    @ivar edges: C{{edge_id: dict}} of the live membership keys.
    @ivar gone: C{{edge_id: when}} of the Edges whose key went.
    @ivar unsure: C{{node_id: lease}} of the claims whose answer was lost:
        etcd may have created the key (read back at the next keep-alive).
    @ivar owners: C{{node_id: {"edge", "revision"}}} from the watch.
    @ivar loads: C{{edge_id: dict}}, what each Edge publishes.
    """

    log = Logger()

    def __init__(
        self,
        spec: ClusterSpec,
        etcd: IEtcd,
        clock: IReactorTime,
        on_void: Callable[[str], object] | None = None,
        load: Callable[[], dict[str, Any] | None] | None = None,
        on_moved: Callable[[str], object] | None = None,
        on_gone: Callable[[str], object] | None = None,
    ) -> None:
        self.spec = spec
        self.edge_id = spec.edge_id
        self.etcd = etcd
        self.clock = clock
        self.on_void: Callable[[str], object] = on_void or (lambda reason: None)
        self.load = load
        self.on_moved: Callable[[str], object] = on_moved or (lambda node_id: None)
        self.on_gone: Callable[[str], object] = on_gone or (lambda edge_id: None)
        self.session = STARTING
        self.session_error: str | None = "not joined yet"
        self.lost_since: float | None = clock.seconds()
        self.lease: int | None = None
        self.draining = False
        self.claims: dict[str, int] = {}
        self.releasing: dict[str, int] = {}
        self.unsure: dict[str, int] = {}
        self.edges: dict[str, dict[str, Any]] = {}
        self.gone: dict[str, float] = {}
        #: The create revision and lease of each membership key: a new one
        #: is a new lease of that Edge (it left and joined again; a process
        #: that starts again before its old lease expired puts the key over
        #: under a new lease, its create revision unchanged).
        self._incarnations: dict[str, tuple[int, int]] = {}
        self.owners: dict[str, dict[str, Any]] = {}
        self.loads: dict[str, dict[str, Any]] = {}
        self.voids = 0
        self._keeper = LoopingCall(self._keep)
        self._keeper.clock = clock
        self._publisher = LoopingCall(self._publish)
        self._publisher.clock = clock
        self._relister = LoopingCall(self._relist)
        self._relister.clock = clock
        #: The newest revision the live watch has shown: that of the
        #: listing it started after, then of each of its events; and what
        #: it was at the last re-list (the watch was quiet since if equal).
        self._seen = 0
        self._seen_at_relist = 0
        self._published: dict[str, Any] | None = None
        #: What etcd holds at edges/<edge_id> under the current lease (the
        #: last put of it that landed), and whether a put of it is on its way.
        self._announced: bytes | None = None
        self._announcing = False
        #: How many claims of each node are on their way, and the unsure
        #: claims being read back.
        self._claiming: dict[str, int] = {}
        self._settling: set[str] = set()
        self._watch: IWatch | None = None
        self._retry: IDelayedCall | None = None
        self._retry_watch: IDelayedCall | None = None
        self._retry_loops: dict[str, IDelayedCall] = {}
        self._left = False

    # -- keys

    def key(self, kind: str, name: str = "") -> str:
        return f"{self.spec.prefix}{kind}/{name}"

    def _me(self) -> bytes:
        return json.dumps(
            {"advertise": self.spec.advertise, "state": "draining" if self.draining else "up"}, sort_keys=True
        ).encode()

    # -- joining and staying

    def startService(self) -> None:
        super().startService()
        self._join()
        self._watch_start()
        self._loop(self._publisher, PUBLISH_INTERVAL_SEC, "load")
        self._loop(self._relister, self.spec.relist_sec, "re-list")

    def _loop(self, loop: LoopingCall, interval: float, what: str, now: bool = False) -> None:
        """
        Start C{loop} every C{interval} seconds. An unexpected error stops
        a C{LoopingCall}: it is logged and the loop started again, at once,
        after L{RETRY_SEC} or C{interval} if shorter (a keep-alive must not
        wait for long). etcd not answering is no error here: each step
        handles it.
        """
        retry = self._retry_loops.pop(what, None)
        if retry is not None and retry.active():
            retry.cancel()
        if self._left or loop.running:
            return
        delay = min(RETRY_SEC, interval)

        def failed(failure: Failure) -> None:
            self.log.failure(
                "the {what} loop of Edge {edge} failed; starting it again in {delay}s",
                failure,
                what=what,
                edge=self.edge_id,
                delay=delay,
            )
            if not self._left:
                self._retry_loops[what] = self.clock.callLater(delay, self._loop, loop, interval, what, True)

        loop.start(interval, now=now).addErrback(failed)

    def _unexpected(self, failure: Failure, what: str) -> str:
        """
        Log an error that is not etcd failing to answer (a bug, or an
        answer this Edge cannot read): C{what} is then tried again as if
        etcd had not answered. @return: the reason.
        """
        self.log.failure("{what} of Edge {edge} failed unexpectedly", failure, what=what, edge=self.edge_id)
        return f"{what} failed: {failure.getErrorMessage() or type(failure.value).__name__}"

    def _join(self) -> Deferred[None]:
        self._retry = None
        if self._left:
            return defer.succeed(None)
        me = self._me()

        def granted(lease: int) -> Deferred[int] | None:
            if self._left:
                # leave() came while the lease was asked for: nobody keeps
                # it, and no key goes under it (it would expire anyway).
                self.etcd.revoke(lease).addErrback(lambda f: None)
                return None
            self.lease = lease
            return self.etcd.put(self.key("edges", self.edge_id), me, lease)

        def joined(_: object) -> None:
            if self._left:
                return
            self.log.info(
                "joined the Edge cluster as {edge} (lease {lease:x}, {ttl}s)",
                edge=self.edge_id,
                lease=self.lease,
                ttl=self.spec.lease_ttl_sec,
            )
            self._session_ok()
            self._published = None
            self._announced = me
            self._loop(self._keeper, self.spec.lease_ttl_sec / 3.0, "keep-alive")
            # Drained while the join was on its way: say so now.
            self._announce()

        def failed(failure: Failure) -> None:
            if self._left:
                return
            if failure.check(EtcdUnavailable):
                why = failure.getErrorMessage()
            else:
                why = self._unexpected(failure, "joining the cluster")
            self._session_lost(why)
            self._retry = self.clock.callLater(RETRY_SEC, self._join)

        d = defer.maybeDeferred(self.etcd.grant, self.spec.lease_ttl_sec)
        return d.addCallback(granted).addCallback(joined).addErrback(failed)

    def _keep(self) -> Deferred[None] | None:
        if self.lease is None:
            return None
        lease = self.lease
        d = self.etcd.keepalive(lease)

        def kept(ttl: int) -> None:
            if self.lease != lease:
                return None
            if ttl <= 0:
                return self._void(f"the etcd lease of Edge {self.edge_id} expired")
            if self.session != OK:
                self.log.info("etcd session of Edge {edge} is back: taking registrations again", edge=self.edge_id)
                self._session_ok()
            self._announce()
            self._retry_releases()
            self._settle_unsure()
            return None

        def failed(failure: Failure) -> None:
            failure.trap(EtcdUnavailable)
            self._session_lost(failure.getErrorMessage())

        return d.addCallbacks(kept, failed)

    def _announce(self) -> None:
        """
        Put this Edge's membership key again while etcd does not hold its
        state: a put that failed (etcd did not answer), or a state that
        changed while the session was lost. Tried at every keep-alive
        until it lands.
        """
        if self._announcing or self._left or self.session != OK or self.lease is None:
            return
        me = self._me()
        if me == self._announced:
            return
        lease = self.lease
        self._announcing = True

        def put(_: object) -> None:
            self._announcing = False
            if self.lease == lease:
                self._announced = me
                self._announce()

        def failed(failure: Failure) -> None:
            self._announcing = False
            failure.trap(EtcdUnavailable)
            self.log.info(
                "the state of Edge {edge} is not in etcd yet ({why}); trying again at the next keep-alive",
                edge=self.edge_id,
                why=failure.getErrorMessage(),
            )

        self.etcd.put(self.key("edges", self.edge_id), me, lease).addCallbacks(put, failed)

    def _session_ok(self) -> None:
        self.session = OK
        self.session_error = None
        self.lost_since = None

    def _session_lost(self, why: str) -> None:
        if self.session == OK:
            self.log.warn(
                "lost the etcd session of Edge {edge}: refusing node registrations until it is back"
                " (the nodes it owns are still served): {why}",
                edge=self.edge_id,
                why=why,
            )
            self.lost_since = self.clock.seconds()
        self.session = LOST
        self.session_error = why

    def _void(self, reason: str) -> None:
        """
        The lease is gone, and with it every key this Edge held: its claims
        are void. Close every Node link and join again.
        """
        self.voids += 1
        self.log.warn(
            "{reason}: its {count} node claim(s) are void; closing its Node links and joining again",
            reason=reason,
            count=len(self.claims),
        )
        self.lease = None
        self.claims.clear()
        self.releasing.clear()
        self.unsure.clear()
        self._announced = None
        self._session_lost(reason)
        if self._keeper.running:
            self._keeper.stop()
        # Not from inside the keep-alive loop's own call: joined() restarts it.
        self._retry = self.clock.callLater(0, self._join)
        self._tell(self.on_void, reason)

    # -- the view of the cluster

    def _watch_start(self) -> None:
        self._retry_watch = None
        if self._left:
            return
        d = defer.maybeDeferred(self.etcd.range, self.spec.prefix, prefix=True)

        def listed(answer: tuple[int, list[KeyValue]]) -> None:
            if self._left:
                return
            revision, kvs = answer
            self._reconcile(kvs)
            self._seen = self._seen_at_relist = revision
            self._watch = self.etcd.watch(self.spec.prefix, revision + 1, self._event)
            self._watch.done.addBoth(self._watch_ended)

        def failed(failure: Failure) -> None:
            if not failure.check(EtcdUnavailable):
                self._unexpected(failure, "watching the cluster")
            self._watch_ended(None)

        d.addCallback(listed).addErrback(failed)

    def _watch_ended(self, result: object) -> None:
        self._watch = None
        if not self._left and (self._retry_watch is None or not self._retry_watch.active()):
            self._retry_watch = self.clock.callLater(RETRY_SEC, self._watch_start)

    def _reconcile(self, kvs: list[KeyValue]) -> bool:
        """
        Make the view what etcd listed (C{kvs}, every key under the
        prefix), telling what changed unseen: an Edge whose key is not
        listed left (it is down), one listed under a new lease left and
        came back. Used after a watch restart and by the periodic re-list.

        @return: whether the view changed.
        """
        incarnations = dict(self._incarnations)
        before = (dict(self.edges), incarnations, dict(self.owners), dict(self.loads))
        self.edges.clear()
        self._incarnations.clear()
        self.owners.clear()
        self.loads.clear()
        for kv in kvs:
            self._apply("put", kv)
        for edge_id, incarnation in incarnations.items():
            now = self._incarnations.get(edge_id)
            if now is None:
                self._edge_gone(edge_id)
            elif now != incarnation and edge_id != self.edge_id:
                self._tell(self.on_gone, edge_id)
        return before != (self.edges, self._incarnations, self.owners, self.loads)

    def _relist(self) -> Deferred[None] | None:
        """
        List the prefix again (every C{relist_sec}): a watch that stays
        open and delivers nothing shows no error. A listing newer than
        what the watch has shown is reconciled (L{_reconcile}); if that
        changed the view while the watch showed nothing since the last
        re-list, the watch missed it: it is restarted, which lists once
        more and watches from there. (A watch that showed something since
        is alive; the change is one of its events still on its way.) A listing no newer is
        dropped: reconciling it would take back what the watch showed
        since (an Edge that just joined seen gone, its forwards cut).

        Skipped while no watch is live (its restart lists). The Deferred
        goes back to the C{LoopingCall}, which skips the ticks that come
        while a listing is in flight; an error is logged and the next
        tick lists again.
        """
        watch = self._watch
        if watch is None or self._left:
            return None

        def listed(answer: tuple[int, list[KeyValue]]) -> None:
            revision, kvs = answer
            seen = self._seen
            quiet, self._seen_at_relist = seen == self._seen_at_relist, seen
            if self._watch is not watch or revision <= seen:
                return
            if self._reconcile(kvs) and quiet:
                self.log.warn(
                    "the etcd watch of Edge {edge} seems silent: the view listed again at revision {revision}"
                    " differs from what the watch showed (up to revision {seen}); restarting the watch",
                    edge=self.edge_id,
                    revision=revision,
                    seen=seen,
                )
                watch.cancel()

        def failed(failure: Failure) -> None:
            if failure.check(EtcdUnavailable):
                self.log.info(
                    "could not list the cluster again ({why}); trying at the next re-list",
                    why=failure.getErrorMessage(),
                )
            else:
                self._unexpected(failure, "listing the cluster again")

        d: Deferred[None] = defer.maybeDeferred(self.etcd.range, self.spec.prefix, prefix=True).addCallback(listed)
        return d.addErrback(failed)

    def _event(self, event: WatchEvent) -> None:
        self._seen = max(self._seen, event.kv.mod_revision)
        self._apply(event.type, event.kv)

    def _apply(self, kind: str, kv: KeyValue) -> None:
        rest = kv.key[len(self.spec.prefix) :]
        section, _, name = rest.partition("/")
        if not name:
            return
        if section == "edges":
            if kind == "put":
                incarnation = (kv.create_revision, kv.lease)
                before = self._incarnations.get(name)
                self.edges[name] = _json(kv.value)
                self._incarnations[name] = incarnation
                self.gone.pop(name, None)
                if before is not None and before != incarnation and name != self.edge_id:
                    # Its key put over under a new lease: the process this
                    # Edge forwarded to is not the one there now.
                    self.log.info("Edge {edge} joined the cluster again under a new lease", edge=name)
                    self._tell(self.on_gone, name)
            else:
                self._incarnations.pop(name, None)
                if self.edges.pop(name, None) is not None:
                    self._edge_gone(name)
        elif section == "nodes":
            if kind == "put":
                edge = _json(kv.value).get("edge")
                self.owners[name] = {"edge": edge, "revision": kv.mod_revision}
                if edge != self.edge_id:
                    self._tell(self.on_moved, name)
            else:
                self.owners.pop(name, None)
        elif section == "load":
            if kind == "put":
                self.loads[name] = _json(kv.value)
            else:
                self.loads.pop(name, None)

    def _edge_gone(self, edge_id: str) -> None:
        self.gone[edge_id] = self.clock.seconds()
        if edge_id != self.edge_id:
            self.log.info("Edge {edge} left the cluster", edge=edge_id)
            self._tell(self.on_gone, edge_id)

    def _tell(self, callback: Callable[[str], object], what: str) -> None:
        """
        Call C{callback(what)} (C{on_void}, C{on_moved}, C{on_gone}): an
        error in it is logged, and never stops the view or the join.
        """
        try:
            callback(what)
        except Exception:
            self.log.failure(
                "telling Edge {edge} of a change in the cluster ({what}) failed", edge=self.edge_id, what=what
            )

    # -- ownership

    def claim(self, node_id: str) -> Deferred[int]:
        """
        Make this Edge the owner of C{node_id}.

        @return: a Deferred firing with the claim's revision (the
            connection's generation), or failing with L{NotOwner}.
        """
        if self.session != OK or self.lease is None or self.draining:
            why = "it is draining" if self.draining else f"it has no etcd session ({self.session_error})"
            return defer.fail(NotOwner(f"Edge {self.edge_id} takes no registrations now: {why}", True))
        key = self.key("nodes", node_id)
        lease = self.lease
        value = json.dumps({"edge": self.edge_id}).encode()

        def created(answer: Created) -> int | Deferred[int]:
            if answer.created:
                return answer.revision
            kv = answer.existing
            if kv is not None and kv.lease == lease and _json(kv.value).get("edge") == self.edge_id:
                # Still ours from a connection that is gone (its release
                # has not landed): take it over under a new revision.
                return self.etcd.replace(key, value, lease, kv.mod_revision).addCallback(replaced)
            owner = _json(kv.value).get("edge") if kv is not None else None
            raise NotOwner(f"node {node_id} is connected to Edge {owner or 'another Edge'}")

        def replaced(revision: int | None) -> int:
            if revision is None:
                raise NotOwner(f"node {node_id} changed hands while this Edge claimed it")
            return revision

        def claimed(revision: int) -> int:
            if self.lease != lease:
                raise NotOwner(f"the etcd lease of Edge {self.edge_id} expired while it claimed node {node_id}")
            self.claims[node_id] = revision
            self.releasing.pop(node_id, None)
            self.unsure.pop(node_id, None)
            return revision

        def unreachable(failure: Failure) -> NoReturn:
            failure.trap(EtcdUnavailable)
            # etcd may have applied the create (or the take-over) and its
            # answer been lost: the key would stay under the live lease,
            # for no connection. Read back once etcd answers.
            if self.lease == lease:
                self.unsure[node_id] = lease
            self._session_lost(failure.getErrorMessage())
            raise NotOwner(f"Edge {self.edge_id} cannot reach etcd: {failure.getErrorMessage()}", True)

        def settled(result: object) -> object:
            count = self._claiming.get(node_id, 0) - 1
            if count > 0:
                self._claiming[node_id] = count
            else:
                self._claiming.pop(node_id, None)
            return result

        self._claiming[node_id] = self._claiming.get(node_id, 0) + 1
        d: Deferred[int] = defer.maybeDeferred(self.etcd.create, key, value, lease).addCallback(created)
        d.addErrback(unreachable)
        d.addBoth(settled)
        return d.addCallback(claimed)

    def holds(self, node_id: str, revision: int) -> bool:
        """
        Whether this Edge's claim on C{node_id} is the one of C{revision}.
        """
        return self.claims.get(node_id) == revision

    def release(self, node_id: str, revision: int) -> None:
        """
        Give up the claim of C{revision} on C{node_id} (its connection is
        gone). Fenced: etcd deletes the key only if it is still that
        claim. Retried while etcd cannot be reached.
        """
        if self.claims.get(node_id) != revision:
            return
        del self.claims[node_id]
        self._release(node_id, revision)

    def _release(self, node_id: str, revision: int) -> None:
        self.releasing[node_id] = revision
        d = self.etcd.delete_if(self.key("nodes", node_id), revision)

        def done(_: object) -> None:
            if self.releasing.get(node_id) == revision:
                del self.releasing[node_id]

        def failed(failure: Failure) -> None:
            failure.trap(EtcdUnavailable)
            self.log.info(
                "node {node} not released yet (etcd cannot be reached); trying again when it can",
                node=node_id,
            )

        d.addCallbacks(done, failed)

    def _retry_releases(self) -> None:
        for node_id, revision in list(self.releasing.items()):
            if self.claims.get(node_id) is None:
                self._release(node_id, revision)

    def _settle_unsure(self) -> None:
        """
        Read back every claim whose answer was lost, unless the node is
        claimed (or being claimed) here again meanwhile: the key is then
        that claim's.
        """
        for node_id, lease in list(self.unsure.items()):
            if lease != self.lease:
                # That lease is gone, and every key under it.
                del self.unsure[node_id]
            elif node_id not in self.claims and node_id not in self._claiming and node_id not in self._settling:
                self._settle(node_id, lease)

    def _settle(self, node_id: str, lease: int) -> None:
        """
        Delete C{nodes/<node_id>} if etcd did create it for the lost claim:
        it is this Edge's (its lease, its id) and no claim of it is held
        here. Fenced on the key's revision, like a release: a claim that
        took it over meanwhile keeps it.
        """
        key = self.key("nodes", node_id)
        self._settling.add(node_id)

        def read(answer: tuple[int, list[KeyValue]]) -> Deferred[None] | None:
            if self.unsure.get(node_id) != lease or node_id in self.claims or node_id in self._claiming:
                return None
            kvs = answer[1]
            kv = kvs[0] if kvs else None
            if kv is None or kv.lease != lease or _json(kv.value).get("edge") != self.edge_id:
                # Not created (or another Edge's since): nothing to undo.
                del self.unsure[node_id]
                return None
            self.log.info(
                "node {node}: etcd applied a claim whose answer was lost; deleting the key of no connection",
                node=node_id,
            )
            return self.etcd.delete_if(key, kv.mod_revision).addCallback(deleted)

        def deleted(_: bool) -> None:
            if self.unsure.get(node_id) == lease:
                del self.unsure[node_id]

        def failed(failure: Failure) -> None:
            failure.trap(EtcdUnavailable)

        def done(result: object) -> None:
            self._settling.discard(node_id)

        self.etcd.range(key).addCallback(read).addErrback(failed).addBoth(done)

    def owner(self, node_id: str) -> str | None:
        """
        The id of the Edge that owns C{node_id}, or C{None}.
        """
        if node_id in self.claims:
            return self.edge_id
        owner = self.owners.get(node_id)
        edge = owner.get("edge") if owner else None
        return edge if edge != self.edge_id else None

    # -- load

    def _publish(self) -> Deferred[object] | None:
        if self.load is None or self.session != OK or self.lease is None:
            return None
        document = self.load()
        if document == self._published:
            return None
        self._published = document
        d = self.etcd.put(self.key("load", self.edge_id), json.dumps(document, sort_keys=True).encode(), self.lease)

        def failed(failure: Failure) -> None:
            # Put again at the next look, whatever the error was.
            self._published = None
            failure.trap(EtcdUnavailable)

        return d.addErrback(failed)

    # -- leaving

    def start_draining(self) -> None:
        """
        Say that this Edge is draining (others stop forwarding to it) and
        take no more registrations.
        """
        self.draining = True
        # Put now if the session allows, else at the next keep-alive
        # answered (and again until a put lands).
        self._announce()

    def leave(self) -> Deferred[None]:
        """
        Revoke the lease: every key this Edge holds goes at once, so its
        Nodes can register elsewhere as soon as their links close.

        @return: a Deferred firing when done (or after L{LEAVE_TIMEOUT_SEC}).
        """
        if self._left:
            return defer.succeed(None)
        self._left = True
        for loop in (self._keeper, self._publisher, self._relister):
            if loop.running:
                loop.stop()
        for call in (self._retry, self._retry_watch, *self._retry_loops.values()):
            if call is not None and call.active():
                call.cancel()
        self._retry_loops.clear()
        if self._watch is not None:
            self._watch.cancel()
        lease, self.lease = self.lease, None
        self.claims.clear()
        self.unsure.clear()
        if lease is None:
            return defer.succeed(None)
        d = self.etcd.revoke(lease)
        d.addTimeout(LEAVE_TIMEOUT_SEC, self.clock)

        def left(_: object) -> None:
            self.log.info("left the Edge cluster (lease revoked)")

        def failed(failure: Failure) -> None:
            self.log.warn(
                "could not revoke the etcd lease ({why}): its keys go when it expires",
                why=failure.getErrorMessage(),
            )

        return d.addCallbacks(left, failed)

    def stopService(self) -> Deferred[None]:
        super().stopService()
        return self.leave()

    # -- what the status shows

    def view(self) -> dict[str, Any]:
        """
        The cluster part of C{/v1/status}: this Edge's session and every
        Edge seen, with its state.
        """
        edges: list[dict[str, Any]] = []
        me: dict[str, Any] = {
            "id": self.edge_id,
            "advertise": self.spec.advertise,
            "state": "draining" if self.draining else "up",
            "self": True,
            "session": self.session,
            "nodes": len(self.claims),
        }
        if self.session != OK:
            me["session_error"] = self.session_error
            me["session_lost_since"] = self.lost_since
        edges.append(me)
        for edge_id in sorted(self.edges):
            if edge_id == self.edge_id:
                continue
            info = self.edges[edge_id]
            owned = sum(1 for owner in self.owners.values() if owner.get("edge") == edge_id)
            edges.append(
                {"id": edge_id, "advertise": info.get("advertise"), "state": info.get("state", "up"), "nodes": owned}
            )
        for edge_id in sorted(self.gone):
            if edge_id != self.edge_id and edge_id not in self.edges:
                edges.append({"id": edge_id, "state": "down", "last_seen": self.gone[edge_id]})
        return {
            "edge_id": self.edge_id,
            "session": self.session,
            "accepting_registrations": self.session == OK and not self.draining,
            "edges": edges,
        }

    def annotate(self, status: dict[str, Any]) -> dict[str, Any]:
        """
        Add the cluster to a C{/v1/status} snapshot: each node's owning
        Edge (C{edge}, or C{None}) and the C{cluster} view.
        """
        for node in status["nodes"]:
            node["edge"] = self.owner(node["id"])
        status["cluster"] = self.view()
        return status
