"""
The Edge service: the surface-neutral operations every caller surface
uses (SubmitRun, cancel, tunnels, sessions, node commands, status), and
the reactions to what Nodes say on the wire.

It knows nothing of HTTP. It asks the L{NodeRegistry} about connections,
the L{ProviderPool} about capacity, and publishes to the L{EventBus}; it
owns only the work in flight (L{Dispatch} objects) and pending commands.
"""

import json
import secrets
from dataclasses import dataclass, field

from twisted.internet import defer
from twisted.logger import Logger

from iop.edge import bus as lifecycle
from iop.edge.dispatch import Placement, RunDispatch, TunnelDispatch
from iop.edge.pool import NoLiveProvider, ProviderPool, QueueFull, QueueTimeout
from iop.edge.registry import NodeRegistry, Refused
from iop.edge.reload import changed_nodes
from iop.protocols import iop_pb2
from iop.protocols.convert import event_from_wire, usage_to_json
from iop.protocols.wire import Heartbeat


class ServiceError(Exception):
    """
    A caller-facing failure. C{kind} maps to an HTTP status in surfaces:
    C{invalid} 400, C{not_found} 404, C{unavailable} 503, C{busy} 429,
    C{timeout} 504, C{failed} 502; C{status}, when set, is the back end's
    own HTTP status, passed on as it is.
    """

    def __init__(self, kind, message, code=None, status=None):
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.code = code or kind
        self.status = status


@dataclass
class RunSpec:
    """
    SubmitRun's arguments. Either C{model} (a model group) or C{adapter}
    (an adapter name, on C{node} or the single ready node) says where.
    """

    messages: list
    adapter: str = ""
    target: str = ""
    node: str | None = None
    model: str | None = None
    session_id: str = ""
    background: bool = False
    options: dict = field(default_factory=dict)

    def input_chars(self):
        return sum(len(m.get("content") or "") for m in self.messages)


def new_id(prefix):
    return f"{prefix}-{secrets.token_hex(12)}"


class EdgeService:
    log = Logger()

    def __init__(self, config, clock, bus, pool=None, registry=None):
        self.config = config
        self.clock = clock
        self.bus = bus
        self.registry = registry or NodeRegistry(config.nodes, clock)
        self.pool = pool or ProviderPool(clock, config.providers(), config.model_groups)
        self.inflight = {}
        self._requests = {}

    # -- Node connections (called by iop.edge.connection) ---------------------

    def register(self, token, wire):
        """
        Handle a C{RegisterRequest}.

        @return: C{(link, response)}; C{link} is C{None} when refused.
        """
        try:
            link = self.registry.register(token, wire)
        except Refused as refusal:
            node = self.registry.find_node(token)
            self.bus.node_event(node.id if node else None, lifecycle.REJECTED, reason=refusal.reason)
            self.log.warn("registration refused: {reason}", reason=refusal.reason)
            return None, iop_pb2.RegisterResponse(accepted=False, code=refusal.code, reason=refusal.reason)
        try:
            payload = self.config_payload(link.node_id)
        except Exception as e:
            self.registry.lost(link)
            reason = f"could not build the configuration of node {link.node_id}: {e}"
            self.bus.node_event(link.node_id, lifecycle.REJECTED, reason=reason)
            return None, iop_pb2.RegisterResponse(accepted=False, code=iop_pb2.CONFIG_BUILD_FAILED, reason=reason)
        self.bus.node_event(link.node_id, lifecycle.REGISTERED, generation=link.generation)
        self.log.info("node {node} registered (generation {generation})", node=link.node_id, generation=link.generation)
        return link, iop_pb2.RegisterResponse(accepted=True, config=payload)

    def config_payload(self, node_id):
        node = self.config.node(node_id)
        payload = iop_pb2.NodeConfigPayload(
            node_id=node.id,
            heartbeat_interval_sec=self.config.heartbeat_interval,
            heartbeat_timeout_sec=self.config.heartbeat_timeout,
        )
        for adapter in node.adapters:
            payload.adapters.add(
                name=adapter.name,
                type=adapter.type,
                max_concurrency=adapter.max_concurrency,
                options_json=json.dumps(adapter.options, sort_keys=True),
            )
        return payload

    def reload(self, config):
        """
        Take a re-read configuration: adapter changes are pushed to the
        ready Nodes they concern as C{ConfigRefresh}; a pending Node gets
        the new configuration with its registration answer anyway.

        @return: the ids of the nodes that were pushed a refresh.
        @raise ConfigError: if the change needs a restart (nothing applied).
        """
        changed = changed_nodes(self.config, config)
        self.config = config
        self.registry.nodes = list(config.nodes)
        pushed = []
        for node_id in changed:
            link = self.registry.ready_link(node_id)
            if link is None:
                continue
            try:
                link.wire.send(iop_pb2.ConfigRefresh(config=self.config_payload(node_id)))
            except Exception as e:
                self.log.warn("config refresh for {node} not sent: {error}", node=node_id, error=e)
                continue
            pushed.append(node_id)
        self.log.info("configuration reloaded; refresh pushed to {nodes}", nodes=", ".join(pushed) or "no node")
        return pushed

    def ready(self, link, node_id):
        """
        Handle a C{NodeReadyRequest}.

        @return: C{(response, first)}; only the current owner's first ready
            is C{first}, and the caller must L{activate} it once the
            response is on the wire (the Node accepts work only after it).
        """
        try:
            first = self.registry.mark_ready(link, node_id)
        except Refused as refusal:
            self.bus.node_event(node_id, lifecycle.REJECTED, reason=refusal.reason)
            return iop_pb2.NodeReadyResponse(ready=False, reason=refusal.reason), False
        return iop_pb2.NodeReadyResponse(ready=True), first

    def activate(self, link):
        """
        The node is dispatch-ready: its providers go live and waiting
        requests are served at once.
        """
        self.log.info("node {node} ready (generation {generation})", node=link.node_id, generation=link.generation)
        self.bus.node_event(link.node_id, lifecycle.READY, generation=link.generation)
        self.pool.nodeReady(link.node_id, link.generation)

    def lost(self, link, reason):
        """
        A registered connection closed. Only the current ready owner's loss
        takes the node out of service.
        """
        if not self.registry.lost(link):
            return
        self.log.info("node {node} disconnected: {reason}", node=link.node_id, reason=reason)
        self.pool.nodeDisconnected(link.node_id, link.generation)
        for dispatch in [d for d in self.inflight.values() if d.link is link]:
            dispatch.fail("node_disconnected", f"node {link.node_id} disconnected: {reason}")
        for request_id, (request_link, d) in list(self._requests.items()):
            if request_link is link:
                del self._requests[request_id]
                d.errback(ServiceError("unavailable", f"node {link.node_id} disconnected"))
        self.bus.node_event(link.node_id, lifecycle.DISCONNECTED, generation=link.generation, reason=reason)

    def run_event(self, link, message):
        dispatch = self._dispatch_on(link, message.run_id, RunDispatch)
        if dispatch is not None:
            dispatch.deliver(event_from_wire(message))

    def tunnel_frame(self, link, message):
        dispatch = self._dispatch_on(link, message.tunnel_id, TunnelDispatch)
        if dispatch is not None:
            dispatch.frame(message)

    def _dispatch_on(self, link, dispatch_id, kind):
        dispatch = self.inflight.get(dispatch_id)
        if dispatch is None or dispatch.link is not link or not isinstance(dispatch, kind):
            # Late events after a local end (cancel grace, disconnect) are normal.
            return None
        return dispatch

    def request_answered(self, link, request_id, result):
        """
        A C{NodeCommandResponse} or C{CancelResponse} arrived.
        """
        pending = self._requests.get(request_id)
        if pending is None or pending[0] is not link:
            return
        del self._requests[request_id]
        pending[1].callback(result)

    # -- the in-flight tracker used by dispatches --------------------------------

    def forget(self, dispatch):
        self.inflight.pop(dispatch.id, None)

    def publish_run_event(self, dispatch, event):
        payload = {"run_id": dispatch.id, "node": dispatch.link.node_id, "type": event.type}
        if event.usage is not None:
            payload["usage"] = usage_to_json(event.usage)
        if event.error is not None:
            payload["error"] = {"code": event.error.code, "message": event.error.message}
        self.bus.publish("run", payload)

    def publish_tunnel_usage(self, dispatch, usage):
        self.bus.publish("run", {"run_id": dispatch.id, "node": dispatch.link.node_id, "type": "usage", "usage": usage})

    # -- caller operations ----------------------------------------------------------

    def place(self, model=None, adapter="", node=None, target="", input_chars=0):
        """
        Find where work goes: a model group's provider (taking a lease,
        maybe after waiting in its queue), an explicit node, or the single
        ready node.

        @return: a cancellable Deferred firing with a L{Placement}.
        """
        if model is not None and self.pool.group(model) is not None:
            klass = self.pool.classify(model, input_chars)
            d = self.pool.acquire(model, klass)
            d.addCallback(self._placement_from_lease)
            d.addErrback(self._pool_failure)
            return d
        try:
            return defer.succeed(self._direct_placement(adapter or model or "", node, target))
        except ServiceError as e:
            return defer.fail(e)

    def _placement_from_lease(self, lease):
        link = self.registry.ready_link(lease.node_id)
        if link is None or link.generation != lease.generation:
            lease.release()
            raise ServiceError("unavailable", f"node {lease.node_id} is no longer connected")
        return Placement(link, lease.adapter, lease.adapter_type, lease.target, lease=lease)

    def _pool_failure(self, failure):
        if failure.check(NoLiveProvider):
            raise ServiceError("unavailable", str(failure.value), code="unavailable")
        if failure.check(QueueTimeout):
            raise ServiceError("busy", str(failure.value), code="queue_timeout")
        if failure.check(QueueFull):
            raise ServiceError("busy", str(failure.value), code="queue_full")
        return failure

    def _direct_placement(self, adapter, node_id, target):
        if not adapter:
            raise ServiceError("invalid", "say which adapter (or model group) should run this")
        if node_id:
            if self.config.node(node_id) is None:
                raise ServiceError("not_found", f"no node {node_id!r} is configured")
            link = self.registry.ready_link(node_id)
            if link is None:
                raise ServiceError("unavailable", f"node {node_id} is not connected")
        else:
            links = self.registry.ready_links()
            if len(links) != 1:
                raise ServiceError(
                    "unavailable" if not links else "invalid",
                    f"{adapter!r} names no model group, and {len(links)} nodes are ready: name a node",
                )
            link = links[0]
        spec = self.config.node(link.node_id).adapter(adapter)
        if spec is None:
            raise ServiceError("not_found", f"node {link.node_id} has no adapter or model group {adapter!r}")
        return Placement(link, spec.name, spec.type, target)

    def submit_run(self, spec, listener):
        """
        SubmitRun: place the run, then start it.

        @return: a cancellable Deferred firing with the L{RunDispatch}.
        """
        d = self.place(spec.model, spec.adapter, spec.node, spec.target, spec.input_chars())
        d.addCallback(self.start_run, spec, listener)
        return d

    def start_run(self, placement, spec, listener):
        """
        Send a C{RunRequest} for work that has its place. The placement's
        lease now belongs to the run.
        """
        run = RunDispatch(self, new_id("run"), placement, listener)
        message = iop_pb2.RunRequest(
            run_id=run.id,
            adapter=placement.adapter,
            target=placement.target or spec.target,
            session_id=spec.session_id,
            background=spec.background,
            options_json=json.dumps(spec.options) if spec.options else "",
        )
        for m in spec.messages:
            message.messages.add(role=m.get("role", "user"), content=m.get("content") or "")
        self._start(run, message)
        return run

    def start_tunnel(self, placement, method, path, headers, body, listener):
        """
        Send a C{ProviderTunnelRequest}; the provider's bytes come back to
        C{listener}.
        """
        tunnel = TunnelDispatch(self, new_id("tun"), placement, listener)
        message = iop_pb2.ProviderTunnelRequest(
            tunnel_id=tunnel.id, adapter=placement.adapter, method=method, path=path, body=body
        )
        for name, value in headers:
            message.headers.add(name=name, value=value)
        self._start(tunnel, message)
        return tunnel

    def _start(self, dispatch, message):
        self.inflight[dispatch.id] = dispatch
        try:
            dispatch.send(message)
        except Exception as e:
            self.log.warn("sending {kind} {id} failed: {error}", kind=dispatch.kind, id=dispatch.id, error=e)
            dispatch.finish()
            raise ServiceError("failed", f"could not send to node {dispatch.link.node_id}: {e}", code="send_failed")

    def cancel(self, dispatch_id):
        """
        Cancel a run or tunnel. @return: whether it was in flight.
        """
        dispatch = self.inflight.get(dispatch_id)
        if dispatch is None:
            return False
        dispatch.cancel(self.config.run_grace_sec)
        return True

    def _ask(self, node_id, message, request_id, timeout=30.0):
        if self.config.node(node_id) is None:
            return defer.fail(ServiceError("not_found", f"no node {node_id!r} is configured"))
        link = self.registry.ready_link(node_id)
        if link is None:
            return defer.fail(ServiceError("unavailable", f"node {node_id} is not connected"))

        def cancel(d):
            self._requests.pop(request_id, None)

        d = defer.Deferred(cancel)
        self._requests[request_id] = (link, d)
        try:
            link.wire.send(message)
        except Exception as e:
            del self._requests[request_id]
            return defer.fail(ServiceError("failed", f"could not send to node {node_id}: {e}"))
        d.addTimeout(timeout, self.clock, onTimeoutCancel=lambda *_: _timed_out(node_id, timeout))
        return d

    def command(self, node_id, command, adapter="", args=None):
        """
        Run a node command. @return: a Deferred firing with its JSON result.
        """
        request_id = new_id("cmd")
        message = iop_pb2.NodeCommandRequest(
            request_id=request_id, command=command, adapter=adapter, args_json=json.dumps(args or {})
        )
        d = self._ask(node_id, message, request_id)

        def answered(response):
            if not response.ok:
                raise ServiceError("failed", response.error or f"command {command} failed", code="command_failed")
            return json.loads(response.result_json) if response.result_json else None

        return d.addCallback(answered)

    def terminate_session(self, node_id, adapter, target, session_id):
        """
        End a logical session. @return: a Deferred firing with
        C{(ok, reason)}.
        """
        if not node_id:
            placement = self._direct_placement(adapter, None, target)
            node_id = placement.node_id
        request_id = new_id("term")
        message = iop_pb2.CancelRequest(
            kind=iop_pb2.CancelRequest.TERMINATE_SESSION,
            adapter=adapter,
            target=target,
            session_id=session_id,
            request_id=request_id,
        )
        return self._ask(node_id, message, request_id).addCallback(lambda r: (r.ok, r.reason))

    def status(self):
        """
        The snapshot: every configured node (connected or not) with its
        providers, and every model group with its queue length.
        """
        pool = self.pool.snapshot()
        nodes = []
        for node in self.config.nodes:
            link = self.registry.ready_link(node.id)
            entry = {
                "id": node.id,
                "connected": link is not None,
                "adapters": [{"name": a.name, "type": a.type, "max_concurrency": a.max_concurrency} for a in node.adapters],
                "providers": [dict(p) for p in pool["providers"] if p["node"] == node.id],
                "in_flight": sum(1 for d in self.inflight.values() if d.link.node_id == node.id),
            }
            if link is not None:
                entry["connected_since"] = link.since
            elif node.id in self.registry.last_seen:
                entry["last_seen"] = self.registry.last_seen[node.id]
            nodes.append(entry)
        return {"nodes": nodes, "model_groups": pool["model_groups"]}

    def heartbeat(self):
        return Heartbeat(self.config.heartbeat_interval, self.config.heartbeat_timeout)

    def models(self):
        """
        What callers can name as C{model}: model groups, then the adapters
        of ready nodes.
        """
        names = [group.name for group in self.config.model_groups]
        for link in self.registry.ready_links():
            for adapter in self.config.node(link.node_id).adapters:
                if adapter.name not in names:
                    names.append(adapter.name)
        return names


def _timed_out(node_id, timeout):
    raise ServiceError("timeout", f"node {node_id} did not answer within {timeout:g}s")
