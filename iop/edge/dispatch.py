"""
Work in flight on a Node: normalized runs and provider tunnels.

A L{Dispatch} is created once work has a place (a ready Node connection,
and a lease when it came through a model group). It ends exactly once —
on its terminal from the Node, on a send failure, on the owner's
disconnect, or when a cancel got no answer within the grace period — and
ending it returns its lease. Callers see it through a listener: an
L{IRunListener} for runs, an L{ITunnelListener} for tunnels.

What a Node says about one piece of work is checked here: a malformed
message (an unknown event type, a tunnel status that is no HTTP status, a
header that is no header) is a protocol violation of that work alone. It
ends with C{protocol_error}, the Node is asked to cancel it, and the
connection and every other piece of work on it go on. A listener that
raises (a bug) ends only its own work too.
"""

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any, Protocol

from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger, LogLevel
from zope.interface import Interface, implementer

from iop import jsontext
from iop.edge.failover import provider_failed
from iop.edge.flow import ReceiveWindow
from iop.edge.pool import Lease
from iop.edge.registry import NodeLink
from iop.edge.runs import RunRecord
from iop.edge.timing import Timing
from iop.protocols import messages
from iop.protocols.convert import failure_from_wire, usage_from_wire, usage_to_json
from iop.protocols.wire import FLOW_CONTROL_WIRE_VERSION, RECONCILE_WIRE_VERSION, STREAM_WINDOW_BYTES
from iop.run import (
    ADAPTER_ERROR,
    CANCELLED,
    COMPLETE,
    DELTA,
    ERROR,
    EVENT_TYPES,
    INCOMPLETE,
    NODE_DISCONNECTED,
    PROTOCOL_ERROR,
    PROVIDER_ERROR,
    REASONING_DELTA,
    SEND_FAILED,
    SHUTTING_DOWN,
    START,
    TERMINAL_TYPES,
    TOOL_CALL,
    ITunnelSink,
    RunEventData,
    RunFailure,
)

#: An HTTP header name (RFC 9110 token) and a value without CR, LF or NUL.
_HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_BAD_VALUE = re.compile(r"[\r\n\x00]")
#: The HTTP statuses (RFC 9110: 100 to 599).
_HTTP_STATUSES = range(100, 600)


class IRunListener(Interface):
    def event(event: RunEventData) -> None:
        """
        One L{RunEventData}, in order; the last one is a terminal.
        """


class ITunnelListener(ITunnelSink):
    def end() -> None:
        """
        The provider's body is complete.
        """

    def error(failure: RunFailure) -> None:
        """
        The tunnel failed (a L{RunFailure}); no more calls follow.
        """


@dataclass
class Placement:
    """
    Where a piece of work will run: a ready connection, the adapter on that
    node, the back-end target, and the lease it holds (if any).
    """

    link: NodeLink
    adapter: str
    adapter_type: str
    target: str = ""
    lease: Lease | None = None

    @property
    def node_id(self) -> str:
        return self.link.node_id

    @property
    def provider_id(self) -> str:
        return self.lease.provider_id if self.lease is not None else self.adapter

    @property
    def key(self) -> tuple[str, str]:
        """
        The provider resource this work is on, C{(node_id, provider_id)}.
        """
        return (self.node_id, self.provider_id)

    def release(self) -> None:
        if self.lease is not None:
            self.lease.release()

    def record_success(self) -> None:
        if self.lease is not None:
            self.lease.report()

    def record_failure(self, failure: RunFailure) -> None:
        """
        Tell the provider's health about a failure, before or after output
        (only the provider's own failures count: see L{provider_failed}).
        """
        if self.lease is not None and provider_failed(failure):
            self.lease.report(failure.code, failure.message, failure.deadline)


@implementer(IRunListener)
class Unheard:
    """
    The listener of a run nobody is waiting for (a background run answered
    202, or one taken back from a Node after a lost link): the run book
    keeps what it says.
    """

    def event(self, event: RunEventData) -> None:
        pass


class Tracker(Protocol):
    """
    The table a dispatch belongs to and reports its ends to
    (L{iop.edge.inflight.Inflight}; named by its shape, since that table
    holds dispatches).
    """

    clock: IReactorTime

    def forget(self, dispatch: "Dispatch") -> None: ...

    def run_event(self, dispatch: "Dispatch", event: RunEventData, seq: int | None) -> None: ...

    def abandoned(self, dispatch: "Dispatch", code: str, message: str) -> None: ...

    def tunnel_ended(self, dispatch: "TunnelDispatch", status: str, failure: RunFailure | None) -> None: ...


class Dispatch:
    """
    Base class: the bookkeeping shared by runs and tunnels.

    @ivar tracker: the L{iop.edge.inflight.Inflight} table this belongs to.
    @ivar id: the id on the wire (this attempt's).
    @ivar caller_id: the id the caller knows (the same for every attempt).
    @ivar record: the L{iop.edge.runs.RunRecord} the work reports to (the
        run book's record of it, under C{caller_id}), or C{None}.
    @ivar on_early_failure: when set, called as C{on_early_failure(dispatch,
        failure)} for a failure before any output reached the listener; it
        returns a callable to take the work over (the dispatch ends
        quietly, then calls it: the Edge places the work again), or
        C{None} to let the listener get the failure.
    @ivar on_failure: when set, called as C{on_failure(dispatch, failure)}
        for every failure of the provider itself (L{provider_failed}),
        before or after output.
    @ivar continued: whether its answer, cut mid-way, goes on in another
        attempt.
    @ivar window: the stream's flow-control window (L{iop.edge.flow}), on
        links of wire version 3 or later.
    """

    log = Logger()

    #: What the run book and the logs call it (C{run} or C{tunnel}).
    kind: str
    #: Its caller request's L{Timing}, when it has one.
    timing: Timing | None = None

    #: The request messages that start a stream (and carry its window).
    _REQUESTS = (messages.RunRequest, messages.ProviderTunnelRequest)

    def __init__(
        self,
        tracker: Tracker,
        dispatch_id: str,
        placement: Placement,
        listener: Any,
        caller_id: str | None = None,
        record: RunRecord | None = None,
    ) -> None:
        self.tracker = tracker
        self.id = dispatch_id
        self.caller_id = caller_id or dispatch_id
        self.placement = placement
        self.listener = listener
        self.record = record
        self.done = False
        self.output = False
        self.on_early_failure: Callable[[Any, RunFailure], Callable[[], None] | None] | None = None
        self.on_failure: Callable[[Any, RunFailure], None] | None = None
        self.continued = False
        self.window: ReceiveWindow | None = None
        self._grace: IDelayedCall | None = None

    @property
    def background(self) -> bool:
        """
        Whether it goes on when its caller leaves (only a run can).
        """
        return False

    def fail(self, code: str, message: str, status: int = 0) -> None:
        """
        End it here with an error of C{code} (told to its listener).
        """
        raise NotImplementedError

    def end_cancelled(self, message: str, code: str = CANCELLED) -> None:
        """
        End it here as cancelled (C{code}: why, e.g. C{shutting_down}).
        """
        raise NotImplementedError

    def tell_failure(self, failure: RunFailure) -> None:
        """
        Give the listener a terminal error for work that ended here without
        one (its second placement failed).
        """
        raise NotImplementedError

    def tell_cancelled(self, message: str) -> None:
        """
        Give the listener a C{cancelled} terminal for work that ended here
        without one: it was cancelled while it waited to be placed again,
        in nobody's hands, and its caller may still be reading.
        """
        raise NotImplementedError

    def _first_output(self) -> None:
        """
        The provider answered: from now on nothing is retried (its health
        hears of a success when the answer is whole).
        """
        self.output = True

    def _provider_failure(self, failure: RunFailure) -> None:
        """
        Tell the provider's health, and L{on_failure}, of C{failure} when
        it is the provider's own.
        """
        self.placement.record_failure(failure)
        if self.on_failure is not None and provider_failed(failure):
            self.on_failure(self, failure)

    def _taken_over(self, failure: RunFailure) -> bool:
        """
        A failure before any output: record it against the provider's
        health and offer it to L{on_early_failure} — unless a cancel was
        asked of the Node: the failure crossed it (the Node failed the work
        before it saw the cancel), and the work ends cancelled as its
        caller asked instead of being placed again.

        @return: whether this dispatch has ended (taken over, or cancelled).
        """
        if self.output:
            return False
        self._provider_failure(failure)
        if self.cancelling:
            self._stop_grace()
            self.end_cancelled("cancelled")
            return True
        then = self.on_early_failure(self, failure) if self.on_early_failure is not None else None
        if then is None:
            return False
        if self.finish():
            then()
        return True

    @property
    def link(self) -> NodeLink:
        return self.placement.link

    @property
    def cancelling(self) -> bool:
        """
        Whether a cancel was asked of the Node and not yet confirmed (its
        grace is running).
        """
        return self._grace is not None

    @property
    def outlives_link(self) -> bool:
        """
        Whether its Node keeps it running when the link is lost (a
        background run on wire version 4 or later): the Edge waits for the
        Node to report it again instead of ending it.
        """
        return self.background and self.link.wire_version >= RECONCILE_WIRE_VERSION

    def heard(self, first_byte_ms: float) -> None:
        """
        A frame of this work came from the Node (C{first_byte_ms}: what
        the first one says of the back end's time): its caller request's
        L{Timing} notes the first (the terminal is noted by L{finish}:
        no clock is read for the frames between).
        """
        if self.timing is not None and self.timing.answered is None:
            self.timing.heard(self.tracker.clock.seconds(), first_byte_ms)

    def send(self, message: Any) -> None:
        """
        Send one message to the Node. The request that starts the work
        opens its flow-control window on a link of wire version 3 or later
        (L{iop.edge.flow}); a streaming listener registers the window as
        the producer of its caller's response (C{use_producer}).
        """
        if isinstance(message, self._REQUESTS) and self.window is None:
            if self.link.wire_version >= FLOW_CONTROL_WIRE_VERSION:
                message.window_bytes = STREAM_WINDOW_BYTES
                self.window = ReceiveWindow(self.link.wire.send, self.id, STREAM_WINDOW_BYTES, self.tracker.clock)
                self.window.keep_flowing = self.background
                use_producer = getattr(self.listener, "use_producer", None)
                if use_producer is not None:
                    use_producer(self.window)
        self.link.wire.send(message)

    def delivered(self, size: int) -> None:
        """
        C{size} body bytes were handed to the listener: count them against
        the window.
        """
        if self.window is not None:
            self.window.received(size)

    def cancel(self, grace: float) -> None:
        """
        Ask the Node to cancel; end locally as C{cancelled} if no terminal
        arrives within C{grace} seconds (the lease must come back anyway).
        """
        if self.done or self._grace is not None:
            return
        try:
            self.send(self._cancel_request())
        except Exception as e:
            self.fail(SEND_FAILED, f"could not send cancel: {e}")
            return
        self._grace = self.tracker.clock.callLater(grace, self.cancelled_locally)

    def cancelled_locally(self) -> None:
        self._grace = None
        self.end_cancelled("cancelled; the node did not confirm in time")

    def shut_down(self, message: str) -> None:
        """
        The Edge is stopping and this work outlived the grace: ask the Node
        to cancel (best effort) and end it here at once with a
        C{shutting_down} terminal, so the caller gets a proper ending.
        """
        if self.done:
            return
        self._cancel_on_node()
        self.end_cancelled(message, SHUTTING_DOWN)

    def node_lost(self, message: str) -> None:
        self.fail(NODE_DISCONNECTED, message)

    def violation(self, reason: str) -> None:
        """
        The Node sent a malformed message for this work: end it with
        C{protocol_error} and ask the Node to cancel it. The connection is
        not affected.
        """
        if self.done:
            return
        self.log.warn(
            "node {node} sent a malformed message for {kind} {id}: {reason}",
            node=self.link.node_id,
            kind=self.kind,
            id=self.id,
            reason=reason,
        )
        self._cancel_on_node()
        self.fail(PROTOCOL_ERROR, f"the node sent a malformed message: {reason}")

    def _cancel_on_node(self) -> None:
        self.link.send_quietly(self._cancel_request())

    def _cancel_request(self) -> messages.CancelRequest:
        return messages.cancel_run(self.id)

    def _tell(self, method: Callable[..., object], *args: Any) -> None:
        """
        Call the listener; if it raises (a bug), log it and end this work
        alone: the lease returns and the Node is asked to cancel.
        """
        try:
            method(*args)
        except Exception:
            self.log.failure("the listener of {kind} {id} failed", kind=self.kind, id=self.id, level=LogLevel.error)
            if not self.done:
                self._cancel_on_node()
                self.finish()
                self.tracker.abandoned(self, "internal_error", "the caller's listener failed")

    def _stop_grace(self) -> None:
        """
        The cancel's grace is over: its timer, if still to come, is called off.
        """
        if self._grace is not None and self._grace.active():
            self._grace.cancel()
        self._grace = None

    def finish(self) -> bool:
        """
        Bookkeeping at the end: exactly once, returns the lease.
        """
        if self.done:
            return False
        self.done = True
        self._stop_grace()
        if self.window is not None:
            self.window.close()
        self.placement.release()
        self.tracker.forget(self)
        return True


class RunDispatch(Dispatch):
    """
    A normalized run.

    @ivar on_late_failure: when set, called as C{on_late_failure(dispatch,
        failure, text)} for a failure after output, with the text the
        caller got of this attempt; it returns a callable to take the
        work over (the answer goes on in another attempt: the dispatch
        ends quietly, then calls it), or C{None}.
    @ivar continuing: this attempt continues an answer the caller already
        has part of: its C{start} is not passed on, its events are
        numbered after those of the attempts before (from C{seq_base}),
        and a failure that ends it is the caller's C{incomplete}.
    """

    kind = "run"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.on_late_failure: Callable[[RunDispatch, RunFailure, str], Callable[[], None] | None] | None = None
        self.continuing = False
        self.seq_base = 0
        self._text: list[str] = []
        self._tool_called = False

    @property
    def background(self) -> bool:
        return self.record is not None and self.record.background

    def reattach(self, placement: Placement) -> None:
        """
        The run's Node came back and reported it (it ran on without a
        link): it goes on here, on the new connection and lease, without a
        flow-control window (the Node resumes it without one).
        """
        self.placement = placement
        self.window = None

    def deliver(self, event: RunEventData, seq: int | None = None) -> None:
        """
        One event of the run (C{seq}: its number on the wire; C{None} for
        one the Edge makes up).
        """
        if self.done:
            return
        if event.type not in EVENT_TYPES:
            self.violation(f"unknown event type {event.type[:40]!r}")
            return
        if event.type in (ERROR, CANCELLED) and event.error is None:
            # A terminal without its reason: give it a generic one.
            code, message = (CANCELLED, "cancelled") if event.type == CANCELLED else (ADAPTER_ERROR, "no reason given")
            event = replace(event, error=RunFailure(code=code, message=message))
        if self.continuing:
            if event.type == START:
                return  # the caller's answer started long ago
            seq = None if seq is None else seq + self.seq_base
        failure = event.error if event.type == ERROR else None
        if failure is not None:
            if self.output:
                # Cut, stalled or malformed mid-answer: it counts too, and
                # may go on elsewhere.
                if self._goes_on(failure):
                    return
                self._provider_failure(failure)
            elif self._taken_over(failure):
                return
            if self.continuing and failure.code != INCOMPLETE:
                failure = _incomplete(failure)
                event = replace(event, error=failure)
        if not self.output and event.type != ERROR:
            self._first_output()
        self.output = True
        if event.type == COMPLETE:
            self.placement.record_success()
        if event.type in TERMINAL_TYPES:
            if self.timing is not None:
                self.timing.heard(self.tracker.clock.seconds(), 0.0)
            self.finish()
            if failure is not None:
                self.log.warn(
                    "run {run_id} on node {node} ({adapter}) failed: {code}: {reason}",
                    run_id=self.id,
                    node=self.placement.node_id,
                    adapter=self.placement.adapter,
                    code=failure.code,
                    reason=failure.message,
                )
        self.tracker.run_event(self, event, seq)
        self._tell(self.listener.event, event)
        if event.type == TOOL_CALL:
            self._tool_called = True
        elif event.type == DELTA and event.text and self.on_late_failure is not None:
            self._text.append(event.text)
        if event.type in (DELTA, REASONING_DELTA) and event.text:
            self.delivered(len(event.text.encode("utf-8")))

    def _goes_on(self, failure: RunFailure) -> bool:
        """
        Offer a failure after output to L{on_late_failure}: a cut text
        answer (no tool call in it) may go on in another attempt.

        @return: whether it does (this dispatch has ended).
        """
        if self.on_late_failure is None or self._tool_called or not self._text:
            return False
        then = self.on_late_failure(self, failure, "".join(self._text))
        if then is None:
            return False
        self.continued = True
        self._provider_failure(failure)
        if self.finish():
            then()
        return True

    def fail(self, code: str, message: str, status: int = 0) -> None:
        self.deliver(RunEventData(ERROR, error=RunFailure(code=code, message=message, status=status)))

    def tell_failure(self, failure: RunFailure) -> None:
        """
        Give the listener a terminal error for work that ended here without
        one (its next placement failed).
        """
        event = RunEventData(ERROR, error=_incomplete(failure) if self.continuing else failure)
        self.tracker.run_event(self, event, None)
        self._tell(self.listener.event, event)

    def tell_cancelled(self, message: str) -> None:
        """
        The run book logs the C{cancelled} terminal and the listener hears it.
        """
        event = RunEventData(CANCELLED, error=RunFailure(code=CANCELLED, message=message))
        self.tracker.run_event(self, event, None)
        self._tell(self.listener.event, event)

    def end_cancelled(self, message: str, code: str = CANCELLED) -> None:
        self.deliver(RunEventData(CANCELLED, error=RunFailure(code=code, message=message)))


class TunnelDispatch(Dispatch):
    """
    A provider tunnel. The provider's status and headers are held until
    its first body byte (or its end), so that a failure before then (a
    missed deadline, a body cut before it was whole) can still be placed
    again, or answered as an error instead of a 200 with part of a body.

    A failure status (5xx, 429, 400) is decided on at the first frame
    after its status and headers: the Node's C{failure} observation (a
    metadata frame saying its code, such as C{context_length_exceeded},
    and C{retry_after_sec}), or else the status itself with the
    C{Retry-After} of its headers.
    """

    kind = "tunnel"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.usage: dict[str, Any] | None = None
        self._status: int | None = None
        self._headers: list[tuple[str, str]] | None = None
        #: A failure status waiting for the frame after its headers.
        self._refusal: RunFailure | None = None
        #: The provider answered a failure status the caller is given.
        self._failed_status = False

    def frame(self, frame: messages.ProviderTunnelFrame) -> None:
        """
        One L{messages.ProviderTunnelFrame} from the Node.
        """
        if self.done:
            return
        which = frame.WhichOneof("frame")
        if self._refusal is not None and which not in ("status", "headers"):
            refusal, self._refusal = self._refusal, None
            if self._refused(self._observed(refusal, frame, which)):
                return
        if which == "error":
            failure = failure_from_wire(frame.error)
            self.fail_with(
                replace(failure, code=failure.code or ADAPTER_ERROR, message=failure.message or "no reason given")
            )
            return
        if which is None:
            self.violation("empty tunnel frame")
            return
        if which == "status":
            self._on_status(frame.status)
        elif which == "headers":
            self._on_headers([(h.name, h.value) for h in frame.headers.headers])
        elif which == "body":
            self._open()
            if not self.done:
                self._tell(self.listener.body, frame.body)
                self.delivered(len(frame.body))
        elif which == "usage":
            usage = usage_from_wire(frame.usage)
            self.usage = usage_to_json(usage)
            self._tell(self.listener.usage, usage)
        elif which == "metadata_json":
            info = _metadata(frame)
            if info is None:
                self.log.warn("tunnel {id}: metadata from the node is not JSON; ignored", id=self.id)
                return
            self._tell(self.listener.metadata, info)
        elif which == "end":
            self._open()
            if self.done:
                return
            if not self._failed_status:
                self.placement.record_success()
            self.finish()
            self.tracker.tunnel_ended(self, COMPLETE, None)
            self._tell(self.listener.end)

    def _on_status(self, status: int) -> None:
        if status not in _HTTP_STATUSES:
            self.violation(f"tunnel status {status} is not an HTTP status")
            return
        if self.output or self._status is not None:
            # One status per answer: another one (mid-body, it would make
            # the caller's answer a failure glued to the body it has) is
            # malformed.
            self.violation(f"a second tunnel status ({status})")
            return
        self._status = status
        if status >= 500 or status in (400, 429):
            self._refusal = RunFailure(PROVIDER_ERROR, f"the provider answered HTTP {status}", status)

    def _on_headers(self, pairs: list[tuple[str, str]]) -> None:
        for name, value in pairs:
            if not _HEADER_NAME.fullmatch(name) or _BAD_VALUE.search(value):
                self.violation(f"tunnel header {name[:40]!r} is not a valid HTTP header")
                return
        if self.output:
            self._tell(self.listener.headers, pairs)
            return
        self._headers = pairs

    def _observed(self, refusal: RunFailure, frame: messages.ProviderTunnelFrame, which: str | None) -> RunFailure:
        """
        The failure a held failure status stands for: what the Node's
        C{failure} observation says (when C{frame} is one), else the status
        with its headers' C{Retry-After}.
        """
        said = (_metadata(frame) or {}).get("failure") if which == "metadata_json" else None
        observed = _failure_said(said, refusal) if isinstance(said, dict) else None
        if observed is not None:
            return observed
        return replace(refusal, retry_after_sec=retry_after(self._headers or ()))

    def _refused(self, failure: RunFailure) -> bool:
        """
        The provider answered a failure status before its body: place the
        work again if that is planned (the Node is told to drop this
        attempt); else the caller gets the provider's own answer.

        @return: whether the work was taken over.
        """
        self._failed_status = provider_failed(failure)
        if self._taken_over(failure):
            self._cancel_on_node()
            return True
        self._open()
        return False

    def _open(self) -> None:
        """
        The caller's answer begins: the held status and headers go to the
        listener, and nothing is retried any more.
        """
        if self.output:
            return
        self._first_output()
        if self._status is not None:
            self._tell(self.listener.status, self._status)
        if self._headers is not None and not self.done:
            self._tell(self.listener.headers, self._headers)

    def fail(self, code: str, message: str, status: int = 0) -> None:
        self.fail_with(RunFailure(code=code, message=message, status=status))

    def fail_with(self, failure: RunFailure) -> None:
        """
        End the tunnel with C{failure}: placed again if it came before the
        first body byte and that is planned; else its listener is told
        (mid-answer: the surface ends the caller's answer with an explicit
        error).
        """
        late = self.output
        if self._taken_over(failure) or not self.finish():
            return
        if late:
            self._provider_failure(failure)
        code, message = failure.code, failure.message
        (self.log.info if code in (CANCELLED, SHUTTING_DOWN) else self.log.warn)(
            "tunnel {tunnel_id} on node {node} ({adapter}) ended: {code}: {reason}",
            tunnel_id=self.id,
            node=self.placement.node_id,
            adapter=self.placement.adapter,
            code=code,
            reason=message,
        )
        self.tracker.tunnel_ended(self, CANCELLED if code in (CANCELLED, SHUTTING_DOWN) else ERROR, failure)
        self._tell(self.listener.error, failure)

    def tell_failure(self, failure: RunFailure) -> None:
        self.tracker.tunnel_ended(self, ERROR, failure)
        self._tell(self.listener.error, failure)

    def tell_cancelled(self, message: str) -> None:
        """
        The run book ends the tunnel C{cancelled} and the listener hears it.
        """
        failure = RunFailure(code=CANCELLED, message=message)
        self.tracker.tunnel_ended(self, CANCELLED, failure)
        self._tell(self.listener.error, failure)

    def end_cancelled(self, message: str, code: str = CANCELLED) -> None:
        self.fail(code, message)


def _incomplete(failure: RunFailure) -> RunFailure:
    """
    The caller's view of C{failure} ending the continuation of an answer
    it has part of: the answer is C{incomplete}.
    """
    if failure.code == INCOMPLETE:
        return failure
    return RunFailure(INCOMPLETE, f"the answer was cut and its continuation failed: {failure.code}: {failure.message}")


def _failure_said(said: dict[str, Any], refusal: RunFailure) -> RunFailure | None:
    """
    The failure a Node's C{failure} observation says, what it leaves out
    taken from C{refusal} (its held status); C{None} when it does not hold
    together — no code, a status that is no HTTP status (the JSON parser
    reads C{Infinity} as a number), a delay that is no number — and is
    ignored, like an observation that is not JSON.
    """
    code = said.get("code")
    if not isinstance(code, str) or not code:
        return None
    try:
        status = int(said.get("status") or refusal.status)
        delay = max(float(said.get("retry_after_sec") or 0.0), 0.0)
    except (TypeError, ValueError, OverflowError):
        return None
    if status not in _HTTP_STATUSES:
        return None
    return RunFailure(code, str(said.get("message") or refusal.message), status, retry_after_sec=delay)


def _metadata(frame: messages.ProviderTunnelFrame) -> dict[str, Any] | None:
    """
    A tunnel metadata frame's JSON object, or C{None} when it is not one.
    """
    try:
        info = jsontext.loads(frame.metadata_json)
    except ValueError:
        return None
    return info if isinstance(info, dict) else None


def retry_after(pairs: Iterable[tuple[str, str]]) -> float:
    """
    The delay a C{Retry-After} header among C{pairs} asks for, in seconds
    (its delay-seconds form; 0 when absent or an HTTP date).
    """
    for name, value in pairs:
        if name.lower() == "retry-after":
            try:
                return max(float(value.strip()), 0.0)
            except ValueError:
                return 0.0
    return 0.0
