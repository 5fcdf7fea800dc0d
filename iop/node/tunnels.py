"""
Raw provider tunnels on the Node: from C{ProviderTunnelRequest} to ordered
C{ProviderTunnelFrame}s.

The adapter writes the provider's response into an L{ITunnelSink}; the
sink here turns each call into frames on the wire, splitting the body so
that every frame stays under the chunk limit. The provider's bytes are
relayed untouched: usage and metadata are separate frames, never part of
the body. Exactly one C{end} or C{error} frame closes a tunnel, after the
capacity slot (shared with normalized runs) has been freed.
"""

import json
from collections.abc import Callable, Iterable
from typing import Any

from twisted.internet import defer
from twisted.internet.interfaces import IPushProducer
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

from iop import jsontext
from iop.adapters.interface import NotSupported, TunnelInput
from iop.adapters.streams import ProviderError
from iop.node.flow import Message
from iop.node.gate import Slot
from iop.node.host import AdapterHost, Hosted
from iop.node.metrics import NodeMetrics
from iop.node.stats import UsageBook
from iop.node.store import NullStore, Store
from iop.node.work import Inflight, Refused, Work, admit, record_safely
from iop.protocols import messages
from iop.protocols.convert import failure_to_wire, usage_to_wire
from iop.protocols.wire import chunks
from iop.run import ADAPTER_ERROR, CANCELLED, COMPLETE, ERROR, TUNNEL_NOT_SUPPORTED, ITunnelSink, Usage


def tunnel_input(request: Message) -> TunnelInput:
    return TunnelInput(
        tunnel_id=request.tunnel_id,
        method=request.method,
        path=request.path,
        headers=[(h.name, h.value) for h in request.headers],
        body=request.body,
    )


def _text(value: object) -> str:
    return value.decode("latin-1") if isinstance(value, bytes) else str(value)


@implementer(ITunnelSink)
class WireTunnelSink:
    """
    An L{ITunnelSink} writing C{ProviderTunnelFrame}s for one tunnel.
    Calls after the tunnel ended are ignored.
    """

    def __init__(self, relay: "TunnelRelay") -> None:
        self._relay = relay

    def register_producer(self, producer: IPushProducer) -> None:
        """
        The adapter's source of body bytes (an C{IPushProducer}): paused
        while the Edge's caller is not taking the stream (flow control).
        """
        self._relay.flow.register_producer(producer)

    def status(self, code: int) -> None:
        self._relay.frame(status=int(code), first_byte_ms=self._relay.since_arrival_ms())

    def headers(self, pairs: Iterable[tuple[str | bytes, str | bytes]]) -> None:
        self._relay.frame(headers=[(_text(n), _text(v)) for n, v in pairs])

    def body(self, data: bytes) -> None:
        if not data:
            return
        for piece in chunks(bytes(data)):
            self._relay.body_frame(piece)
        self._relay.body_relayed(len(data))

    def usage(self, usage: Usage) -> None:
        self._relay.observed_usage(usage)
        self._relay.frame(usage=usage_to_wire(usage))

    def metadata(self, info: dict[str, Any]) -> None:
        self._relay.frame(metadata_json=json.dumps(info))


def requested_model(body: bytes) -> str:
    """
    The C{model} of a tunnelled request body (what the store records as
    the tunnel's target), or C{""} when it names none or is too large to
    look at.
    """
    if not body or len(body) > MODEL_SNIFF_BYTES:
        return ""
    try:
        model = jsontext.loads(body).get("model")
    except (ValueError, AttributeError):
        return ""
    return model if isinstance(model, str) else ""


#: Request bodies larger than this are not parsed for the store's target.
MODEL_SNIFF_BYTES = 1024 * 1024


class TunnelRelay(Work):
    """
    One tunnel in flight.

    @ivar usage: the last usage the adapter observed in the body.
    @ivar size: provider body bytes relayed so far.
    """

    manager: "TunnelManager"

    def __init__(self, manager: "TunnelManager", request: Message, hosted: Hosted, slot: Slot) -> None:
        super().__init__(manager, request.tunnel_id, hosted, slot, request.window_bytes)
        self.tunnel_id: str = request.tunnel_id
        self.usage: Usage | None = None
        self.size = 0

    def start(self, request: Message) -> None:
        self.manager.record(
            "record_tunnel_start", self.tunnel_id, self.hosted.name, requested_model(request.body), request.caller
        )
        self.begin(self.hosted.adapter.tunnel, tunnel_input(request), WireTunnelSink(self))

    def frame(self, **field: Any) -> None:
        """
        Send one frame of the provider's response other than a body piece
        (those are L{body_frame}s, the only frames that spend credit);
        nothing after the end.
        """
        if not self.finished:
            self._frame(**field)

    def body_frame(self, piece: bytes) -> None:
        """
        Send one piece of the provider's body (the bulk of a tunnel: its
        frame is built in its envelope); nothing after the end.
        """
        if not self.finished:
            self.seq += 1
            self.flow.send(messages.tunnel_body(self.tunnel_id, self.seq, piece), len(piece))

    def _frame(self, **field: Any) -> None:
        self.seq += 1
        self.flow.send(messages.tunnel_frame(self.tunnel_id, self.seq, **field))

    def body_relayed(self, size: int) -> None:
        if not self.finished:
            self.size += size
            self.manager.metrics.tunnel_body(size)

    def observed_usage(self, usage: Usage) -> None:
        if not self.finished:
            self.usage = usage
            self.manager.usage.usage(self.hosted.name, usage)

    def _ended(self, result: object) -> None:
        if self.cancel_reason:
            self._finish(error=messages.run_error(self.cancel_code, self.cancel_reason))
        else:
            self._finish(end=True)

    def _failed(self, failure: Failure) -> None:
        if self.finished:
            return
        if self.cancel_reason or failure.check(defer.CancelledError):
            self._finish(error=messages.run_error(self.cancel_code, self.cancel_reason or "cancelled"))
        elif failure.check(NotSupported):
            self._finish(error=messages.run_error(TUNNEL_NOT_SUPPORTED, str(failure.value)))
        else:
            if isinstance(failure.value, ProviderError):
                # The back end's own failure: expected, one line.
                self.log.info(
                    "tunnel {id}: adapter {adapter}: {code}: {message}",
                    id=self.tunnel_id,
                    adapter=self.hosted.name,
                    code=failure.value.code,
                    message=failure.value.message,
                )

            else:
                self.log.failure(
                    "tunnel {id}: adapter {adapter} failed", failure, id=self.tunnel_id, adapter=self.hosted.name
                )
            self._finish(error=_wire_error(failure.value))

    def _finish(self, **terminal: Any) -> None:
        self.end(self._send_terminal, terminal)

    def _send_terminal(self, terminal: dict[str, Any]) -> None:
        self._frame(**terminal)
        self.manager.usage.tunnel_ended(self.hosted.name)
        error = terminal.get("error")
        if error is None:
            status, message, code = COMPLETE, None, None
        else:
            status = CANCELLED if error.code == CANCELLED else ERROR
            message, code = error.message, error.code
            self.manager.metrics.provider_failed(self.hosted.name, error.code, error.deadline)
        self.manager.record("record_tunnel_end", self.tunnel_id, status, message, code, self.usage, self.size)


def _wire_error(error: BaseException | None) -> messages.RunError:
    """
    The C{RunError} of a tunnel that failed with C{error}: a
    L{ProviderError}'s code, status, missed deadline and Retry-After;
    another error's C{code} and C{status} when it has them, else
    C{adapter_error}.
    """
    if isinstance(error, ProviderError):
        return failure_to_wire(error.failure())
    code = getattr(error, "code", None)
    status = getattr(error, "status", 0)
    return messages.run_error(
        code if isinstance(code, str) and code else ADAPTER_ERROR,
        str(error) or type(error).__name__,
        status if isinstance(status, int) else 0,
    )


class TunnelManager:
    """
    Starts the tunnels of one connection; see L{iop.node.runs.RunManager}
    for the parameters.
    """

    log = Logger()

    def __init__(
        self,
        host: AdapterHost,
        inflight: Inflight,
        send: Callable[[Message], object],
        usage: UsageBook,
        metrics: NodeMetrics,
        store: Store | None = None,
    ) -> None:
        self.host = host
        self.inflight = inflight
        self.send = send
        self.usage = usage
        self.metrics = metrics
        self.store: Store = store if store is not None else NullStore()

    def record(self, method: str, *args: Any) -> None:
        """
        Write to the run store without ever letting it break the relay.
        """
        record_safely(self.store, self.log, "tunnel", method, *args)

    def start(self, request: Message) -> TunnelRelay | None:
        try:
            admitted = admit(self.host, self.inflight, request.tunnel_id, request.adapter)
        except Refused as refusal:
            self._refuse(request, refusal.code, refusal.message)
            return None
        if admitted is None:
            self.log.warn("ignoring a second tunnel request for in-flight id {id}", id=request.tunnel_id)
            return None
        relay = TunnelRelay(self, request, *admitted)
        relay.start(request)
        return relay

    def _refuse(self, request: Message, code: str, message: str) -> None:
        self.log.info("tunnel {id} refused: {code}: {message}", id=request.tunnel_id, code=code, message=message)
        self.record(
            "record_tunnel_start", request.tunnel_id, request.adapter, requested_model(request.body), request.caller
        )
        self.record("record_tunnel_end", request.tunnel_id, ERROR, message, code, None, 0)
        self.send(messages.tunnel_frame(request.tunnel_id, 1, error=messages.run_error(code, message)))
