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
from twisted.internet.defer import CancelledError
from twisted.logger import Logger

from iop.edge.admission import Admission
from iop.edge.bus import EventBus
from iop.edge.dispatch import RunDispatch, TunnelDispatch
from iop.edge.errors import ServiceError
from iop.edge.failover import Work
from iop.edge.inflight import Inflight
from iop.edge.links import NodeLinks
from iop.edge.placement import Placer
from iop.edge.pool import ProviderPool
from iop.edge.registry import NodeRegistry
from iop.edge.spec import new_id
from iop.edge.status import model_names, snapshot
from iop.protocols import iop_pb2
from iop.protocols.wire import FrameTooLarge
from iop.run import (
    CANCELLED,
    CAPACITY_EXCEEDED,
    FAILED,
    INVALID_ARGS,
    NOT_SUPPORTED,
    SHUTTING_DOWN,
    UNKNOWN_ADAPTER,
    UNKNOWN_COMMAND,
)

#: Run kinds a surface's C{listener_for} is asked for.
RUN = "run"
TUNNEL = "tunnel"

#: How long a drained Edge waits for its HTTP connections to flush their
#: last bytes before it aborts them.
FLUSH_TIMEOUT_SEC = 5.0

#: What a failed node command's code says about whose mistake it was.
_COMMAND_FAILURE_KINDS = {
    UNKNOWN_COMMAND: "invalid",
    NOT_SUPPORTED: "invalid",
    INVALID_ARGS: "invalid",
    UNKNOWN_ADAPTER: "not_found",
    CANCELLED: "unavailable",
}


def _shutting_down():
    return ServiceError("unavailable", "the Edge is shutting down", code=SHUTTING_DOWN)


class EdgeService(MultiService):
    """
    @param config: a validated L{iop.edge.config.EdgeConfig}.
    @param reactor: the reactor (listeners, timers); a C{task.Clock} or
        C{MemoryReactorClock} in tests, where the tree is never started.
    @param listen: build the listening children (C{False} for a bare
        service in unit tests).
    @param etcd: with C{cluster} configured, the
        L{iop.edge.cluster.etcd.IEtcd} to use (an in-memory one in tests;
        by default a client of C{cluster.etcd}).

    @ivar draining: C{True} once a stop began: new work is refused.
    @ivar site: the HTTP L{iop.edge.http.site.EdgeSite} (with C{listen}).
    @ivar node_port: the L{iop.edge.nodeport.NodePortFactory} (with C{listen}).
    """

    log = Logger()

    def __init__(self, config, reactor, bus=None, listen=True, etcd=None):
        super().__init__()
        self.config = config
        self.clock = reactor
        self.bus = bus if bus is not None else EventBus(reactor)
        self.registry = NodeRegistry(config.nodes, reactor)
        self.pool = ProviderPool(
            reactor, config.providers(), config.model_groups, config.direct_queue_timeout_sec, config.health
        )
        self.inflight = Inflight(reactor, self.bus)
        self.links = NodeLinks(lambda: self.config, self.registry, self.pool, self.inflight, self.bus)
        self.placer = Placer(lambda: self.config, self.registry, self.pool)
        self.admission = Admission(reactor, self._place)
        self.draining = False
        self.site = None
        self.node_port = None
        self._listeners = ()
        self._grace_timer = None
        self._drained = None
        self._placing_again = {}
        #: In an Edge cluster (C{cluster:}), this Edge's membership.
        self.cluster = None
        #: In an Edge cluster, what the surfaces proxy forwarded requests
        #: with (L{iop.edge.cluster.forward.Forwarder}).
        self.forwarder = None
        if config.cluster is not None:
            from iop.edge.cluster.membership import join_cluster

            self.cluster = join_cluster(self, reactor, etcd)
        if listen:
            from iop.edge.listeners import add_listeners

            self._listeners = [child for child in add_listeners(self, reactor) if child is not None]

    # -- the caller API ----------------------------------------------------------

    def submit(self, spec, listener_for, may_forward=True):
        """
        SubmitRun: place the work, then start it as a run or a tunnel.

        @param spec: a L{iop.edge.spec.RunSpec}.
        @param listener_for: C{listener_for(kind, work_id)} returns the
            listener for the chosen kind: an L{IRunListener} for L{RUN}, an
            L{ITunnelListener} for L{TUNNEL} (only asked when
            C{spec.tunnel} is set and the provider takes raw HTTP).
        @return: a cancellable Deferred firing with the work's id once it
            started; cancelling it while it waits leaves the queue. In an
            Edge cluster it fails with L{iop.edge.cluster.load.Forward}
            when another Edge should serve it (unless C{may_forward} is
            false: the request was forwarded here already).
        """
        if self.draining:
            return defer.fail(_shutting_down())
        if self.cluster is not None and may_forward:
            from iop.edge.cluster.load import forward_target

            forward = forward_target(self.cluster, self.registry, self.pool, spec)
            if forward is not None:
                return defer.fail(forward)
        if len(self.admission) + self.pool.waiting() >= self.config.limits.max_waiting:
            return defer.fail(
                ServiceError("unavailable", "the Edge is overloaded: too much work is waiting", code="overloaded")
            )
        work = Work(spec, listener_for, retries=self.placer.retries(spec))
        return self.admission.submit(work)

    def _place(self, work):
        if self.draining:
            return defer.fail(_shutting_down())
        d = self.placer.place(work.spec, avoid=work.avoid)
        d.addCallback(self._start, work)
        return d

    def _start(self, placement, work):
        """
        Start placed work in one guarded step: whatever fails before the
        work is in flight returns the placement's lease.
        """
        spec = work.spec
        work.attempts += 1
        try:
            if self.draining:
                raise _shutting_down()
            tunnel = spec.tunnels_on(placement.adapter_type)
            if work.id is None:
                work.id = new_id("tun" if tunnel else "run")
            wire_id = work.wire_id()
            if tunnel:
                message = _tunnel_request(wire_id, placement, spec.tunnel)
                listener = work.listener_for(TUNNEL, work.id)
                dispatch = TunnelDispatch(self.inflight, wire_id, placement, listener, work.id)
            else:
                message = _run_request(wire_id, placement, spec)
                listener = work.listener_for(RUN, work.id)
                dispatch = RunDispatch(self.inflight, wire_id, placement, listener, work.id)
            dispatch.on_early_failure = lambda failed, failure: self._failed_early(failed, failure, work)
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
        except FrameTooLarge as e:
            # The request itself is too big for the wire: the caller's
            # mistake, said before anything reached the Node.
            dispatch.finish()
            raise ServiceError(
                "too_large", f"the request is too large to send to a node: {e}", code="request_too_large"
            ) from None
        except Exception as e:
            self.log.warn("sending {kind} {id} failed: {error}", kind=dispatch.kind, id=dispatch.id, error=e)
            dispatch.finish()
            raise ServiceError(
                "failed", f"could not send to node {dispatch.link.node_id}: {e}", code="send_failed"
            ) from None
        return work.id

    def _failed_early(self, failed, failure, work):
        """
        An attempt failed before its caller saw a byte. If the failure
        qualifies and the work has retries left, @return: what places it
        again (on another provider for a provider failure; anywhere for a
        Node that refused admitted work); else C{None}.
        """
        if self.draining:
            return None
        if failure.code != CAPACITY_EXCEEDED and not self.placer.elsewhere(
            work.spec, work.avoid | {failed.placement.key}
        ):
            # No other provider could take it: the caller gets the
            # provider's own answer, unchanged.
            return None
        if not work.may_retry(failure):
            return None
        if failure.code == CAPACITY_EXCEEDED:
            self.log.warn(
                "node {node} refused {id} with capacity_exceeded although the Edge admitted it;"
                " placing it again (check the node's max_concurrency against its providers' capacity)",
                node=failed.link.node_id,
                id=work.id,
            )
        else:
            work.avoid.add(failed.placement.key)
            self.log.info(
                "{id}: provider {node}/{provider} failed before answering ({code}); placing it elsewhere",
                id=work.id,
                node=failed.link.node_id,
                provider=failed.placement.provider_id,
                code=failure.code,
            )
            self.bus.publish(
                "provider", {"event": "retry", "node": failed.link.node_id, "provider": failed.placement.provider_id}
            )
        return lambda: self._place_again(failed, failure, work)

    def _place_again(self, failed, failure, work):
        d = self._place(work)
        self._placing_again[work.id] = d

        def not_placed(outcome):
            # Nowhere else to go (or the caller left): the caller gets the
            # provider's own failure.
            if not outcome.check(CancelledError):
                if not outcome.check(ServiceError):
                    self.log.failure("placing {id} again failed", outcome, id=work.id)
                failed.tell_failure(failure)

        d.addErrback(not_placed)
        d.addBoth(lambda _: self._placing_again.pop(work.id, None))

    def cancel(self, work_id):
        """
        Cancel a run or tunnel. @return: whether it was in flight.
        """
        again = self._placing_again.get(work_id)
        if again is not None:
            again.cancel()
            return True
        dispatch = self.inflight.for_caller(work_id)
        if dispatch is None:
            return False
        dispatch.cancel(self.config.run_grace_sec)
        return True

    def command(self, node_id, command, adapter="", args=None, progress=None):
        """
        Run a node command, waiting at most its timeout (C{commands} in
        edge.yaml); when the Edge gives up, or the Deferred is cancelled
        (the caller left), the Node is told to abort it.

        @param progress: when given, the Node is asked for progress and
            C{progress(dict)} is called with each update (a model pull's
            status, completed, total).
        @return: a Deferred firing with the command's JSON result.
        """
        request_id = new_id("cmd")
        message = iop_pb2.NodeCommandRequest(
            request_id=request_id,
            command=command,
            adapter=adapter,
            args_json=json.dumps(args or {}),
            stream=progress is not None,
        )
        on_progress = None if progress is None else (lambda update: progress(json.loads(update.result_json)))
        abort = iop_pb2.CancelRequest(kind=iop_pb2.CancelRequest.CANCEL_COMMAND, request_id=request_id)

        def answered(response):
            if not response.ok:
                kind = _COMMAND_FAILURE_KINDS.get(response.code, "failed")
                raise ServiceError(
                    kind, response.error or f"command {command} failed", code=response.code or "command_failed"
                )
            try:
                return json.loads(response.result_json) if response.result_json else None
            except ValueError:
                raise ServiceError(
                    "failed", f"node {node_id} answered {command} with a result that is not JSON", code="protocol_error"
                ) from None

        d = self._ask(node_id, message, request_id, self.config.command_timeout(command), on_progress, abort)
        return d.addCallback(answered)

    def terminate_session(self, node_id, adapter, target, session_id):
        """
        End a logical session. @return: a Deferred firing with
        C{(ok, reason, code)}; C{code} says why not (C{unknown_session},
        C{not_supported}, C{unknown_adapter}, C{failed}).
        """
        if not node_id:
            try:
                node_id = self.placer.single_node(adapter)
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
        d = self._ask(node_id, message, request_id, self.config.command_timeout(None))
        return d.addCallback(lambda r: (r.ok, r.reason, "" if r.ok else r.code or FAILED))

    def _ask(self, node_id, message, request_id, timeout, on_progress=None, abort=None):
        if self.draining:
            return defer.fail(_shutting_down())
        if self.config.node(node_id) is None:
            return defer.fail(ServiceError("not_found", f"no node {node_id!r} is configured"))
        link = self.registry.ready_link(node_id)
        if link is None:
            return defer.fail(ServiceError("unavailable", f"node {node_id} is not connected"))

        def tell_node():
            try:
                link.wire.send(abort)
            except Exception as e:
                self.log.info("abort of {id} not sent: {error}", id=request_id, error=e)

        d = self.inflight.expect(link, request_id, on_progress, tell_node if abort is not None else None)
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
        state = snapshot(self.config, self.registry, self.pool, self.inflight)
        if self.cluster is not None:
            self.cluster.annotate(state)
        return state

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
        if self.cluster is not None:
            self.cluster.start_draining()
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
        if self.cluster is not None:
            # Give the nodes back first, so they register elsewhere as soon
            # as their links close (without a refused attempt).
            return self.cluster.leave().addCallback(self._close_links)
        return self._close_links(None)

    def _close_links(self, _):
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
        message.messages.add(
            role=m.get("role", "user"),
            content=m.get("content") or "",
            name=m.get("name", ""),
            tool_call_id=m.get("tool_call_id", ""),
            tool_calls_json=json.dumps(m["tool_calls"]) if m.get("tool_calls") else "",
            images=m.get("images", ()),
        )
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
