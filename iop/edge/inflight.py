"""
The Edge's table of work in flight: runs and tunnels (L{Dispatch}
objects) and the node commands waiting for their answer.

It is indexed by Node link, so that losing one Node touches only that
Node's work, and it can tell a draining Edge when nothing is left
(L{Inflight.when_idle}). What the work reports (run events, a tunnel's
end) goes on to the run book (L{iop.edge.runs.RunBook}).
"""

from collections.abc import Callable

from google.protobuf.message import Message
from twisted.internet import defer
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.python.failure import Failure

from iop.edge.dispatch import Dispatch, TunnelDispatch
from iop.edge.registry import NodeLink
from iop.edge.runs import RunBook
from iop.run import RunEventData, RunFailure

#: A node command waiting for its answer: its link, its Deferred, what to
#: call with each progress answer, and what tells the Node to stop it.
_Request = tuple[NodeLink, "defer.Deferred[Message]", Callable[[Message], object] | None, Callable[[], None] | None]


class Inflight:
    """
    @ivar clock: the C{IReactorTime} dispatches use for cancel grace.
    @ivar runs: the L{iop.edge.runs.RunBook} that keeps the record of work.
    """

    def __init__(self, clock: IReactorTime, runs: RunBook) -> None:
        self.clock = clock
        self.runs = runs
        self._detached: dict[str, dict[str, tuple[Dispatch, IDelayedCall]]] = {}  # node id -> {wire id: ...}
        #: The waiting runs by the id their callers know: (node id, wire id).
        self._detached_by_caller: dict[str, tuple[str, str]] = {}
        self._work: dict[str, Dispatch] = {}
        self._by_caller: dict[str, Dispatch] = {}
        self._by_link: dict[NodeLink, dict[str, Dispatch]] = {}
        self._requests: dict[str, _Request] = {}
        self._per_node: dict[str, int] = {}
        self._idle_waiters: list[defer.Deferred[None]] = []

    # -- runs and tunnels

    def __len__(self) -> int:
        return len(self._work)

    def __contains__(self, work_id: str) -> bool:
        return work_id in self._work

    def get(self, wire_id: str) -> Dispatch | None:
        """
        The dispatch with this id on the wire (exactly: a late frame of an
        abandoned attempt finds nothing).
        """
        return self._work.get(wire_id)

    def for_caller(self, work_id: str) -> Dispatch | None:
        """
        The dispatch serving the work its caller knows as C{work_id} (its
        latest attempt).
        """
        return self._by_caller.get(work_id)

    def add(self, dispatch: Dispatch) -> None:
        self._work[dispatch.id] = dispatch
        self._by_caller[dispatch.caller_id] = dispatch
        self._by_link.setdefault(dispatch.link, {})[dispatch.id] = dispatch
        node_id = dispatch.link.node_id
        self._per_node[node_id] = self._per_node.get(node_id, 0) + 1

    def forget(self, dispatch: Dispatch) -> None:
        if self._work.pop(dispatch.id, None) is None:
            return
        if self._by_caller.get(dispatch.caller_id) is dispatch:
            del self._by_caller[dispatch.caller_id]
        on_link = self._by_link.get(dispatch.link)
        if on_link is not None:
            on_link.pop(dispatch.id, None)
            if not on_link:
                del self._by_link[dispatch.link]
        node_id = dispatch.link.node_id
        self._per_node[node_id] -= 1
        if not self._per_node[node_id]:
            del self._per_node[node_id]
        self._check_idle()

    def on_link(self, link: NodeLink) -> list[Dispatch]:
        """
        The work in flight on one connection (a list: safe to end each).
        """
        return list(self._by_link.get(link, {}).values())

    def on_node(self, node_id: str) -> int:
        """
        How many runs and tunnels are in flight on C{node_id}.
        """
        return self._per_node.get(node_id, 0)

    def all(self) -> list[Dispatch]:
        return list(self._work.values())

    # -- background runs whose node's link was lost

    def detach(self, dispatch: Dispatch, timeout: float, expired: Callable[[Dispatch], None]) -> None:
        """
        C{dispatch}'s link is gone but its Node keeps it running (a
        background run, wire version 4): it leaves the table (its lease
        went with the link) and waits for its Node to come back and report
        it, at most C{timeout} seconds; then C{expired(dispatch)} is
        called.
        """
        self.forget(dispatch)
        node_id = dispatch.link.node_id
        timer = self.clock.callLater(timeout, self._expired, node_id, dispatch, expired)
        self._detached.setdefault(node_id, {})[dispatch.id] = (dispatch, timer)
        self._detached_by_caller[dispatch.caller_id] = (node_id, dispatch.id)

    def _expired(self, node_id: str, dispatch: Dispatch, expired: Callable[[Dispatch], None]) -> None:
        if self.take_detached(node_id, dispatch.id) is dispatch:
            expired(dispatch)

    def detached_on(self, node_id: str) -> list[str]:
        """
        The ids on the wire of the runs waiting for C{node_id}.
        """
        return list(self._detached.get(node_id, {}))

    def take_detached(self, node_id: str, wire_id: str) -> Dispatch | None:
        """
        @return: the run C{wire_id} waiting for C{node_id}, no longer
            waiting (or C{None}).
        """
        waiting = self._detached.get(node_id, {})
        found = waiting.pop(wire_id, None)
        if not waiting:
            self._detached.pop(node_id, None)
        if found is None:
            return None
        dispatch, timer = found
        if self._detached_by_caller.get(dispatch.caller_id) == (node_id, wire_id):
            del self._detached_by_caller[dispatch.caller_id]
        if timer.active():
            timer.cancel()
        return dispatch

    def detached_for_caller(self, work_id: str) -> tuple[str, str] | None:
        """
        The waiting run its caller knows as C{work_id}, if any (as
        C{(node_id, wire_id)}).
        """
        return self._detached_by_caller.get(work_id)

    # -- node commands waiting for an answer

    def expect(
        self,
        link: NodeLink,
        request_id: str,
        on_progress: Callable[[Message], object] | None = None,
        on_cancel: Callable[[], None] | None = None,
    ) -> "defer.Deferred[Message]":
        """
        @param on_progress: called with each progress answer (a
            C{NodeCommandResponse} with C{progress} set) before the final one.
        @param on_cancel: called when the wait is cancelled (by the caller,
            or by a timeout), e.g. to tell the Node to stop.
        @return: a Deferred for the final answer to C{request_id} on
            C{link}; cancelling it forgets the request.
        """

        def cancel(d: defer.Deferred[Message]) -> None:
            if self._requests.pop(request_id, None) is not None and on_cancel is not None:
                on_cancel()
            self._check_idle()

        d: defer.Deferred[Message] = defer.Deferred(cancel)
        self._requests[request_id] = (link, d, on_progress, on_cancel)
        return d

    def answered(self, link: NodeLink, request_id: str, result: Message) -> None:
        """
        An answer arrived; one from any connection but the asker's is
        ignored.
        """
        pending = self._requests.get(request_id)
        if pending is None or pending[0] is not link:
            return
        _, d, on_progress, on_cancel = pending
        if getattr(result, "progress", False):
            if on_progress is not None:
                try:
                    on_progress(result)
                except Exception:
                    # An update that cannot be taken (not JSON, or its
                    # consumer failed) fails this command alone, and the
                    # Node is told to stop it; the link is not at fault.
                    failure = Failure()
                    del self._requests[request_id]
                    if on_cancel is not None:
                        on_cancel()
                    d.errback(failure)
                    self._check_idle()
            return
        del self._requests[request_id]
        d.callback(result)
        self._check_idle()

    def unexpect(self, request_id: str) -> None:
        """
        Forget a request that could not be sent.
        """
        self._requests.pop(request_id, None)
        self._check_idle()

    def fail_requests(self, error: Exception, link: NodeLink | None = None) -> None:
        """
        Fail every pending request (of C{link} only, if given) with C{error}.
        """
        for request_id, (request_link, d, _, _) in list(self._requests.items()):
            if link is None or request_link is link:
                del self._requests[request_id]
                d.errback(error)
        self._check_idle()

    # -- draining

    def when_idle(self) -> "defer.Deferred[None]":
        """
        @return: a Deferred firing once no run, tunnel or command is in
            flight (at once if none is).
        """
        d: defer.Deferred[None] = defer.Deferred()
        self._idle_waiters.append(d)
        self._check_idle()
        return d

    def _check_idle(self) -> None:
        if self._idle_waiters and not self._work and not self._requests:
            waiters, self._idle_waiters = self._idle_waiters, []
            for d in waiters:
                d.callback(None)

    # -- what work reports

    def run_event(self, dispatch: Dispatch, event: RunEventData, seq: int | None) -> None:
        """
        One event of a run in flight, for the run book (which logs it,
        gives it to the run's followers and publishes it).
        """
        if dispatch.record is not None:
            self.runs.event(dispatch.record, event, seq)

    def abandoned(self, dispatch: Dispatch, code: str, message: str) -> None:
        """
        Dispatch that ended here without a terminal to report (its listener
        failed): its record ends too.
        """
        if dispatch.record is not None:
            self.runs.not_started(dispatch.record, code, message)

    def tunnel_ended(self, dispatch: TunnelDispatch, status: str, failure: RunFailure | None) -> None:

        if dispatch.record is not None:
            error = None if failure is None else {"code": failure.code, "message": failure.message}
            self.runs.tunnel_ended(dispatch.record, status, dispatch.usage, error)
