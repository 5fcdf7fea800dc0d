"""
The Edge as one service tree, and the one caller API every surface uses.

L{EdgeService} is a C{MultiService} whose children are the Node port, the
HTTP site and the optional console (L{iop.edge.listeners}). It owns the
objects that hold the Edge's state and wires them together:

  - the L{NodeRegistry} (connections and generations),
  - the L{ProviderPool} (capacity, leases, waiters),
  - the L{Inflight} table (runs, tunnels, pending command answers),
  - L{NodeLinks} (what Nodes say, and what the Edge tells them),
  - the L{Placer} (where work goes).

Surfaces call L{EdgeService.submit} and never hold a placement or a lease:
the service places the work, decides from the chosen provider whether it
travels as a normalized run or a raw tunnel, asks the surface for the
matching listener, and starts it in one guarded step that returns the
lease on any failure. It knows nothing of HTTP.

Stopping the service drains: new work is refused, waiters fail with
C{shutting_down}, Nodes are told, work in flight may finish within
C{shutdown_grace_sec}, and what is left then ends with a terminal sent to
its caller (L{EdgeService.hurry} ends it at once).
"""

import json

from twisted.application.service import MultiService, Service
from twisted.internet import defer
from twisted.logger import Logger

from iop.edge.bus import EventBus
from iop.edge.dispatch import RunDispatch, TunnelDispatch
from iop.edge.errors import ServiceError
from iop.edge.inflight import Inflight
from iop.edge.links import NodeLinks
from iop.edge.placement import Placer
from iop.edge.pool import ProviderPool
from iop.edge.registry import NodeRegistry
from iop.edge.spec import new_id
from iop.edge.status import model_names, snapshot
from iop.protocols import iop_pb2
from iop.run import SHUTTING_DOWN

#: Run kinds a surface's C{listener_for} is asked for.
RUN = "run"
TUNNEL = "tunnel"

#: How long a drained Edge waits for its HTTP connections to flush their
#: last bytes before it aborts them.
FLUSH_TIMEOUT_SEC = 5.0

#: How long a node command may take before the Edge gives up.
COMMAND_TIMEOUT_SEC = 30.0


def _shutting_down():
    return ServiceError("unavailable", "the Edge is shutting down", code=SHUTTING_DOWN)


class EdgeService(MultiService):
    """
    @param config: a validated L{iop.edge.config.EdgeConfig}.
    @param reactor: the reactor (listeners, timers); a C{task.Clock} or
        C{MemoryReactorClock} in tests, where the tree is never started.
    @param listen: build the listening children (C{False} for a bare
        service in unit tests).

    @ivar draining: C{True} once a stop began: new work is refused.
    @ivar site: the HTTP L{iop.edge.http.site.EdgeSite} (with C{listen}).
    @ivar node_port: the L{iop.edge.nodeport.NodePortFactory} (with C{listen}).
    """

    log = Logger()

    def __init__(self, config, reactor, bus=None, listen=True):
        super().__init__()
        self.config = config
        self.clock = reactor
        self.bus = bus if bus is not None else EventBus(reactor)
        self.registry = NodeRegistry(config.nodes, reactor)
        self.pool = ProviderPool(reactor, config.providers(), config.model_groups)
        self.inflight = Inflight(reactor, self.bus)
        self.links = NodeLinks(lambda: self.config, self.registry, self.pool, self.inflight, self.bus)
        self.placer = Placer(lambda: self.config, self.registry, self.pool)
        self.draining = False
        self.site = None
        self.node_port = None
        self._listeners = ()
        self._grace_timer = None
        self._drained = None
        if listen:
            from iop.edge.listeners import add_listeners

            self._listeners = [child for child in add_listeners(self, reactor) if child is not None]

    # -- the caller API ----------------------------------------------------------

    def submit(self, spec, listener_for):
        """
        SubmitRun: place the work, then start it as a run or a tunnel.

        @param spec: a L{iop.edge.spec.RunSpec}.
        @param listener_for: C{listener_for(kind, work_id)} returns the
            listener for the chosen kind: an L{IRunListener} for L{RUN}, an
            L{ITunnelListener} for L{TUNNEL} (only asked when
            C{spec.tunnel} is set and the provider takes raw HTTP).
        @return: a cancellable Deferred firing with the work's id once it
            started; cancelling it while it waits leaves the queue.
        """
        if self.draining:
            return defer.fail(_shutting_down())
        d = self.placer.place(spec)
        d.addCallback(self._start, spec, listener_for)
        return d

    def _start(self, placement, spec, listener_for):
        """
        Start placed work in one guarded step: whatever fails before the
        work is in flight returns the placement's lease.
        """
        try:
            if self.draining:
                raise _shutting_down()
            if placement.tunnels and spec.tunnel is not None:
                work_id = new_id("tun")
                message = _tunnel_request(work_id, placement, spec.tunnel)
                dispatch = TunnelDispatch(self.inflight, work_id, placement, listener_for(TUNNEL, work_id))
            else:
                work_id = new_id("run")
                message = _run_request(work_id, placement, spec)
                dispatch = RunDispatch(self.inflight, work_id, placement, listener_for(RUN, work_id))
        except ServiceError:
            placement.release()
            raise
        except Exception:
            placement.release()
            self.log.failure("could not start work on node {node}", node=placement.node_id)
            raise ServiceError("failed", "internal error", code="internal_error") from None
        self.inflight.add(dispatch)
        try:
            dispatch.send(message)
        except Exception as e:
            self.log.warn("sending {kind} {id} failed: {error}", kind=dispatch.kind, id=dispatch.id, error=e)
            dispatch.finish()
            raise ServiceError(
                "failed", f"could not send to node {dispatch.link.node_id}: {e}", code="send_failed"
            ) from None
        return work_id

    def cancel(self, work_id):
        """
        Cancel a run or tunnel. @return: whether it was in flight.
        """
        dispatch = self.inflight.get(work_id)
        if dispatch is None:
            return False
        dispatch.cancel(self.config.run_grace_sec)
        return True

    def command(self, node_id, command, adapter="", args=None):
        """
        Run a node command. @return: a Deferred firing with its JSON result.
        """
        request_id = new_id("cmd")
        message = iop_pb2.NodeCommandRequest(
            request_id=request_id, command=command, adapter=adapter, args_json=json.dumps(args or {})
        )

        def answered(response):
            if not response.ok:
                raise ServiceError("failed", response.error or f"command {command} failed", code="command_failed")
            try:
                return json.loads(response.result_json) if response.result_json else None
            except ValueError:
                raise ServiceError(
                    "failed", f"node {node_id} answered {command} with a result that is not JSON", code="protocol_error"
                ) from None

        return self._ask(node_id, message, request_id).addCallback(answered)

    def terminate_session(self, node_id, adapter, target, session_id):
        """
        End a logical session. @return: a Deferred firing with
        C{(ok, reason)}.
        """
        if not node_id:
            try:
                node_id = self.placer.direct(adapter, None, target).node_id
            except ServiceError as e:
                return defer.fail(e)
        request_id = new_id("term")
        message = iop_pb2.CancelRequest(
            kind=iop_pb2.CancelRequest.TERMINATE_SESSION,
            adapter=adapter,
            target=target,
            session_id=session_id,
            request_id=request_id,
        )
        return self._ask(node_id, message, request_id).addCallback(lambda r: (r.ok, r.reason))

    def _ask(self, node_id, message, request_id, timeout=COMMAND_TIMEOUT_SEC):
        if self.draining:
            return defer.fail(_shutting_down())
        if self.config.node(node_id) is None:
            return defer.fail(ServiceError("not_found", f"no node {node_id!r} is configured"))
        link = self.registry.ready_link(node_id)
        if link is None:
            return defer.fail(ServiceError("unavailable", f"node {node_id} is not connected"))
        d = self.inflight.expect(link, request_id)
        try:
            link.wire.send(message)
        except Exception as e:
            self.inflight.unexpect(request_id)
            return defer.fail(ServiceError("failed", f"could not send to node {node_id}: {e}"))

        def timed_out(result, timeout):
            raise ServiceError("timeout", f"node {node_id} did not answer within {timeout:g}s")

        return d.addTimeout(timeout, self.clock, onTimeoutCancel=timed_out)

    def status(self):
        """
        The snapshot: every configured node (connected or not) with its
        providers, and every model group with its queue length.
        """
        return snapshot(self.config, self.registry, self.pool, self.inflight)

    def models(self):
        """
        What callers can name as C{model}.
        """
        return model_names(self.config, self.registry)

    def reload(self, config):
        """
        Take a re-read configuration: adapter changes are pushed to the
        ready Nodes they concern as C{ConfigRefresh}; a pending Node gets
        the new configuration with its registration answer anyway.

        @return: the ids of the nodes that were pushed a refresh.
        @raise ConfigError: if the change needs a restart (nothing applied).
        """
        old = self.config
        self.config = config
        try:
            pushed = self.links.reload(old, config)
        except Exception:
            self.config = old
            raise
        self.log.info("configuration reloaded; refresh pushed to {nodes}", nodes=", ".join(pushed) or "no node")
        return pushed

    # -- draining ----------------------------------------------------------------

    def stopService(self):
        """
        Drain, then stop: stop accepting connections at once, fail queued
        waiters with C{shutting_down}, tell the Nodes, let work in flight
        finish within C{shutdown_grace_sec} (then end it with terminals),
        close the Node links and the HTTP connections once flushed.

        @return: a Deferred firing when all of that is done.
        """
        if self._drained is not None:
            return self._drained
        Service.stopService(self)
        grace = self.config.shutdown_grace_sec
        self.draining = True
        busy = len(self.inflight)
        self.log.info("draining: {busy} run(s)/tunnel(s) in flight, up to {grace:g}s to finish", busy=busy, grace=grace)
        stopping = [defer.maybeDeferred(child.stopService) for child in self._listeners if child.running]
        self.pool.fail_waiters(_shutting_down())
        self.links.say_draining(grace, "the Edge is shutting down")
        idle = self.inflight.when_idle()
        self._grace_timer = self.clock.callLater(grace, self.hurry)
        idle.addCallback(self._drain_done)
        self._drained = defer.gatherResults(stopping + [idle], consumeErrors=True)
        self._drained.addErrback(lambda f: self.log.failure("draining failed", f))
        return self._drained

    def hurry(self):
        """
        End a drain now (the grace passed, or a second stop signal): work
        in flight ends with a C{shutting_down} terminal to its caller and
        pending commands fail.
        """
        if not self.draining:
            return
        if self._grace_timer is not None and self._grace_timer.active():
            self._grace_timer.cancel()
        self._grace_timer = None
        left = self.inflight.all()
        if left:
            self.log.info("ending {count} run(s)/tunnel(s) still in flight", count=len(left))
        for dispatch in left:
            dispatch.shut_down("the Edge is shutting down")
        self.inflight.fail_requests(_shutting_down())

    def _drain_done(self, _):
        if self._grace_timer is not None and self._grace_timer.active():
            self._grace_timer.cancel()
        self._grace_timer = None
        self.links.close_all("the Edge is shutting down")
        if self.site is not None:
            return self.site.close_connections(self.clock, FLUSH_TIMEOUT_SEC)
        return None


def _run_request(run_id, placement, spec):
    message = iop_pb2.RunRequest(
        run_id=run_id,
        adapter=placement.adapter,
        target=placement.target or spec.target,
        session_id=spec.session_id,
        background=spec.background,
        options_json=json.dumps(spec.options) if spec.options else "",
    )
    for m in spec.messages:
        message.messages.add(role=m.get("role", "user"), content=m.get("content") or "")
    return message


def _tunnel_request(tunnel_id, placement, tunnel):
    message = iop_pb2.ProviderTunnelRequest(
        tunnel_id=tunnel_id,
        adapter=placement.adapter,
        method=tunnel.method,
        path=tunnel.path,
        body=tunnel.encoded_body(placement.target),
    )
    for name, value in tunnel.headers:
        message.headers.add(name=name, value=value)
    return message
