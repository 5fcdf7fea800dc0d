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

from twisted.internet import defer
from twisted.logger import Logger
from zope.interface import implementer

from iop.adapters.interface import ITunnelSink, NotSupported, TunnelInput
from iop.protocols import iop_pb2
from iop.protocols.convert import usage_to_wire
from iop.protocols.wire import chunks
from iop.node.runs import ADAPTER_ERROR, CAPACITY_EXCEEDED, UNKNOWN_ADAPTER

TUNNEL_NOT_SUPPORTED = "tunnel_not_supported"
CANCELLED = "cancelled"


def tunnel_input(request):
    return TunnelInput(
        tunnel_id=request.tunnel_id,
        method=request.method,
        path=request.path,
        headers=[(h.name, h.value) for h in request.headers],
        body=request.body,
    )


def _text(value):
    return value.decode("latin-1") if isinstance(value, bytes) else str(value)


@implementer(ITunnelSink)
class WireTunnelSink:
    """
    An L{ITunnelSink} writing C{ProviderTunnelFrame}s for one tunnel.
    Calls after the tunnel ended are ignored.
    """

    def __init__(self, relay):
        self._relay = relay

    def status(self, code):
        self._relay.frame(status=int(code))

    def headers(self, pairs):
        headers = iop_pb2.TunnelHeaders(headers=[iop_pb2.Header(name=_text(n), value=_text(v)) for n, v in pairs])
        self._relay.frame(headers=headers)

    def body(self, data):
        if not data:
            return
        for piece in chunks(bytes(data)):
            self._relay.frame(body=piece)
        self._relay.bodyRelayed(len(data))

    def usage(self, usage):
        self._relay.observedUsage(usage)
        self._relay.frame(usage=usage_to_wire(usage))

    def metadata(self, info):
        self._relay.frame(metadata_json=json.dumps(info))


class TunnelRelay:
    """
    One tunnel in flight.
    """

    log = Logger()

    def __init__(self, manager, request, hosted, slot):
        self.manager = manager
        self.tunnel_id = request.tunnel_id
        self.hosted = hosted
        self.slot = slot
        self.seq = 0
        self.finished = False
        self.deferred = None
        self._cancelReason = None

    def begin(self, request):
        sink = WireTunnelSink(self)
        self.deferred = defer.maybeDeferred(self.hosted.adapter.tunnel, tunnel_input(request), sink)
        self.deferred.addCallbacks(self._ended, self._failed)
        self.deferred.addErrback(lambda f: self.log.failure("tunnel {id} relay failed", f, id=self.tunnel_id))

    def frame(self, **field):
        if self.finished:
            return
        self.seq += 1
        self.manager.send(iop_pb2.ProviderTunnelFrame(tunnel_id=self.tunnel_id, seq=self.seq, **field))

    def bodyRelayed(self, size):
        if not self.finished:
            self.manager.metrics.tunnelBody(size)

    def observedUsage(self, usage):
        if not self.finished:
            self.manager.usage.usage(self.hosted.name, usage)

    def cancel(self, reason=None):
        if self.finished or self.deferred is None:
            return
        self._cancelReason = reason or "cancelled by the Edge"
        self.deferred.cancel()

    def _ended(self, result):
        if self._cancelReason:
            self._finish(error=iop_pb2.RunError(code=CANCELLED, message=self._cancelReason))
        else:
            self._finish(end=iop_pb2.TunnelEnd())

    def _failed(self, failure):
        if self.finished:
            return
        if self._cancelReason or failure.check(defer.CancelledError):
            self._finish(error=iop_pb2.RunError(code=CANCELLED, message=self._cancelReason or "cancelled"))
        elif failure.check(NotSupported):
            self._finish(error=iop_pb2.RunError(code=TUNNEL_NOT_SUPPORTED, message=str(failure.value)))
        else:
            self.log.failure("tunnel {id}: adapter {adapter} failed", failure, id=self.tunnel_id, adapter=self.hosted.name)
            code = getattr(failure.value, "code", None)
            status = getattr(failure.value, "status", 0)
            self._finish(
                error=iop_pb2.RunError(
                    code=code if isinstance(code, str) and code else ADAPTER_ERROR,
                    message=str(failure.value) or type(failure.value).__name__,
                    status=status if isinstance(status, int) else 0,
                )
            )

    def _finish(self, **terminal):
        if self.finished:
            return
        self.slot.release()
        self.manager.inflight.discard(self.tunnel_id, self)
        self.frame(**terminal)
        self.finished = True
        self.manager.usage.tunnelEnded(self.hosted.name)


class TunnelManager:
    """
    Starts the tunnels of one connection; see L{iop.node.runs.RunManager}
    for the parameters.
    """

    log = Logger()

    def __init__(self, host, inflight, send, usage, metrics):
        self.host = host
        self.inflight = inflight
        self.send = send
        self.usage = usage
        self.metrics = metrics

    def start(self, request):
        if request.tunnel_id in self.inflight:
            self.log.warn("ignoring a second tunnel request for in-flight id {id}", id=request.tunnel_id)
            return None
        hosted = self.host.get(request.adapter)
        if hosted is None:
            return self._refuse(request, UNKNOWN_ADAPTER, f"no adapter named {request.adapter!r} on this node")
        slot = hosted.gate.acquire()
        if slot is None:
            return self._refuse(
                request, CAPACITY_EXCEEDED, f"adapter {hosted.name} is at its max_concurrency of {hosted.gate.limit}"
            )
        relay = TunnelRelay(self, request, hosted, slot)
        self.inflight.add(request.tunnel_id, relay)
        relay.begin(request)
        return relay

    def _refuse(self, request, code, message):
        self.log.info("tunnel {id} refused: {code}: {message}", id=request.tunnel_id, code=code, message=message)
        self.send(
            iop_pb2.ProviderTunnelFrame(
                tunnel_id=request.tunnel_id, seq=1, error=iop_pb2.RunError(code=code, message=message)
            )
        )
        return None
