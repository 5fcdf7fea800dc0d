"""
Test doubles for the Node: a scriptable Edge on the other end of an
in-memory wire, and adapters whose every step the test controls.
"""

import json
from collections.abc import Callable
from typing import Any

from twisted.application.service import Service
from twisted.internet import defer
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IPushProducer, IReactorTime
from twisted.internet.task import Clock
from twisted.internet.testing import MemoryReactorClock
from twisted.python.failure import Failure
from twisted.test import iosim
from twisted.test.iosim import connectedServerAndClient
from zope.interface import implementer

from iop.adapters.base import AdapterBase, register_output
from iop.adapters.echo import EchoAdapter
from iop.adapters.interface import Capabilities, Emit, IAdapter, NotSupported, Progress, RunInput, TunnelInput
from iop.node.context import NodeContext
from iop.node.flow import Message
from iop.node.host import AdapterHost, Hosted
from iop.node.session import NodeSession
from iop.protocols import messages
from iop.protocols.convert import usage_to_json
from iop.protocols.wire import WIRE_VERSION, IWireReceiver, WireProtocol
from iop.run import ITunnelSink, RunEventData, Usage

TOKEN = "secret-node-token"


class TurnByTurn:
    """
    A run's C{emit} as a test fires it by hand: each event is one the
    provider sent in its own reactor turn, so on a L{Clock} a turn passes
    after it (the Node joins the text deltas of one turn,
    L{iop.node.joined}).
    """

    def __init__(self, emit: Emit, reactor: IReactorTime) -> None:
        self._emit = emit
        self._advance = getattr(reactor, "advance", None)

    def __call__(self, event: RunEventData) -> None:
        self._emit(event)
        if self._advance is not None:
            self._advance(0)

    def register_producer(self, producer: IPushProducer) -> None:
        register_output(self._emit, producer)


@implementer(IAdapter)
class ManualAdapter(AdapterBase):
    """
    C{execute} and C{tunnel} return Deferreds the test fires by hand; each
    call is recorded with its C{emit} or sink, and cancellation is noted.
    """

    type = "manual"

    def __init__(self, name: str, max_concurrency: int, options: dict[str, Any], reactor: IReactorTime) -> None:
        super().__init__(name, max_concurrency, options, reactor)
        self.runs: list[tuple[RunInput, Any, Deferred[None]]] = []  # (RunInput, emit, Deferred)
        self.tunnels: list[tuple[TunnelInput, Any, Deferred[None]]] = []  # (TunnelInput, sink, Deferred)
        self.cancelled: list[str] = []
        self.started = 0
        self.stopped = 0
        self.terminated: list[tuple[str, str]] = []
        self.sessions = {"s1"}
        self.commands: list[tuple[str, dict[str, Any]]] = []
        # (progress, Deferred) of manual_wait commands
        self.waiting: list[tuple[Progress | None, Deferred[Any]]] = []

    def capabilities(self) -> Capabilities:
        return Capabilities(
            max_concurrency=self.max_concurrency,
            sessions=bool(self.options.get("sessions")),
            tunnel=True,
            commands=("manual_ping", "manual_wait"),
        )

    def start(self) -> Deferred[None]:
        self.started += 1
        return defer.succeed(None)

    def stop(self) -> Deferred[None]:
        self.stopped += 1
        return defer.succeed(None)

    def _deferred(self, ident: str) -> Deferred[Any]:
        return defer.Deferred(lambda d: self.cancelled.append(ident))

    def execute(self, run: RunInput, emit: Emit) -> Deferred[None]:
        d = self._deferred(run.run_id)
        self.runs.append((run, TurnByTurn(emit, self.reactor), d))
        return d

    def tunnel(self, request: TunnelInput, sink: ITunnelSink) -> Deferred[None]:
        d = self._deferred(request.tunnel_id)
        self.tunnels.append((request, sink, d))
        return d

    def terminate_session(self, target: str, session_id: str) -> Deferred[dict[str, bool]]:
        if not self.options.get("sessions"):
            return super().terminate_session(target, session_id)
        self.terminated.append((target, session_id))
        known = session_id in self.sessions
        self.sessions.discard(session_id)
        return defer.succeed({"terminated": known})

    def command(self, name: str, args: dict[str, Any], progress: Progress | None = None) -> Deferred[Any]:
        self.commands.append((name, args))
        if name == "session_list":
            return defer.succeed([{"session_id": "s1"}])
        if name == "manual_ping":
            return defer.succeed({"pong": args})
        if name == "manual_wait":
            d = self._deferred(f"command:{len(self.waiting)}")
            self.waiting.append((progress, d))
            return d
        raise NotSupported(f"adapter {self.name} (manual) has no command {name!r}")


@implementer(IAdapter)
class PlainAdapter(AdapterBase):
    """
    An adapter with none of the optional features (no tunnel, sessions or
    commands): every optional call raises L{NotSupported}.
    """

    type = "plain"

    def execute(self, run: RunInput, emit: Callable[[RunEventData], None]) -> Deferred[None]:
        return defer.succeed(None)


def broken_adapter(name: str, max_concurrency: int, options: dict[str, Any], reactor: IReactorTime) -> IAdapter:
    """
    The C{broken} type: building it fails as a bad configuration would.
    """
    raise ValueError(f"adapters[{name}].base_url is required for type broken")


TYPES: dict[str, Callable[..., IAdapter]] = {
    "echo": EchoAdapter,
    "manual": ManualAdapter,
    "plain": PlainAdapter,
    "broken": broken_adapter,
}


def build(name: str, type: str, max_concurrency: int, options: dict[str, Any], reactor: IReactorTime) -> IAdapter:
    """
    A L{iop.adapters.registry.build_adapter} over the fake types.
    """
    return TYPES[type](name, max_concurrency, options, reactor)


def hosted(host: AdapterHost, name: str) -> Hosted:
    """
    The adapter C{name} of C{host}, which the test knows is there.
    """
    found = host.get(name)
    assert found is not None, f"no adapter {name} on this node"
    return found


def manual(host: AdapterHost, name: str = "manual") -> ManualAdapter:
    """
    The L{ManualAdapter} called C{name} on C{host}.
    """
    adapter = hosted(host, name).adapter
    assert isinstance(adapter, ManualAdapter), f"adapter {name} is a {type(adapter).__name__}"
    return adapter


def adapter_config(name: str, type: str = "manual", max_concurrency: int = 2, **options: Any) -> messages.AdapterConfig:
    return messages.adapter_config(name, type, max_concurrency, json.dumps(options) if options else "")


def node_config(
    *adapters: messages.AdapterConfig, node_id: str = "node-1", interval: float = 0.0, timeout: float = 0.0
) -> messages.NodeConfigPayload:
    return messages.node_config(node_id, adapters, interval, timeout)


def accepted(config: messages.NodeConfigPayload, wire_version: int = WIRE_VERSION) -> messages.RegisterResponse:
    return messages.register_accepted(config, wire_version)


def make_context(clock: IReactorTime | None = None, **kwargs: Any) -> NodeContext:
    clock = Clock() if clock is None else clock
    host = kwargs.pop("host", None) or AdapterHost(clock, build)
    return NodeContext(token=TOKEN, clock=clock, host=host, **kwargs)


@implementer(IWireReceiver)
class FakeEdge:
    """
    The Edge's end of one connection, answering registration from a
    script and recording everything else.

    @ivar register_response: sent in answer to C{RegisterRequest} (C{None}:
        stay silent).
    @ivar ready_response: likewise for C{NodeReadyRequest}.
    """

    def __init__(self, register_response: Message | None = None, ready_response: Message | None = None) -> None:
        self.register_response = register_response
        self.ready_response = ready_response
        self.received: list[tuple[str, Message]] = []
        self.wire: WireProtocol | None = None
        self.lost_reason: Failure | None = None

    @property
    def connection(self) -> WireProtocol:
        """
        The wire of this connection (once it is made).
        """
        assert self.wire is not None, "the Node has not connected"
        return self.wire

    def lose_connection(self) -> None:
        """
        The Edge's end drops the connection cleanly.
        """
        transport = self.connection.transport
        assert transport is not None, "the connection is made"
        transport.loseConnection()

    def wire_connected(self, wire: WireProtocol) -> None:
        self.wire = wire

    def message_received(self, kind: str, message: Message) -> None:
        self.received.append((kind, message))
        if kind == "register_request" and self.register_response is not None:
            self.connection.send(self.register_response)
        elif kind == "node_ready_request" and self.ready_response is not None:
            self.connection.send(self.ready_response)

    def wire_lost(self, reason: Failure) -> None:
        self.lost_reason = reason

    def of(self, kind: str) -> list[Message]:
        return [message for k, message in self.received if k == kind]

    def kinds(self) -> list[str]:
        return [k for k, _ in self.received]


def session_wire(session: NodeSession) -> WireProtocol:
    """
    The wire of C{session}, which the test has connected.
    """
    assert session.wire is not None, "the session is connected"
    return session.wire


def connect(context: NodeContext, edge: FakeEdge) -> tuple[NodeSession, iosim.IOPump]:
    """
    Wire a new L{NodeSession} to C{edge} in memory on the context's clock.

    @return: C{(session, pump)}; the connection is made and flushed once.
    """
    session = NodeSession(context)
    clock = context.clock
    assert isinstance(clock, Clock), "an in-memory connection runs on a test clock"

    _, _, pump = connectedServerAndClient(
        lambda: WireProtocol(edge, clock),
        lambda: WireProtocol(session, clock),
        clock=clock,
    )
    return session, pump


def ready_node(
    *adapters: Message, clock: IReactorTime | None = None, wire_version: int = WIRE_VERSION, **context_args: Any
) -> tuple[NodeSession, FakeEdge, iosim.IOPump, NodeContext]:
    """
    A session that registered and became ready against a L{FakeEdge}
    of C{wire_version} configuring C{adapters} (default: one C{manual}
    adapter called C{manual}, max_concurrency 2).

    @return: C{(session, edge, pump, context)}.
    """
    if not adapters:
        adapters = (adapter_config("manual"),)
    context = make_context(clock, **context_args)
    edge = FakeEdge(accepted(node_config(*adapters), wire_version), messages.ready_response(True))
    session, pump = connect(context, edge)
    pump.flush()
    assert session.ready.called, "the session did not become ready"
    edge.received.clear()
    return session, edge, pump, context


def elapse(clock: Clock, pump: iosim.IOPump, seconds: float, step: float = 1.0) -> None:
    """
    Let C{seconds} pass on C{clock} in steps, pumping the connection after
    each so that heartbeats keep it alive.
    """
    while seconds > 0:
        tick = min(step, seconds)
        clock.advance(tick)
        pump.flush()
        seconds -= tick


def run_request(run_id: str = "r1", adapter: str = "manual", text: str = "hello", **kwargs: Any) -> messages.RunRequest:
    return messages.run_request(run_id, adapter, [messages.chat_message("user", text)], **kwargs)


def tunnel_request(
    tunnel_id: str = "t1", adapter: str = "manual", body: bytes = b"{}"
) -> messages.ProviderTunnelRequest:
    return messages.tunnel_request(
        tunnel_id, adapter, "POST", "/chat/completions", [("Content-Type", "application/json")], body
    )


class RecordingStore(Service):
    """
    A run store that keeps its calls in memory, and what was still
    running when it was stopped. It answers C{get} and C{list_runs} like
    L{iop.node.store.RunStore}, from what it recorded.

    @param now: the time source of the records (a counter by default, so
        they sort in the order they were made).
    """

    def __init__(self, now: Callable[[], float] | None = None) -> None:
        self.starts: list[tuple[str, str, str, str, bool]] = []
        self.ends: list[tuple[str, str, str | None]] = []
        self.tunnel_starts: list[tuple[str, str, str]] = []
        self.tunnel_ends: list[tuple[str, str, str | None, int]] = []
        self.events: dict[str, list[tuple[int, RunEventData]]] = {}
        self.rows: dict[str, dict[str, Any]] = {}
        self.running_when_stopped: list[str] | None = None
        self._ticks = iter(range(1, 1 << 62))
        self.now = now if now is not None else (lambda: float(next(self._ticks)))

    def unfinished(self) -> list[str]:
        """
        The ids of runs whose start is recorded and whose end is not.
        """
        ended = {run_id for run_id, _, _ in self.ends}
        return [run_id for run_id, *_ in self.starts if run_id not in ended]

    def stopService(self) -> None:
        super().stopService()
        self.running_when_stopped = self.unfinished()

    def _row(
        self,
        work_id: str,
        kind: str,
        adapter: str,
        target: str = "",
        session_id: str = "",
        background: bool = False,
        caller: str = "",
    ) -> None:
        self.rows[work_id] = {
            "run_id": work_id,
            "kind": kind,
            "adapter": adapter,
            "target": target,
            "session_id": session_id,
            "background": bool(background),
            "status": "running",
            "started_at": self.now(),
            "ended_at": None,
            "error": None,
            "error_code": None,
            "usage": None,
            "bytes": 0 if kind == "tunnel" else None,
            "caller": caller or None,
        }

    def _end(
        self,
        work_id: str,
        status: str,
        error: str | None,
        code: str | None,
        usage: Usage | dict[str, Any] | None,
        **extra: Any,
    ) -> None:
        row = self.rows.get(work_id)
        if row is not None:
            row.update(status=status, ended_at=self.now(), error=error, error_code=code, **extra)
            if usage is not None:
                row["usage"] = usage if isinstance(usage, dict) else usage_to_json(usage)

    def record_start(
        self,
        run_id: str,
        adapter: str,
        target: str = "",
        session_id: str = "",
        background: bool = False,
        caller: str = "",
    ) -> Deferred[None]:
        self.starts.append((run_id, adapter, target, session_id, background))
        self._row(run_id, "run", adapter, target, session_id, background, caller)
        return defer.succeed(None)

    def record_event(self, run_id: str, seq: int, event: RunEventData) -> None:
        self.events.setdefault(run_id, []).append((seq, event))

    def record_end(
        self,
        run_id: str,
        status: str,
        error: str | None = None,
        code: str | None = None,
        usage: Usage | dict[str, Any] | None = None,
    ) -> Deferred[None]:
        self.ends.append((run_id, status, error))
        self._end(run_id, status, error, code, usage)
        return defer.succeed(None)

    def record_tunnel_start(self, tunnel_id: str, adapter: str, target: str = "", caller: str = "") -> Deferred[None]:
        self.tunnel_starts.append((tunnel_id, adapter, target))
        self._row(tunnel_id, "tunnel", adapter, target, caller=caller)
        return defer.succeed(None)

    def record_tunnel_end(
        self,
        tunnel_id: str,
        status: str,
        error: str | None = None,
        code: str | None = None,
        usage: Usage | dict[str, Any] | None = None,
        size: int = 0,
    ) -> Deferred[None]:
        self.tunnel_ends.append((tunnel_id, status, code, size))
        self._end(tunnel_id, status, error, code, usage, bytes=size)
        return defer.succeed(None)

    def get(self, run_id: str, after: int = 0) -> "Deferred[dict[str, Any] | None]":
        row = self.rows.get(run_id)
        if row is None:
            return defer.succeed(None)
        # By seq, a seq recorded again reading as its latest (as the RunStore).
        events = sorted(dict(self.events.get(run_id, [])).items(), key=lambda pair: pair[0])
        run = dict(row, output="".join(e.text for _, e in events if e.type == "delta"))
        return defer.succeed({"run": run, "events": [_event_json(seq, e) for seq, e in events if seq > after]})

    def list_runs(
        self, status: str | None = None, kind: str | None = None, limit: int = 50, caller: str | None = None
    ) -> Deferred[list[dict[str, Any]]]:
        rows = [
            dict(r)
            for r in reversed(self.rows.values())
            if (not status or r["status"] == status)
            and (not kind or r["kind"] == kind)
            and (not caller or r["caller"] == caller)
        ]
        return defer.succeed(rows[:limit])

    def recent(self, limit: int = 50) -> Deferred[list[dict[str, Any]]]:
        return self.list_runs(limit=limit)

    def health(self) -> dict[str, Any]:
        return {"status": "none"}


def _event_json(seq: int, event: RunEventData) -> dict[str, Any]:
    payload: dict[str, Any] = {"seq": seq, "type": event.type}
    if event.text:
        payload["text"] = event.text
    if event.usage is not None:
        payload["usage"] = usage_to_json(event.usage)
    if event.error is not None:
        payload["error"] = {"code": event.error.code, "message": event.error.message}
    return payload


def dialled(reactor: MemoryReactorClock, edge: FakeEdge) -> iosim.IOPump:
    """
    Complete the oldest TCP dial on a C{MemoryReactorClock} by connecting
    it in memory to C{edge}.

    @return: the L{iosim.IOPump}, flushed once.
    """
    _, _, factory, _, _ = reactor.tcpClients.pop(0)
    client = factory.buildProtocol(None)
    server = WireProtocol(edge, reactor)
    return iosim.connect(server, iosim.makeFakeServer(server), client, iosim.makeFakeClient(client), clock=reactor)


class RecordingExit:
    """
    Stands in for L{iop.node.exit.ProcessExit}.
    """

    def __init__(self) -> None:
        self.calls: list[tuple[int, str]] = []

    def __call__(self, status: int, message: str) -> None:

        self.calls.append((status, message))
