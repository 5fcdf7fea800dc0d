"""
Letting the Edge's work end before it stops.

A stopping Edge should not cut off the streams its callers are reading.
A L{Drain} refuses new work at once (L{Drain.draining}), fails the
waiters with C{shutting_down}, tells the cluster and the Nodes, hands
back the background runs their Nodes keep across a lost link, and lets
the rest finish within C{shutdown_grace_sec}; then, or at once when
L{Drain.hurry}'d, what is left ends with a C{shutting_down} terminal to
its caller. Once nothing is in flight it gives the nodes back to the
cluster, closes the Node links and the HTTP connections once flushed.
"""

from collections.abc import Callable, Sequence
from typing import Any

from twisted.application.service import IService
from twisted.internet import defer
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger

from iop.edge.config import EdgeConfig
from iop.edge.errors import ServiceError
from iop.edge.http.site import EdgeSite
from iop.edge.inflight import Inflight
from iop.edge.links import NodeLinks
from iop.edge.pool import ProviderPool
from iop.edge.seam import ICluster
from iop.run import SHUTTING_DOWN

#: How long a drained Edge waits for its HTTP connections to flush their
#: last bytes before it aborts them.
FLUSH_TIMEOUT_SEC = 5.0

#: Why work, waiters and Node links end when the Edge stops.
SHUTDOWN_REASON = "the Edge is shutting down"


def shutting_down() -> ServiceError:
    """
    What work the Edge no longer takes (or no longer waits for) fails with.
    """
    return ServiceError("unavailable", SHUTDOWN_REASON, code=SHUTTING_DOWN)


class Drain:
    """
    @param config: returns the running L{EdgeConfig} (its
        C{shutdown_grace_sec}).
    @param clock: for the grace period.

    @ivar draining: C{True} once a stop began: new work is refused.
    """

    log = Logger()

    def __init__(
        self,
        config: Callable[[], EdgeConfig],
        clock: IReactorTime,
        pool: ProviderPool,
        links: NodeLinks,
        inflight: Inflight,
        cluster: ICluster,
    ) -> None:
        self._config = config
        self.clock = clock
        self.pool = pool
        self.links = links
        self.inflight = inflight
        self.cluster = cluster
        self.draining = False
        self._grace_timer: IDelayedCall | None = None
        self._drained: Deferred[list[Any]] | None = None
        self._site: EdgeSite | None = None

    def start(self, listeners: Sequence[IService], site: EdgeSite | None) -> "Deferred[list[Any]]":
        """
        Drain: stop the C{listeners} at once, fail queued waiters with
        C{shutting_down}, tell the cluster and the Nodes, let work in
        flight finish within C{shutdown_grace_sec} (then end it with
        terminals), close the Node links and the HTTP connections of
        C{site} once flushed.

        @return: a Deferred firing when all of that is done (the same one
            when called again).
        """
        if self._drained is not None:
            return self._drained
        grace = self._config().shutdown_grace_sec
        self.draining = True
        self._site = site
        busy = len(self.inflight)
        self.log.info("draining: {busy} run(s)/tunnel(s) in flight, up to {grace:g}s to finish", busy=busy, grace=grace)
        stopping = [defer.maybeDeferred(child.stopService) for child in listeners if child.running]
        self.pool.fail_waiters(shutting_down())
        self.cluster.start_draining()
        self.links.say_draining(grace, SHUTDOWN_REASON)
        self._hand_back_background_runs()
        idle = self.inflight.when_idle()
        self._grace_timer = self.clock.callLater(grace, self.hurry)
        idle.addCallback(self._drain_done)
        self._drained = defer.gatherResults(stopping + [idle], consumeErrors=True)
        self._drained.addErrback(lambda f: self.log.failure("draining failed", f))
        return self._drained

    def _hand_back_background_runs(self) -> None:
        """
        A stopping Edge neither waits for nor cancels the background runs
        of Nodes that keep runs across a lost link (wire version 4): they
        go on there, and the next Edge takes them back when the Node
        reconnects (docs/wire.md, "Background runs across a lost link").
        """
        handed = 0
        for dispatch in self.inflight.all():
            if dispatch.outlives_link:
                dispatch.finish()
                handed += 1
        if handed:
            self.log.info("{count} background run(s) go on on their nodes for the next Edge", count=handed)

    def hurry(self) -> None:
        """
        End a drain now (the grace passed, or a second stop signal): work
        in flight ends with a C{shutting_down} terminal to its caller and
        pending commands fail.
        """
        if not self.draining:
            return
        self._end_grace()
        left = self.inflight.all()
        if left:
            self.log.info("ending {count} run(s)/tunnel(s) still in flight", count=len(left))
        for dispatch in left:
            dispatch.shut_down(SHUTDOWN_REASON)
        self.inflight.fail_requests(shutting_down())

    def _end_grace(self) -> None:
        if self._grace_timer is not None and self._grace_timer.active():
            self._grace_timer.cancel()
        self._grace_timer = None

    def _drain_done(self, _: object) -> "Deferred[None]":
        self._end_grace()
        # Give the nodes back first, so they register elsewhere as soon as
        # their links close (without a refused attempt).
        return self.cluster.leave().addCallback(self._close_links)

    def _close_links(self, _: object) -> "Deferred[None] | None":
        self.links.close_all(SHUTDOWN_REASON)
        if self._site is not None:
            return self._site.close_connections(self.clock, FLUSH_TIMEOUT_SEC)
        return None
