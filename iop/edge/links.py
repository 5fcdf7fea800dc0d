"""
The Edge's side of its Node links: everything a Node says on the wire, and
everything the Edge says to Nodes that is not a caller's work.

  - registration (token, wire version, configuration payload), readiness
    and activation, loss, and a Node's notice that it is draining;
  - results of work: run events and tunnel frames go to the in-flight
    table, command and cancel answers to whoever asked;
  - configuration refresh pushes after a reload, and the Edge's own
    draining notice.

It mirrors the Node's session: L{iop.edge.connection.EdgeNodeConnection}
enforces which message each connection state may send and calls here. The
registry owns connections and generations, the pool owns capacity, the
in-flight table owns work; this module only tells each what happened.
"""

import json

from twisted.logger import Logger
from twisted.python.failure import Failure

from iop.edge import bus as lifecycle
from iop.edge.dispatch import Placement, RunDispatch, TunnelDispatch, Unheard
from iop.edge.errors import ServiceError
from iop.edge.pool import NORMAL
from iop.edge.registry import RegistrationRefused
from iop.edge.reload import changed_nodes
from iop.edge.runs import RUN, RUNNING
from iop.edge.spec import new_id
from iop.protocols import messages
from iop.protocols.convert import event_from_wire
from iop.protocols.wire import DRAINING_WIRE_VERSION, OLDEST_WIRE_VERSION, WIRE_VERSION
from iop.run import NODE_DISCONNECTED, NODE_RESTARTED

#: How long a Node may take to acknowledge a config refresh.
REFRESH_TIMEOUT_SEC = 30.0


class NodeLinks:
    """
    @param config: a callable returning the running
        L{iop.edge.config.EdgeConfig} (it changes on reload).
    """

    log = Logger()

    def __init__(self, config, registry, pool, inflight, bus):
        self._config = config
        self.registry = registry
        self.pool = pool
        self.inflight = inflight
        self.bus = bus
        #: In an Edge cluster, the L{iop.edge.cluster.membership.Membership}:
        #: a registration must also win the node's etcd claim.
        self.cluster = None

    # -- registration and readiness

    def register(self, token, wire_version, wire):
        """
        Handle a C{RegisterRequest}.

        @return: C{(link, response)}; C{link} is C{None} when refused. In
            an Edge cluster C{response} is a Deferred: the node's etcd
            claim comes first (L{_claimed}).
        """
        if not OLDEST_WIRE_VERSION <= wire_version <= WIRE_VERSION:
            reason = (
                f"wire version {wire_version} is not served here"
                f" (this Edge serves {OLDEST_WIRE_VERSION} to {WIRE_VERSION}): upgrade the older side"
            )
            return self._refused(self.registry.find_node(token), messages.INCOMPATIBLE_VERSION, reason)
        try:
            link = self.registry.register(token, wire)
        except RegistrationRefused as refusal:
            return self._refused(self.registry.find_node(token), refusal.code, refusal.reason)
        link.wire_version = wire_version
        if self.cluster is not None:
            d = self.cluster.claim(link.node_id)
            d.addCallbacks(self._claimed, self._not_claimed, callbackArgs=(link,), errbackArgs=(link,))
            return link, d
        return link, self._accepted(link)

    def _claimed(self, revision, link):
        """
        The node's etcd claim is this Edge's: the link's generation is its
        revision. A link lost meanwhile gives the claim back at once.
        """
        if not link.open:
            self.cluster.release(link.node_id, revision)
            return None
        self.registry.fence(link, revision)
        return self._accepted(link)

    def _not_claimed(self, failure, link):
        from iop.edge.cluster.membership import NotOwner

        failure.trap(NotOwner)
        self.registry.abandon(link)
        # Retryable either way: the node's owner elsewhere goes away, or
        # this Edge gets its etcd session back.
        node = self._config().node(link.node_id)
        return self._refused(node, messages.DUPLICATE_CONNECTION, failure.value.reason)[1]

    def _accepted(self, link):
        wire_version = link.wire_version
        # Cannot fail: edge.yaml was validated at load (adapter options are
        # JSON), so CONFIG_BUILD_FAILED is never sent by this Edge.
        payload = self.config_payload(link.node_id)
        link.adapters = _adapters(payload)
        self.bus.node_event(link.node_id, lifecycle.REGISTERED, generation=link.generation)
        self.log.info(
            "node {node} registered (generation {generation}, wire version {version})",
            node=link.node_id,
            generation=link.generation,
            version=wire_version,
        )
        return messages.register_accepted(payload, WIRE_VERSION)

    def refuse_credentials(self, token, reason):
        """
        Refuse a registration whose credentials do not hold together (a
        client certificate that does not name the token's node): fatal for
        the Node, like an unknown token.

        @return: C{(None, response)}.
        """
        return self._refused(self.registry.find_node(token), messages.UNKNOWN_TOKEN, reason)

    def _refused(self, node, code, reason):
        self.bus.node_event(node.id if node else None, lifecycle.REJECTED, reason=reason)
        self.log.warn("registration refused: {reason}", reason=reason)
        return None, messages.register_refused(code, reason, WIRE_VERSION)

    def config_payload(self, node_id):
        config = self._config()
        node = config.node(node_id)
        adapters = [
            messages.adapter_config(
                adapter.name, adapter.type, adapter.max_concurrency, json.dumps(adapter.options, sort_keys=True)
            )
            for adapter in node.adapters
        ]
        return messages.node_config(node.id, adapters, config.heartbeat_interval, config.heartbeat_timeout)

    def ready(self, link, node_id):
        """
        Handle a C{NodeReadyRequest}.

        @return: C{(response, first)}; only the current owner's first ready
            is C{first}, and the caller must L{activate} it once the
            response is on the wire (the Node accepts work only after it).
        """
        try:
            first = self.registry.mark_ready(link, node_id)
            if self.cluster is not None and not self.cluster.holds(link.node_id, link.generation):
                link.ready = False
                raise RegistrationRefused(
                    messages.REJECT_NONE, f"this Edge no longer owns node {link.node_id} in the cluster"
                )
        except RegistrationRefused as refusal:
            self.bus.node_event(node_id, lifecycle.REJECTED, reason=refusal.reason)
            return messages.ready_response(False, refusal.reason), False
        return messages.ready_response(True), first

    def reconciled(self, link, message):
        """
        Handle a C{RunReconcile} (wire version 4, before the Node's ready):
        the background runs it kept from a lost link, taken back when the
        node is activated.
        """
        link.reconcile = list(message.runs)

    def activate(self, link):
        """
        The node is dispatch-ready: its providers go live and waiting
        requests are served at once — after the background runs it kept
        from a lost link have their leases back (L{_take_back}).
        """
        self.log.info("node {node} ready (generation {generation})", node=link.node_id, generation=link.generation)
        self.bus.node_event(link.node_id, lifecycle.READY, generation=link.generation)
        plan = self._reconcile_plan(link)
        leases = self.pool.node_ready(link.node_id, link.generation, [adopt for _, _, adopt in plan])
        for (run, dispatch, _), lease in zip(plan, leases, strict=True):
            self._take_back(link, run, dispatch, lease)
        for wire_id in self.inflight.detached_on(link.node_id):
            # The node came back without it (it restarted): it is over.
            dispatch = self.inflight.take_detached(link.node_id, wire_id)
            dispatch.fail(NODE_RESTARTED, f"node {link.node_id} came back without run {dispatch.caller_id}")

    # -- background runs across a lost link (wire version 4)

    def _reconcile_plan(self, link):
        """
        What becomes of each run the Node reported: C{(run, dispatch,
        adopt)} — the Edge's waiting dispatch (or C{None}), and the lease
        to take for it (C{(provider_id, klass, group, target)}, or C{None}
        when it needs none: it ended, or the Edge does not want it back).
        """
        plan = []
        for run in link.reconcile or ():
            dispatch = self.inflight.take_detached(link.node_id, run.run_id)
            adopt = None
            if run.status == RUNNING:
                if dispatch is not None:
                    placement, lease = dispatch.placement, dispatch.placement.lease
                    klass, group = (lease.klass, lease.group) if lease is not None else (NORMAL, None)
                    adopt = (placement.provider_id, klass, group, placement.target)
                elif self.inflight.runs.get(run.run_id) is None:
                    provider_id = self.pool.resource_of(link.node_id, run.adapter)
                    if provider_id is not None:
                        adopt = (provider_id, NORMAL, f"{link.node_id}/{run.adapter}", run.target)
            plan.append((run, dispatch, adopt))
        link.reconcile = None
        return plan

    def _take_back(self, link, run, dispatch, lease):
        """
        Re-attach one reported run: a run the Edge was waiting for goes on
        where it was; one the Edge never heard of (it restarted since) is
        taken on record; one the Edge ended meanwhile (a cancel, or it
        gave up waiting) is cancelled on the Node. The Node is asked for
        the events after the Edge's last one (C{RunResume}).
        """
        if dispatch is None:
            record = self.inflight.runs.get(run.run_id)
            if record is not None:
                link.send_quietly(messages.cancel_run(run.run_id))
                return
            dispatch = self._adopted(link, run)
        adapter_type = self._adapter_type(link.node_id, run.adapter)
        placement = Placement(link, run.adapter, adapter_type, run.target, lease)
        dispatch.reattach(placement)
        self.inflight.add(dispatch)
        after = dispatch.record.last_seq if dispatch.record is not None else 0
        self.log.info(
            "background run {run_id} taken back from node {node} ({status}; resuming after event {seq})",
            run_id=dispatch.caller_id,
            node=link.node_id,
            status=run.status,
            seq=after,
        )
        link.send_quietly(messages.run_resume(run.run_id, after))

    def _adopted(self, link, run):
        """
        A run the Edge never heard of: on record from now on.
        """
        record = self.inflight.runs.open(
            run.run_id,
            RUN,
            node=link.node_id,
            adapter=run.adapter,
            target=run.target,
            provider=self.pool.resource_of(link.node_id, run.adapter),
            background=True,
            caller=run.caller or None,
        )
        self.inflight.runs.started(record)
        placement = Placement(link, run.adapter, self._adapter_type(link.node_id, run.adapter), run.target)
        return RunDispatch(self.inflight, run.run_id, placement, Unheard(), run.run_id, record)

    def _adapter_type(self, node_id, adapter):
        node = self._config().node(node_id)
        spec = node.adapter(adapter) if node is not None else None
        return spec.type if spec is not None else ""

    def _not_back(self, dispatch):
        dispatch.fail(
            NODE_DISCONNECTED,
            f"node {dispatch.link.node_id} did not come back within {self._config().reattach_timeout_sec:g}s",
        )

    def node_draining(self, link, message):
        """
        The Node is shutting down: its providers take no new leases; its
        work in flight goes on until it ends or the Node's grace passes.
        """
        if self.registry.ready_link(link.node_id) is not link or link.draining:
            return
        link.draining = True
        self.log.info(
            "node {node} is draining ({grace:g}s grace): {reason}",
            node=link.node_id,
            grace=message.grace_sec,
            reason=message.reason or "no reason given",
        )
        self.bus.node_event(link.node_id, lifecycle.DRAINING, generation=link.generation)
        self.pool.node_draining(link.node_id, link.generation)

    def lost(self, link, reason):
        """
        A registered connection closed. Only the current ready owner's loss
        takes the node out of service.
        """
        was_ready = self.registry.lost(link)
        if self.cluster is not None:
            self.cluster.release(link.node_id, link.generation)
        if not was_ready:
            return
        self.log.info("node {node} disconnected: {reason}", node=link.node_id, reason=reason)
        self.pool.node_disconnected(link.node_id, link.generation)
        waiting = 0
        for dispatch in self.inflight.on_link(link):
            if dispatch.outlives_link:
                # The Node keeps it running and reports it when it is back.
                self.inflight.detach(dispatch, self._config().reattach_timeout_sec, self._not_back)
                waiting += 1
            else:
                dispatch.node_lost(f"node {link.node_id} disconnected: {reason}")
        if waiting:
            self.log.info(
                "{count} background run(s) on node {node} wait up to {timeout:g}s for it to come back",
                count=waiting,
                node=link.node_id,
                timeout=self._config().reattach_timeout_sec,
            )
        self.inflight.fail_requests(ServiceError("unavailable", f"node {link.node_id} disconnected"), link)
        self.bus.node_event(link.node_id, lifecycle.DISCONNECTED, generation=link.generation, reason=reason)

    # -- results of work

    def run_event(self, link, message):
        dispatch = self._dispatch_on(link, message.run_id, RunDispatch)
        if dispatch is not None:
            dispatch.deliver(event_from_wire(message), message.seq or None)

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

    def answered(self, link, request_id, result):
        """
        A C{NodeCommandResponse} or C{CancelResponse} arrived.
        """
        self.inflight.answered(link, request_id, result)

    # -- what the Edge tells its Nodes

    def reload(self, old, new):
        """
        Push a C{ConfigRefresh} to every ready Node whose adapters differ
        between configurations C{old} and C{new} (C{new} is already the
        running one), and record each Node's acknowledgement on its link
        (L{NodeLink.refresh}): applied, refused with the Node's reason, or
        unacknowledged after L{REFRESH_TIMEOUT_SEC}.

        @return: the ids of the nodes that were pushed a refresh.
        @raise ConfigError: if the change needs a restart (nothing applied).
        """
        changed = changed_nodes(old, new)
        self.registry.nodes = list(new.nodes)
        for node_id in changed:
            for resource in new.node(node_id).implicit_resources():
                self.pool.update_capacity(resource)
        pushed = []
        for node_id in changed:
            link = self.registry.ready_link(node_id)
            if link is None:
                continue
            payload = self.config_payload(node_id)
            request_id = new_id("cfg")
            answer = self.inflight.expect(link, request_id)
            try:
                link.wire.send(messages.config_refresh(payload, request_id))
            except Exception as e:
                self.inflight.unexpect(request_id)
                self.log.warn("config refresh for {node} not sent: {error}", node=node_id, error=e)
                continue
            link.refresh = {"state": "pending"}
            answer.addTimeout(REFRESH_TIMEOUT_SEC, self.inflight.clock)
            answer.addBoth(self._refresh_answered, link, payload)
            pushed.append(node_id)
        return pushed

    def _refresh_answered(self, outcome, link, payload):
        if isinstance(outcome, Failure):
            link.refresh = {"state": "unacknowledged", "reason": f"no answer within {REFRESH_TIMEOUT_SEC:g}s"}
            self.log.warn("node {node} did not acknowledge its config refresh", node=link.node_id)
        elif outcome.ok:
            link.adapters = _adapters(payload)
            link.refresh = {"state": "applied"}
            self.log.info("node {node} applied its config refresh", node=link.node_id)
        else:
            link.refresh = {"state": "refused", "reason": outcome.error}
            self.log.warn(
                "node {node} refused its config refresh and keeps its previous adapters: {reason}",
                node=link.node_id,
                reason=outcome.error,
            )

    def say_draining(self, grace, reason):
        """
        Tell every connected Node that speaks wire version 2 or later that
        this Edge is draining: it will get no new work, and the coming
        close is no failed attempt.
        """
        for link in self.registry.links():
            if link.wire_version >= DRAINING_WIRE_VERSION:
                link.send_quietly(messages.edge_draining(grace, reason))

    def close_all(self, reason):
        """
        Close every Node connection (the drain is over).
        """
        for link in self.registry.links():
            link.wire.close(reason)


def _adapters(payload):
    """
    What a Node runs once it applied C{payload}, as the status shows it.
    """
    return [{"name": a.name, "type": a.type, "max_concurrency": a.max_concurrency} for a in payload.adapters]
