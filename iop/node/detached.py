"""
Background runs that outlive the Node's link to its Edge (wire version 4;
docs/wire.md, "Background runs across a lost link").

When a ready session's connection is lost (not a local shutdown), its
background runs are not cancelled: they move here and go on, their events
still recorded in the run store (which is where a resumed stream is
replayed from). The next session tells its Edge about them
(C{RunReconcile}, before its ready) and the Edge asks for each run it
wants back (C{RunResume}): the run is attached to the new session, its
events after the Edge's last one are sent from the store, then the live
ones. A run the Edge does not want back is cancelled.

Foreground runs and tunnels still end with their connection, as before,
and so does everything when the Edge speaks an older wire version (it
could never ask for them back).

A run that ends while detached is kept (for its reconcile) for
L{KEEP_ENDED_SEC}; a local shutdown cancels the ones still running, and so
does a session that becomes ready with an Edge of an older wire version
(nothing could ever take them back, and their slots would stay held).
"""

from typing import TYPE_CHECKING, Any

from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger

from iop.protocols import messages
from iop.run import CANCELLED

if TYPE_CHECKING:
    from iop.node.runs import RunRelay

#: How long a run that ended while detached waits to be reported.
KEEP_ENDED_SEC = 3600.0


class DetachedRuns:
    """
    The background runs no session holds, by id (process-wide: sessions
    come and go, these stay).
    """

    log = Logger()

    def __init__(self, clock: IReactorTime) -> None:
        self.clock = clock
        self._runs: dict[str, RunRelay] = {}
        self._expiry: dict[str, IDelayedCall] = {}

    def __len__(self) -> int:
        return len(self._runs)

    def __contains__(self, run_id: object) -> bool:
        return run_id in self._runs

    def keep(self, relay: "RunRelay") -> None:
        """
        Keep C{relay} (a background L{iop.node.runs.RunRelay} whose
        connection was lost) going without a session.
        """
        relay.detach(self._ended)
        self._runs[relay.run_id] = relay
        if relay.finished:
            self._ended(relay)

    def _ended(self, relay: "RunRelay") -> None:
        if self._runs.get(relay.run_id) is relay and relay.run_id not in self._expiry:
            self._expiry[relay.run_id] = self.clock.callLater(KEEP_ENDED_SEC, self._forget, relay.run_id)

    def _forget(self, run_id: str) -> None:
        self._expiry.pop(run_id, None)
        self._runs.pop(run_id, None)

    def take(self, run_id: str) -> "RunRelay | None":
        """
        @return: the detached run C{run_id}, no longer kept here, or
            C{None}.
        """
        relay = self._runs.pop(run_id, None)
        timer = self._expiry.pop(run_id, None)
        if timer is not None and timer.active():
            timer.cancel()
        return relay

    def report(self) -> Any:
        """
        @return: the C{RunReconcile} a new session sends its Edge.
        """
        runs = [
            messages.reconciled_run(
                relay.run_id,
                relay.hosted.name,
                relay.request.target,
                relay.status,
                relay.seq,
                relay.request.caller,
                relay.arrived,
            )
            for relay in self._runs.values()
        ]
        return messages.run_reconcile(runs)

    def cancel(self, run_id: str, reason: str, code: str = CANCELLED) -> bool:
        """
        The Edge does not want C{run_id} back: cancel it (if it still runs;
        with the Edge's C{code} when it ended it with an error) and forget
        it. @return: whether it was kept here.
        """
        relay = self.take(run_id)
        if relay is None:
            return False
        relay.cancel(reason, code)
        return True

    def cancel_all(self, reason: str, code: str = CANCELLED) -> None:
        """
        Cancel every detached run still going: the Node is stopping, or
        (with C{code} C{node_disconnected}) its new Edge can never ask for
        them back.
        """
        for run_id in list(self._runs):
            self.cancel(run_id, reason, code)
