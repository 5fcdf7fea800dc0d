"""
Normalized runs on the Node: from C{RunRequest} to ordered C{RunEvent}s.

The adapter emits events; this module numbers them, guarantees exactly one
terminal (synthesizing C{complete}/C{error}/C{cancelled} when the adapter
ends without one), enforces the adapter's capacity gate, and frees the
slot before the terminal goes out, so the Edge never sees a terminal for
work whose capacity is still held.

What the adapter emits is not trusted to fit the wire: text UTF-8 cannot
carry (a lone surrogate, as a JSON text may hold one) is cleaned
(L{clean_text}), and an event that still cannot be encoded (a value of the
wrong type, a count out of range) never goes out: the run ends there with
a plain C{error} coded C{adapter_error} in its stead, on the wire and in
the store alike.
"""

from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

from twisted.internet import defer
from twisted.internet.interfaces import IPushProducer
from twisted.logger import Logger
from twisted.python.failure import Failure

from iop import jsontext
from iop.adapters.interface import RunInput
from iop.node.flow import Message, SendWindow
from iop.node.gate import Slot
from iop.node.host import AdapterHost, Hosted
from iop.node.joined import JoinedDeltas
from iop.node.metrics import NodeMetrics
from iop.node.owners import SessionOwners
from iop.node.stats import UsageBook
from iop.node.store import Store
from iop.node.work import Inflight, Refused, Work, admit, record_safely
from iop.protocols.convert import event_to_wire, usage_to_wire
from iop.protocols.wire import MAX_FRAME_BYTES, FrameTooLarge
from iop.run import (
    ADAPTER_ERROR,
    CANCELLED,
    COMPLETE,
    DELTA,
    ERROR,
    EVENT_TYPES,
    INVALID_REQUEST,
    REASONING_DELTA,
    SESSION_OWNED,
    TERMINAL_TYPES,
    RunEventData,
    RunFailure,
    Usage,
    clean_text,
)


class BadRequest(ValueError):
    """
    A C{RunRequest} that cannot be turned into a L{RunInput}.
    """


def run_input(request: Message) -> RunInput:
    """
    The L{RunInput} an adapter sees for a C{RunRequest}.

    @raise BadRequest: if C{options_json} is not a JSON object, or a
        message's C{tool_calls_json} not a JSON list.
    """
    options = _json_field(request.options_json, "options_json", dict, "a JSON object") if request.options_json else {}
    return RunInput(
        run_id=request.run_id,
        target=request.target,
        messages=[_message(m) for m in request.messages],
        session_id=request.session_id,
        background=request.background,
        options=options,
        traceparent=request.traceparent,
    )


def _message(wire: Message) -> dict[str, Any]:
    """
    A chat message as adapters see it: C{role} and C{content} always; the
    OpenAI extras (C{name}, C{tool_call_id}, C{tool_calls}, C{images})
    only when present.

    @raise BadRequest: if C{tool_calls_json} is not a JSON list.
    """
    message: dict[str, Any] = {"role": wire.role, "content": wire.content}
    if wire.name:
        message["name"] = wire.name
    if wire.tool_call_id:
        message["tool_call_id"] = wire.tool_call_id
    if wire.tool_calls_json:
        message["tool_calls"] = _json_field(wire.tool_calls_json, "tool_calls_json", list, "a JSON list")
    if wire.images:
        message["images"] = list(wire.images)
    return message


def _json_field(text: str, name: str, kind: type, described: str) -> Any:
    """
    The JSON value in the wire field C{name}, which must be a C{kind}.

    @raise BadRequest: if it is not valid JSON or not a C{kind}
        (C{described}, for the message).
    """
    try:
        value = jsontext.loads(text)
    except ValueError as e:
        raise BadRequest(f"{name} is not valid JSON: {e}") from None
    if not isinstance(value, kind):
        raise BadRequest(f"{name} must be {described}")
    return value


def _failure_text(failure: Failure) -> str:
    message = str(failure.value)
    name = type(failure.value).__name__
    return f"{name}: {message}" if message else name


def _clean(value: Any) -> Any:
    return clean_text(value) if isinstance(value, str) else value


def _cleaned(event: RunEventData) -> RunEventData:
    """
    C{event} with each of its texts L{clean_text}ed (a value that is no
    text is left as it is, for the encoding to refuse).
    """
    error, call = event.error, event.tool_call
    return replace(
        event,
        text=_clean(event.text),
        finish_reason=_clean(event.finish_reason),
        error=None if error is None else replace(error, code=_clean(error.code), message=_clean(error.message)),
        tool_call=(
            None
            if call is None
            else replace(call, id=_clean(call.id), name=_clean(call.name), arguments=_clean(call.arguments))
        ),
    )


def encoded(run_id: str, seq: int, event: RunEventData, first_byte_ms: float = 0.0) -> tuple[Message, RunEventData]:
    """
    C{event} as a wire C{RunEvent}: as it is, or with its texts
    L{clean_text}ed when UTF-8 cannot carry them.

    @return: C{(message, the event it holds)}.
    @raise Exception: what the encoding raises for an event that cannot be
        encoded even so (C{TypeError}, C{ValueError}), or L{FrameTooLarge}
        for one no frame can carry.
    """
    _texts_are_text(event)
    try:
        message = event_to_wire(run_id, seq, event, first_byte_ms)
    except UnicodeEncodeError:
        event = _cleaned(event)
        message = event_to_wire(run_id, seq, event, first_byte_ms)
    _fits(message, event)
    return message, event


#: The most a C{RunEvent} may take: a frame, less its envelope's few bytes.
MAX_EVENT_BYTES = MAX_FRAME_BYTES - 64


def _fits(message: Message, event: RunEventData) -> None:
    """
    @raise FrameTooLarge: C{message} would not fit in one frame (a tool call
        of megabytes of arguments; a text delta is joined up to a bound
        that fits, so its size is only reckoned when its text is long).
    """
    if event.type in (DELTA, REASONING_DELTA) and len(event.text or "") < MAX_EVENT_BYTES // 4:
        return
    size = message.ByteSize()
    if size > MAX_EVENT_BYTES:
        raise FrameTooLarge(f"its RunEvent of {size} bytes exceeds {MAX_EVENT_BYTES}")


def _texts_are_text(event: RunEventData) -> None:
    """
    @raise TypeError: a text of C{event} is not a C{str} (protobuf would
        take C{bytes} for one, which the store's JSON and the Edge cannot).
    """
    call, error = event.tool_call, event.error
    texts = [event.text]
    if event.finish_reason is not None:
        texts.append(event.finish_reason)
    if call is not None:
        texts += [call.id, call.name, call.arguments]
    if error is not None:
        texts += [error.code, error.message]
    for text in texts:
        if not isinstance(text, str):
            raise TypeError(f"a {event.type} event holds {type(text).__name__} where text goes")


def _encodable(usage: Usage) -> bool:
    try:
        usage_to_wire(usage)
    except Exception:
        return False
    return True


class Emit:
    """
    The C{emit} an adapter is given: a callable relaying one event, which
    also takes the adapter's source of output as a producer to pause while
    the Edge's caller is not taking the stream (flow control).
    """

    def __init__(self, relay: "RunRelay") -> None:
        self._relay = relay

    def __call__(self, event: RunEventData) -> None:
        self._relay.emit(event)

    def register_producer(self, producer: IPushProducer) -> None:
        self._relay.flow.register_producer(producer)


class RunRelay(Work):
    """
    One run in flight: relays the adapter's events until exactly one
    terminal has been sent.
    """

    manager: "RunManager"

    def __init__(self, manager: "RunManager", request: Message, hosted: Hosted, slot: Slot) -> None:
        super().__init__(manager, request.run_id, hosted, slot, request.window_bytes)
        self.request = request
        self.run_id: str = request.run_id
        self.usage: Usage | None = None
        self.terminal: str | None = None
        #: The terminal as it went on the wire (what a resumed stream ends
        #: with when the store lacks it).
        self.terminal_message: Message | None = None
        self.on_end: Callable[[RunRelay], object] | None = None
        self._joined = JoinedDeltas(self._send, manager.host.turns)

    @property
    def background(self) -> bool:
        return bool(self.request.background)

    @property
    def status(self) -> str:
        """
        C{running}, or the type of the terminal it ended with.
        """
        return self.terminal or "running"

    def detach(self, on_end: Callable[["RunRelay"], object]) -> None:
        """
        The connection is gone but this background run goes on: its
        events now go only to the store (what a resumed stream is replayed
        from), nothing waits for credit, and C{on_end(self)} is called
        when it ends.
        """
        self.manager.inflight.discard(self.work_id, self)
        self.on_end = on_end
        self._rewire(lambda message: None)

    def attach(self, manager: "RunManager", after_seq: int) -> "Resumed":
        """
        A new session takes this run back (its Edge asked with
        C{RunResume}): from now on it is that session's work, and its events
        go on that connection — those after C{after_seq} first, once
        L{Resumed.replay} has the history, then the live ones.

        @return: the L{Resumed} sender.
        """
        self.manager = manager
        self.on_end = None
        if not self.finished:
            manager.inflight.add(self.work_id, self)
        resumed = Resumed(manager.send, after_seq, self.terminal_message)
        self._rewire(resumed)
        return resumed

    def _rewire(self, send: Callable[[Message], object]) -> None:
        """
        Send through C{send} from now on, without a credit window; the
        adapter's paused source (if any) goes on.
        """
        old = self.flow
        self.flow = SendWindow(send)
        if old.producer is not None:
            self.flow.register_producer(old.producer)
            if old.paused:
                old.producer.resumeProducing()

    def start(self, run: RunInput) -> None:
        self.manager.record(
            "record_start",
            self.run_id,
            self.hosted.name,
            self.request.target,
            self.request.session_id,
            self.request.background,
            self.request.caller,
        )
        self.begin(self.hosted.adapter.execute, run, Emit(self))

    def emit(self, event: RunEventData) -> None:
        """
        The adapter's C{emit}: relay one L{RunEventData}.
        """
        if self.finished:
            self.log.debug("run {run_id}: dropping {type} after the terminal", run_id=self.run_id, type=event.type)
            return
        if event.type not in EVENT_TYPES:
            self.log.warn("run {run_id}: dropping unknown event type {type!r}", run_id=self.run_id, type=event.type)
            return
        if event.usage is not None:
            self.usage = event.usage
        if event.type in TERMINAL_TYPES:
            self._finish(event)
        else:
            self._joined(event)

    def _ended(self, result: object) -> None:
        if not self.finished:
            self._finish(RunEventData(CANCELLED if self.cancel_reason else COMPLETE, usage=self.usage))

    def _failed(self, failure: Failure) -> None:
        if self.finished:
            if not failure.check(defer.CancelledError):
                self.log.failure("run {run_id}: adapter failed after its terminal", failure, run_id=self.run_id)
            return
        if self.cancel_reason or failure.check(defer.CancelledError):
            self._finish(RunEventData(CANCELLED, usage=self.usage))
            return
        self.log.failure(
            "run {run_id}: adapter {adapter} failed", failure, run_id=self.run_id, adapter=self.hosted.name
        )
        self._finish(RunEventData(ERROR, usage=self.usage, error=RunFailure(ADAPTER_ERROR, _failure_text(failure))))

    def _finish(self, event: RunEventData) -> None:
        # The text of this turn goes out before the terminal.
        self._joined.flush()
        self.end(self._send_terminal, event)

    def _send_terminal(self, event: RunEventData) -> None:
        if event.type == CANCELLED and self.cancel_reason and self.cancel_code != CANCELLED:
            # Cancelled with the Edge's verdict (the link was lost): the
            # error the Edge gave its caller, not a cancel.
            event = RunEventData(ERROR, usage=event.usage, error=RunFailure(self.cancel_code, self.cancel_reason))
        # What went out: a plain error when the adapter's terminal could not.
        event = self._send(event)
        self.terminal = event.type
        error = event.error.message if event.error is not None else None
        code = event.error.code if event.error is not None else None
        if event.type == CANCELLED and self.cancel_reason:
            error = self.cancel_reason
            code = code or CANCELLED
        if event.error is not None:
            self.manager.metrics.provider_failed(self.hosted.name, event.error.code, event.error.deadline)
        self.manager.ended(self.hosted.name, self.run_id, event.type, error, event.usage or self.usage, code)
        if self.on_end is not None:
            self.on_end(self)

    def _send(self, event: RunEventData) -> RunEventData:
        """
        Number, record and send one event: as it is, or with its text
        cleaned when UTF-8 cannot carry it; one that cannot be encoded at
        all ends the run (L{_unsendable}).

        @return: the event as it went out (for the terminal, the plain
            error sent in its stead when it could not).
        """
        if self.terminal_message is not None:
            # The Node ended the run in the adapter's stead: nothing follows.
            return event
        seq = self.seq + 1
        first_byte_ms = self.since_arrival_ms() if seq == 1 else 0.0
        try:
            message, event = encoded(self.run_id, seq, event, first_byte_ms)
        except Exception:
            return self._unsendable(event)
        self.seq = seq
        self.manager.record_event(self.run_id, seq, event)
        size = len(event.text.encode("utf-8")) if event.type in (DELTA, REASONING_DELTA) and event.text else 0
        if event.type in TERMINAL_TYPES:
            self.terminal_message = message
        self.flow.send(message, size)
        return event

    def _unsendable(self, event: RunEventData) -> RunEventData:
        """
        The adapter's C{event} cannot be encoded (called in the C{except}
        block): it is logged and never sent, and a plain C{error} coded
        C{adapter_error} goes out instead — as the terminal when C{event}
        was it; else as the end of the run, whose adapter is stopped (what
        it sends next would follow a gap).

        @return: that C{error}.
        """
        failure = Failure()
        self.log.failure(
            "run {run_id}: adapter {adapter} emitted a {type} event that cannot be sent",
            failure,
            run_id=self.run_id,
            adapter=self.hosted.name,
            type=event.type,
        )
        if self.usage is not None and not _encodable(self.usage):
            self.usage = None
        why = clean_text(_failure_text(failure))
        plain = RunEventData(
            ERROR,
            usage=self.usage,
            error=RunFailure(
                ADAPTER_ERROR, f"adapter {self.hosted.name}'s {event.type} event could not be sent: {why}"
            ),
        )
        if event.type in TERMINAL_TYPES:
            return self._send(plain)
        self.end(self._send_terminal, plain)
        self.stop()
        return plain


class Resumed:
    """
    The sender of a re-attached run: its live events are held until the
    history the Edge missed (from the store) went out, then each event
    goes out once, in seq order, and only if the Edge has not had it.

    @param after: the seq of the Edge's last event of the run.
    @param terminal: the terminal of a run that ended before it was
        re-attached, as it went on the wire: it ends the history when the
        store lacks it (a store that failed), so the Edge still learns
        how the run ended.
    """

    def __init__(self, send: Callable[[Message], object], after: int, terminal: Message | None = None) -> None:
        self._send = send
        self.after = after
        self.terminal = terminal
        self.replaying = True
        self._held: list[Message] = []

    def __call__(self, message: Message) -> None:
        if self.replaying:
            self._held.append(message)
        elif message.seq > self.after:
            self.after = message.seq
            self._send(message)

    def replay(self, history: Iterable[Message]) -> None:
        """
        C{history}: the run's stored events after L{after} as wire
        messages; then what was held.
        """
        self.replaying = False
        held, self._held = self._held, []
        # (The terminal after a history that has it is a repeat: dropped.)
        ended = [] if self.terminal is None else [self.terminal]
        for message in sorted(history, key=lambda m: m.seq) + ended + held:
            self(message)


class RunManager:
    """
    Starts the runs of one connection.

    @param host: the L{iop.node.host.AdapterHost}.
    @param inflight: the connection's L{iop.node.work.Inflight}.
    @param send: sends one wire message on the connection (a no-op once it
        is gone).
    @param owners: whose each session is; a run on another caller key's
        session is refused (C{session_owned}).
    """

    log = Logger()

    def __init__(
        self,
        host: AdapterHost,
        inflight: Inflight,
        send: Callable[[Message], object],
        store: Store,
        usage: UsageBook,
        metrics: NodeMetrics,
        owners: SessionOwners,
    ) -> None:
        self.host = host
        self.inflight = inflight
        self.send = send
        self.store = store
        self.usage = usage
        self.metrics = metrics
        self.owners = owners

    def start(self, request: Message) -> RunRelay | None:
        """
        Handle one C{RunRequest}.
        """
        try:
            admitted = admit(self.host, self.inflight, request.run_id, request.adapter)
            if admitted is None:
                self.log.warn("ignoring a second RunRequest for in-flight id {run_id}", run_id=request.run_id)
                return None
            hosted, slot = admitted
            try:
                run = self._input(request, hosted)
            except Refused:
                slot.release()
                raise
        except Refused as refusal:
            self._refuse(request, refusal.code, refusal.message)
            return None
        relay = RunRelay(self, request, hosted, slot)
        relay.start(run)
        return relay

    def _input(self, request: Message, hosted: Hosted) -> RunInput:
        """
        The L{RunInput} of an admitted C{RunRequest}, its session (if any)
        claimed for its caller.

        @raise Refused: C{invalid_request} for a request that cannot be
            read, C{session_owned} for a session of another caller key (so
            the adapter never resumes another key's conversation).
        """
        try:
            run = run_input(request)
        except BadRequest as e:
            raise Refused(INVALID_REQUEST, str(e)) from None
        if (
            run.session_id
            and hosted.adapter.capabilities().sessions
            and not self.owners.claim(hosted.name, run.session_id, request.caller)
        ):
            raise Refused(
                SESSION_OWNED, f"session {run.session_id!r} of adapter {hosted.name} belongs to another caller key"
            )
        return run

    def _refuse(self, request: Message, code: str, message: str) -> None:
        """
        End a run that never reached an adapter with one C{error} terminal.
        """
        self.log.info("run {run_id} refused: {code}: {message}", run_id=request.run_id, code=code, message=message)
        self.record(
            "record_start",
            request.run_id,
            request.adapter,
            request.target,
            request.session_id,
            request.background,
            request.caller,
        )
        event = RunEventData(ERROR, error=RunFailure(code, message))
        self.record_event(request.run_id, 1, event)
        self.send(event_to_wire(request.run_id, 1, event))
        self.ended(request.adapter, request.run_id, ERROR, f"{code}: {message}", None, code)

    def record(self, method: str, *args: Any) -> None:
        """
        Write to the run store without ever letting it break the relay.
        """
        record_safely(self.store, self.log, "run", method, *args)

    def record_event(self, run_id: str, seq: int, event: RunEventData) -> None:
        """
        Keep one event in the run store (never breaking the relay).
        """
        try:
            self.store.record_event(run_id, seq, event)
        except Exception:
            self.log.failure("run {run_id}: run store record_event failed", run_id=run_id)

    def ended(
        self,
        adapter: str,
        run_id: str,
        status: str,
        error: str | None,
        usage: Usage | None,
        code: str | None = None,
    ) -> None:

        self.record("record_end", run_id, status, error, code, usage)
        self.usage.run_ended(adapter, status)
        if usage is not None:
            self.usage.usage(adapter, usage)
        self.metrics.run_ended(adapter, status)
