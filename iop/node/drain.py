"""
Letting one connection's work end before the Node stops.

A Node told to stop (SIGTERM, SIGINT) should not cut off the streams its
callers are reading. A L{Drain} closes the connection's in-flight registry
to new work, waits for the runs and tunnels already in flight to end on
their own, and when the grace period passes, or a second stop signal
hurries it, cancels whatever is left while the connection is still up, so
the Edge receives their C{cancelled} terminals.

It never waits on cancelled work: whatever an adapter does with a
cancellation, the drain is over once it has cancelled, so a stop takes at
most the grace period.
"""

from twisted.internet import defer
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger

from iop.node.work import Inflight


class Drain:
    """
    @param inflight: the connection's L{iop.node.work.Inflight}.
    @param clock: an C{IReactorTime} for the grace period.
    @param grace_sec: how long work in flight may go on.
    @param reason: why the work left at the end is cancelled (recorded in
        the run store, and the message of a cancelled tunnel's error).
    """

    log = Logger()

    def __init__(self, inflight: Inflight, clock: IReactorTime, grace_sec: float, reason: str) -> None:
        self.inflight = inflight
        self.clock = clock
        self.grace_sec = grace_sec
        self.reason = reason
        self.done: Deferred[None] = defer.Deferred()
        self._deadline: IDelayedCall | None = None

    def start(self) -> Deferred[None]:
        """
        Stop admitting work and wait for the work in flight.

        @return: L{done}, a Deferred firing once nothing is in flight or the
            rest has been cancelled (at once when nothing is in flight).
        """
        self.inflight.admitting = False
        if not len(self.inflight):
            self._over()
            return self.done
        self.log.info(
            "draining: waiting up to {grace:g}s for {count} run(s)/tunnel(s) in flight",
            grace=self.grace_sec,
            count=len(self.inflight),
        )
        self._deadline = self.clock.callLater(self.grace_sec, self._cancel_rest, "the shutdown grace period passed")
        self.inflight.when_empty().addCallback(self._over)
        return self.done

    def hurry(self) -> None:
        """
        Cut the grace period to zero: cancel the work in flight now.
        """
        if self._deadline is not None:
            self._cancel_rest("not waiting any longer")

    def _cancel_rest(self, why: str) -> None:
        self._deadline = None
        self.log.info("{why}: cancelling {count} run(s)/tunnel(s) still in flight", why=why, count=len(self.inflight))
        self.inflight.cancel_all(self.reason)
        self._over()

    def _over(self, _: object = None) -> None:

        if self._deadline is not None and self._deadline.active():
            self._deadline.cancel()
        self._deadline = None
        if not self.done.called:
            self.done.callback(None)
