"""
What runs and tunnels have in common on the Node: admission through the
adapter's capacity gate (L{admit}), the life of one piece of work in
flight (L{Work}), and the registry of a connection's work by id
(L{Inflight}).

Runs and tunnels share one id space (the Edge cancels either with
C{CancelRequest(CANCEL_RUN, run_id)}), so they share one registry. When the
connection goes, everything in it is cancelled: nothing on the Node may
outlive the session it served, or its capacity slot would leak. When the
Node drains, the registry stops admitting and tells the drain when it is
empty.
"""

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from twisted.internet import defer
from twisted.internet.defer import Deferred
from twisted.logger import Logger
from twisted.python.failure import Failure

from iop.node.flow import Message, SendWindow
from iop.node.gate import Slot
from iop.run import CANCELLED, CAPACITY_EXCEEDED, NODE_DRAINING, UNKNOWN_ADAPTER

if TYPE_CHECKING:
    from iop.node.host import AdapterHost, Hosted
    from iop.node.store import Store


class WorkManager(Protocol):
    """
    What a L{Work} needs of the manager that started it (a run's or a
    tunnel's): where its frames go, the registry it lives in, and the
    host whose clock times it.
    """

    inflight: "Inflight"
    host: "AdapterHost"

    def send(self, message: Message) -> object: ...


class Inflight:
    """
    The runs and tunnels of one connection, by id.

    @ivar admitting: whether new work may start (false once draining).
    """

    def __init__(self) -> None:
        self._work: dict[str, Work] = {}
        self._empty_waiters: list[Deferred[None]] = []
        self.admitting = True

    def __contains__(self, work_id: object) -> bool:
        return work_id in self._work

    def __len__(self) -> int:
        return len(self._work)

    def add(self, work_id: str, work: "Work") -> None:
        self._work[work_id] = work

    def discard(self, work_id: str, work: "Work") -> None:
        if self._work.get(work_id) is work:
            del self._work[work_id]
        if not self._work:
            waiters, self._empty_waiters = self._empty_waiters, []
            for waiter in waiters:
                waiter.callback(None)

    def when_empty(self) -> Deferred[None]:
        """
        @return: a Deferred firing once nothing is in flight (at once if
            nothing is).
        """
        if not self._work:
            return defer.succeed(None)
        d: Deferred[None] = Deferred()
        self._empty_waiters.append(d)
        return d

    def cancel(self, work_id: str, reason: str | None = None) -> bool:
        """
        Cancel one run or tunnel. @return: whether it was in flight.
        """
        work = self._work.get(work_id)
        if work is None:
            return False
        work.cancel(reason)
        return True

    def cancel_all(self, reason: str | None = None, code: str = CANCELLED) -> None:
        """
        Cancel every run and tunnel (C{code}: see L{Work.cancel}).
        """
        for work in list(self._work.values()):
            work.cancel(reason, code)

    def works(self) -> "list[Work]":
        """
        The work in flight (a list: safe to change the registry while
        walking it).
        """
        return list(self._work.values())

    def grant(self, work_id: str, size: int) -> None:
        """
        A C{WindowUpdate}: the Edge lets C{work_id} send C{size} more bytes
        (ignored for work no longer here).
        """
        work = self._work.get(work_id)
        if work is not None:
            work.flow.grant(size)


class Refused(Exception):
    """
    Work that cannot start: C{code} and C{message} go into its single
    error terminal.
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def admit(host: "AdapterHost", inflight: Inflight, work_id: str, adapter_name: str) -> "tuple[Hosted, Slot] | None":
    """
    Admission shared by runs and tunnels: find the adapter and take a slot
    of its capacity gate.

    @return: C{(hosted, slot)}, or C{None} when C{work_id} is already in
        flight (a repeated request, to be ignored).
    @raise Refused: while the connection drains, for an unknown adapter or
        for a full gate (never queued: queueing is the Edge's job).
    """
    if work_id in inflight:
        return None
    if not inflight.admitting:
        raise Refused(NODE_DRAINING, "this node is shutting down and takes no new work")
    hosted = host.get(adapter_name)
    if hosted is None:
        raise Refused(UNKNOWN_ADAPTER, f"no adapter named {adapter_name!r} on this node")
    slot = hosted.gate.acquire()
    if slot is None:
        raise Refused(CAPACITY_EXCEEDED, f"adapter {hosted.name} is at its max_concurrency of {hosted.gate.limit}")
    return hosted, slot


class Work:
    """
    One run or tunnel in flight: its gate slot, the adapter's Deferred and
    why it was cancelled. Subclasses turn the outcome (C{_ended},
    C{_failed}) into their own terminal and send it through L{end}.

    @ivar flow: the L{SendWindow} every frame of this work goes through
        (unlimited unless the Edge gave a window).
    """

    log = Logger()

    def __init__(self, manager: WorkManager, work_id: str, hosted: "Hosted", slot: Slot, window: int = 0) -> None:
        self.manager = manager
        self.work_id = work_id
        self.hosted = hosted
        self.slot = slot
        self.flow = SendWindow(manager.send, window)
        self.seq = 0
        self.finished = False
        self.deferred: Deferred[Any] | None = None
        self.cancel_reason: str | None = None
        self.cancel_code = CANCELLED
        self._stopped = False
        self.arrived = manager.host.reactor.seconds()
        manager.inflight.add(work_id, self)

    def since_arrival_ms(self) -> float:
        """
        Milliseconds since the request arrived: on the first frame, the
        back end's time to its first answer as the Node saw it (the Edge
        puts it in its C{Server-Timing}).
        """
        return (self.manager.host.reactor.seconds() - self.arrived) * 1000

    def begin(self, call: Callable[..., Any], *args: object) -> None:
        """
        Start the adapter's C{call(*args)}; its outcome ends this work.
        """
        self.deferred = defer.maybeDeferred(call, *args)
        self.deferred.addCallbacks(self._ended, self._failed)
        self.deferred.addErrback(lambda f: self.log.failure("{id}: relay failed", f, id=self.work_id))
        if self._stopped:
            # Stopped by what it emitted before it even returned.
            self.deferred.cancel()

    def _ended(self, result: Any) -> None:
        """
        The adapter's work succeeded with C{result}: send the terminal.
        """
        raise NotImplementedError

    def _failed(self, failure: Failure) -> None:
        """
        The adapter's work failed or was cancelled: send the terminal.
        """
        raise NotImplementedError

    def cancel(self, reason: str | None = None, code: str = CANCELLED) -> None:
        """
        Cancel the adapter's work; the terminal will say it was cancelled
        — or, with another C{code}, be an C{error} of that code: the
        verdict the Edge gave its caller (C{node_disconnected}, when the
        link was lost), so that the store reads back as the Edge said.
        """
        if self.finished:
            # Its terminal is decided and queued: whatever waits for credit
            # goes out with it, or a success would end a cut body.
            self.flow.flush()
            return
        # What waits for credit is not wanted any more; the terminal is.
        self.flow.abandon()
        if self.deferred is None:
            return
        self.cancel_reason = reason or "cancelled by the Edge"
        self.cancel_code = code
        self.deferred.cancel()

    def stop(self) -> None:
        """
        The Node ended this work itself (L{end}: its adapter emitted what
        cannot be sent): cancel the adapter's work, whose outcome nothing
        waits for any more.
        """
        self._stopped = True
        if self.deferred is not None:
            self.deferred.cancel()

    def end(self, send_terminal: Callable[..., object], *args: object) -> None:
        """
        End this work once: free the slot, call C{send_terminal(*args)} to
        send (and record) the terminal, then leave the in-flight registry.

        The slot goes first so that the Edge never sees the end of work
        whose capacity is still held; the registry goes last — once the
        terminal is really out, after any frames still waiting for credit —
        so that a drain waiting for it to empty knows every terminal is out
        before it closes the connection and the store.
        """
        if self.finished:
            return
        self.finished = True
        self.slot.release()
        try:
            send_terminal(*args)
        finally:
            self.flow.when_idle(lambda: self.manager.inflight.discard(self.work_id, self))


def record_safely(store: "Store", log: Logger, kind: str, method: str, *args: Any) -> None:
    """
    Call the run store's C{method(*args)} without ever letting it break
    the relay: a failure is logged naming the work (C{args[0]}).
    """
    d: Deferred[Any]
    try:
        d = defer.maybeDeferred(getattr(store, method), *args)
    except Exception:
        d = defer.fail()

    work_id = args[0] if args else ""
    d.addErrback(
        lambda f: log.failure("{kind} {id}: run store {method} failed", f, kind=kind, id=work_id, method=method)
    )
