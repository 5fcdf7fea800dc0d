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
from collections.abc import Callable
from typing import Any, TypeVar

from twisted.internet import defer
from twisted.internet.defer import Deferred
from twisted.logger import Logger
from twisted.python.failure import Failure

from iop.edge import bus as lifecycle
from iop.edge.bus import EventBus
from iop.edge.config import EdgeConfig, NodeSpec
from iop.edge.dispatch import Dispatch, Placement, RunDispatch, TunnelDispatch, Unheard
from iop.edge.errors import ServiceError
from iop.edge.inflight import Inflight
from iop.edge.pool import NORMAL, ProviderPool
from iop.edge.registry import NodeLink, NodeRegistry, RegistrationRefused
from iop.edge.reload import changed_nodes
from iop.edge.runs import RUN, RUNNING
from iop.edge.seam import ICluster, NotOwner
from iop.edge.spec import new_id
from iop.protocols import messages
from iop.protocols.convert import event_from_wire
from iop.protocols.wire import DRAINING_WIRE_VERSION, OLDEST_WIRE_VERSION, WIRE_VERSION, WireProtocol
from iop.run import ERROR, NODE_DISCONNECTED, NODE_RESTARTED

#: How long a Node may take to acknowledge a config refresh.
REFRESH_TIMEOUT_SEC = 30.0

#: What a registration comes to: the link (C{None} when refused) and a
#: Deferred of the answer (C{None}: the link was lost meanwhile).
Registration = tuple[NodeLink | None, "Deferred[messages.RegisterResponse | None]"]

#: The kind of dispatch a result of work is for.
_Kind = TypeVar("_Kind", bound=Dispatch)

#: The lease a run taken back needs: C{(provider_id, klass, group, target)}.
_Adoption = tuple[str, str, str | None, str]


class NodeLinks:
    """
    @param config: a callable returning the running
        L{iop.edge.config.EdgeConfig} (it changes on reload).
    @param cluster: the L{ICluster} this Edge belongs to: a registration
        must also win the node's claim there, and a ready the node's
        claim must still hold.
    """

    log = Logger()

    def __init__(
        self,
        config: Callable[[], EdgeConfig],
        registry: NodeRegistry,
        pool: ProviderPool,
        inflight: Inflight,
        bus: EventBus,
        cluster: ICluster,
    ) -> None:
        self._config = config
        self.registry = registry
        self.pool = pool
        self.inflight = inflight
        self.bus = bus
        self.cluster = cluster
        #: node id -> the payload it last applied, and the one it last
        #: refused (if it refused the latest): a Node that registers again
        #: is sent what it runs rather than what it could not build.
        self._applied: dict[str, messages.NodeConfigPayload] = {}
        self._refusals: dict[str, tuple[messages.NodeConfigPayload, str]] = {}
        #: This Edge is stopping (L{say_draining}): the background runs a
        #: Node reports are left to it, for the next Edge.
        self.stopping = False

    # -- registration and readiness

    def register(self, token: str, wire_version: int, wire: WireProtocol) -> Registration:
        """
        Handle a C{RegisterRequest}.

        @return: C{(link, response)}; C{link} is C{None} when refused, and
            C{response} a Deferred of the answer: the node's claim in the
            cluster comes first (L{_claimed}; at once for an Edge on its
            own).
        """
        if not OLDEST_WIRE_VERSION <= wire_version <= WIRE_VERSION:
            reason = (
                f"wire version {wire_version} is not served here"
                f" (this Edge serves {OLDEST_WIRE_VERSION} to {WIRE_VERSION}): upgrade the older side"
            )
            return None, defer.succeed(
                self._refused(self.registry.find_node(token), messages.INCOMPATIBLE_VERSION, reason)
            )
        try:
            link = self.registry.register(token, wire)
        except RegistrationRefused as refusal:
            return None, defer.succeed(self._refused(self.registry.find_node(token), refusal.code, refusal.reason))
        link.wire_version = wire_version
        d = self.cluster.claim(link.node_id, link.generation)
        answer = d.addCallbacks(self._claimed, self._not_claimed, callbackArgs=(link,), errbackArgs=(link,))
        return link, answer

    def _claimed(self, generation: int, link: NodeLink) -> messages.RegisterResponse | None:
        """
        The node's claim is this Edge's: the link's generation is the
        claim's (in an Edge cluster, its etcd revision). A link lost
        meanwhile gives the claim back at once.
        """
        if not link.open:
            self.cluster.release(link.node_id, generation)
            return None
        self.registry.fence(link, generation)
        return self._accepted(link)

    def _not_claimed(self, failure: Failure, link: NodeLink) -> messages.RegisterResponse | Failure:
        refusal = failure.value
        if not isinstance(refusal, NotOwner):
            return failure
        self.registry.abandon(link)
        # Retryable either way: the node's owner elsewhere goes away, or
        # this Edge gets its etcd session back.
        node = self._config().node(link.node_id)
        return self._refused(node, messages.DUPLICATE_CONNECTION, refusal.reason)

    def _accepted(self, link: NodeLink) -> messages.RegisterResponse:
        wire_version = link.wire_version
        # Cannot fail: edge.yaml was validated at load (adapter options are
        # JSON), so CONFIG_BUILD_FAILED is never sent by this Edge.
        payload = self.config_payload(link.node_id)
        refused = self._refusals.get(link.node_id)
        if refused is not None and refused[0] == payload and link.node_id in self._applied:
            # It could not build this configuration: it registers with what
            # it ran, and a reload (SIGHUP) pushes this one again.
            payload = self._applied[link.node_id]
            link.refresh = {"state": "refused", "reason": refused[1]}
        else:
            self._applied[link.node_id] = payload
        link.payload = payload
        link.adapters = _adapters(payload)
        self.bus.node_event(link.node_id, lifecycle.REGISTERED, generation=link.generation)
        self.log.info(
            "node {node} registered (generation {generation}, wire version {version})",
            node=link.node_id,
            generation=link.generation,
            version=wire_version,
        )
        return messages.register_accepted(payload, WIRE_VERSION)

    def refuse_credentials(self, token: str, reason: str) -> Registration:
        """
        Refuse a registration whose credentials do not hold together (a
        client certificate that does not name the token's node): fatal for
        the Node, like an unknown token.

        @return: C{(None, response)}.
        """
        return None, defer.succeed(self._refused(self.registry.find_node(token), messages.UNKNOWN_TOKEN, reason))

    def _refused(self, node: NodeSpec | None, code: int, reason: str) -> messages.RegisterResponse:
        self.bus.node_event(node.id if node else "", lifecycle.REJECTED, reason=reason)
        if node is not None:
            # (A stranger's refusal is the Node port's to count and log,
            # at a bounded rate.)
            self.log.warn("registration refused: {reason}", reason=reason)
        return messages.register_refused(code, reason, WIRE_VERSION)

    def config_payload(self, node_id: str) -> messages.NodeConfigPayload:
        config = self._config()
        node = config.node(node_id)
        assert node is not None  # (a link's node is configured: reloads close removed nodes' links)
        adapters = [
            messages.adapter_config(
                adapter.name, adapter.type, adapter.max_concurrency, json.dumps(adapter.options, sort_keys=True)
            )
            for adapter in node.adapters
        ]
        return messages.node_config(node.id, adapters, config.heartbeat_interval, config.heartbeat_timeout)

    def ready(self, link: NodeLink, node_id: str) -> tuple[messages.NodeReadyResponse, bool]:
        """
        Handle a C{NodeReadyRequest}.

        @return: C{(response, first)}; only the current owner's first ready
            is C{first}, and the caller must L{activate} it once the
            response is on the wire (the Node accepts work only after it).
            Only a first ready can be refused for the node's claim in the
            cluster: a repeated one of an active link is acknowledged and
            changes nothing (that link's loss, when the claim is gone,
            still takes the node out of service).
        """
        try:
            first = self.registry.mark_ready(link, node_id)
            if first and not self.cluster.holds(link.node_id, link.generation):
                link.ready = False
                raise RegistrationRefused(
                    messages.REJECT_NONE, f"this Edge no longer owns node {link.node_id} in the cluster"
                )
        except RegistrationRefused as refusal:
            self.bus.node_event(node_id, lifecycle.REJECTED, reason=refusal.reason)
            return messages.ready_response(False, refusal.reason), False
        return messages.ready_response(True), first

    def reconciled(self, link: NodeLink, message: messages.RunReconcile) -> None:
        """
        Handle a C{RunReconcile} (wire version 4, before the Node's ready):
        the background runs it kept from a lost link, taken back when the
        node is activated. A run named twice is taken back once.
        """
        link.reconcile = list({run.run_id: run for run in message.runs}.values())

    def activate(self, link: NodeLink) -> None:
        """
        The node is dispatch-ready: its providers go live and waiting
        requests are served at once — after the background runs it kept
        from a lost link have their leases back (L{_take_back}).
        """
        self.log.info("node {node} ready (generation {generation})", node=link.node_id, generation=link.generation)
        self.bus.node_event(link.node_id, lifecycle.READY, generation=link.generation)
        plan = self._reconcile_plan(link)
        if self.stopping and plan:
            # A stopping Edge neither waits for nor cancels them (as for
            # those it had in flight, iop.edge.drain): they go on on the
            # Node, which reports them to the next Edge.
            self.log.info(
                "{count} background run(s) reported by node {node} go on there for the next Edge",
                count=len(plan),
                node=link.node_id,
            )
            plan = []
        leases = self.pool.node_ready(link.node_id, link.generation, [adopt for _, _, adopt in plan])
        for (run, dispatch, _), lease in zip(plan, leases, strict=True):
            self._take_back(link, run, dispatch, lease)
        if link.payload is not None and link.payload != self.config_payload(link.node_id):
            # A reload came while it was getting ready (or it registered
            # with what it ran before refusing the configuration).
            self._push_refresh(link)
        for wire_id in self.inflight.detached_on(link.node_id):
            # The node came back without it (it restarted): it is over.
            gone = self.inflight.take_detached(link.node_id, wire_id)
            assert gone is not None  # (listed by detached_on just now)
            gone.fail(NODE_RESTARTED, f"node {link.node_id} came back without run {gone.caller_id}")

    # -- background runs across a lost link (wire version 4)

    def _reconcile_plan(
        self, link: NodeLink
    ) -> list[tuple[messages.ReconciledRun, RunDispatch | None, _Adoption | None]]:
        """
        What becomes of each run the Node reported. One the Edge ended
        meanwhile (a cancel, or it gave up waiting: the run book knows the
        id it has on the wire, and nothing waits for it) is cancelled on
        the Node now, and takes no lease. Each other one is C{(run,
        dispatch, adopt)} — the Edge's waiting dispatch (or C{None}: the
        Edge never heard of it), and the lease to take for it
        (C{(provider_id, klass, group, target)}, or C{None} when it needs
        none: it ended on the Node).
        """
        plan: list[tuple[messages.ReconciledRun, RunDispatch | None, _Adoption | None]] = []
        for run in link.reconcile or ():
            found = self.inflight.take_detached(link.node_id, run.run_id)
            # Only runs outlive their link (Dispatch.outlives_link).
            dispatch = found if isinstance(found, RunDispatch) else None
            ended = self.inflight.runs.for_wire(run.run_id) if dispatch is None else None
            if ended is not None:
                # Ended here meanwhile: on the Node too, as the Edge said.
                verdict = ended.error if ended.status == ERROR and ended.error else {}
                link.send_quietly(messages.cancel_run(run.run_id, verdict.get("code", ""), verdict.get("message", "")))
                continue
            if dispatch is None and self.inflight.runs.forgotten(link.node_id, run.run_id):
                # Ended here, and its record forgotten since (its verdict
                # with it): cancelled on the Node, not taken on anew.
                link.send_quietly(messages.cancel_run(run.run_id))
                continue
            adopt: _Adoption | None = None
            if run.status == RUNNING:
                if dispatch is not None:
                    placement, lease = dispatch.placement, dispatch.placement.lease
                    klass, group = (lease.klass, lease.group) if lease is not None else (NORMAL, None)
                    adopt = (placement.provider_id, klass, group, placement.target)
                else:
                    provider_id = self.pool.resource_of(link.node_id, run.adapter)
                    if provider_id is not None:
                        adopt = (provider_id, NORMAL, f"{link.node_id}/{run.adapter}", run.target)
            plan.append((run, dispatch, adopt))
        link.reconcile = None
        return plan

    def _take_back(self, link: NodeLink, run: messages.ReconciledRun, dispatch: RunDispatch | None, lease: Any) -> None:
        """
        Re-attach one reported run: a run the Edge was waiting for goes on
        where it was; one the Edge never heard of (it restarted since) is
        taken on record. The Node is asked for the events after the Edge's
        last one (C{RunResume}).
        """
        if dispatch is None:
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

    def _adopted(self, link: NodeLink, run: messages.ReconciledRun) -> RunDispatch:
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
        if run.started_at > 0:
            # Listed from when it began, not from when it came back. (Its
            # model group is not known here: the Node never had it.)
            record.created_at = run.started_at
        self.inflight.runs.started(record)
        placement = Placement(link, run.adapter, self._adapter_type(link.node_id, run.adapter), run.target)
        return RunDispatch(self.inflight, run.run_id, placement, Unheard(), run.run_id, record)

    def _adapter_type(self, node_id: str, adapter: str) -> str:
        node = self._config().node(node_id)
        spec = node.adapter(adapter) if node is not None else None
        return spec.type if spec is not None else ""

    def _not_back(self, dispatch: Dispatch) -> None:
        dispatch.fail(
            NODE_DISCONNECTED,
            f"node {dispatch.link.node_id} did not come back within {self._config().reattach_timeout_sec:g}s",
        )

    def node_draining(self, link: NodeLink, message: messages.NodeDraining) -> None:
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

    def lost(self, link: NodeLink, reason: str) -> None:
        """
        A registered connection closed. Only the current ready owner's loss
        takes the node out of service.
        """
        was_ready = self.registry.lost(link)
        self.cluster.release(link.node_id, link.generation)
        if not was_ready:
            if not link.ready:
                # Else only "registered" was logged: a Node that could not
                # run its configuration and exited would leave no trace.
                self.log.warn(
                    "node {node} disconnected before it was ready (generation {generation}): {reason}",
                    node=link.node_id,
                    generation=link.generation,
                    reason=reason,
                )
            return
        self.log.info("node {node} disconnected: {reason}", node=link.node_id, reason=reason)
        self.pool.node_disconnected(link.node_id, link.generation)
        waiting = 0
        for dispatch in self.inflight.on_link(link):
            if dispatch.cancelling:
                # Its cancel is out: it ends now as its grace would have
                # ended it, and nothing waits for it (a background run the
                # Node kept is cancelled there when the Node reports it).
                dispatch.end_cancelled(f"cancelled; node {link.node_id} disconnected before confirming")
            elif dispatch.outlives_link:
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

    def run_event(self, link: NodeLink, message: messages.RunEvent) -> None:
        dispatch = self._dispatch_on(link, message.run_id, RunDispatch)
        if dispatch is not None:
            dispatch.heard(message.first_byte_ms)
            dispatch.deliver(event_from_wire(message), message.seq or None)

    def tunnel_frame(self, link: NodeLink, message: messages.ProviderTunnelFrame) -> None:
        dispatch = self._dispatch_on(link, message.tunnel_id, TunnelDispatch)
        if dispatch is not None:
            dispatch.heard(message.first_byte_ms)
            dispatch.frame(message)

    def _dispatch_on(self, link: NodeLink, dispatch_id: str, kind: type[_Kind]) -> _Kind | None:
        dispatch = self.inflight.get(dispatch_id)
        if dispatch is None or dispatch.link is not link or not isinstance(dispatch, kind):
            # Late events after a local end (cancel grace, disconnect) are normal.
            return None
        return dispatch

    def answered(
        self, link: NodeLink, request_id: str, result: messages.NodeCommandResponse | messages.CancelResponse
    ) -> None:
        """
        A C{NodeCommandResponse} or C{CancelResponse} arrived.
        """
        self.inflight.answered(link, request_id, result)

    # -- what the Edge tells its Nodes

    def reload(self, old: EdgeConfig, new: EdgeConfig) -> list[str]:
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
            if self.registry.owner(node_id) is None:
                # No Node to ask: it registers with this configuration.
                self._update_capacity(node_id)
        pushed = []
        # Every ready Node that does not run its configuration: changed
        # now, or one whose refresh was refused or unanswered before
        # (another SIGHUP tries again).
        for link in self.registry.ready_links():
            if link.payload is None:
                continue
            if link.payload != self.config_payload(link.node_id):
                if self._push_refresh(link):
                    pushed.append(link.node_id)
            elif link.refresh is not None and link.refresh["state"] != "pending":
                # The operator took back what the Node refused: it runs
                # the configuration, and the old refusal says so no more.
                link.refresh = {"state": "applied"}
        return pushed

    def _push_refresh(self, link: NodeLink) -> bool:
        """
        Send C{link} a C{ConfigRefresh} of its node's configuration; its
        answer is recorded on the link (L{_refresh_answered}).

        @return: whether it was sent.
        """
        payload = self.config_payload(link.node_id)
        request_id = new_id("cfg")
        answer = self.inflight.expect(link, request_id)
        try:
            link.wire.send(messages.config_refresh(payload, request_id))
        except Exception as e:
            self.inflight.unexpect(request_id)
            self.log.warn("config refresh for {node} not sent: {error}", node=link.node_id, error=e)
            return False
        link.refresh = {"state": "pending"}
        answer.addTimeout(REFRESH_TIMEOUT_SEC, self.inflight.clock)
        answer.addBoth(self._refresh_answered, link, payload)
        return True

    def _update_capacity(self, node_id: str) -> None:
        """
        Size the resources of the adapters no provider names (direct work)
        on C{node_id}, and of its providers that take their capacity from
        their adapter's C{max_concurrency}, as its configuration says.
        """
        node = self._config().node(node_id)
        if node is not None:
            self.pool.set_implicit(node_id, node.implicit_resources())
            for provider in node.providers:
                if provider.follows_adapter:
                    self.pool.update_capacity(provider)

    def _refresh_answered(
        self, outcome: messages.NodeCommandResponse | Failure, link: NodeLink, payload: messages.NodeConfigPayload
    ) -> None:
        """
        A Node answered a refresh, or did not in time. Only what it applied
        changes what the Edge thinks it runs, and the capacity of its direct
        work: a refused or unanswered refresh leaves both as they were.
        """
        if isinstance(outcome, Failure):
            link.refresh = {"state": "unacknowledged", "reason": f"no answer within {REFRESH_TIMEOUT_SEC:g}s"}
            self.log.warn("node {node} did not acknowledge its config refresh", node=link.node_id)
        elif outcome.ok:
            link.payload = payload
            link.adapters = _adapters(payload)
            link.refresh = {"state": "applied"}
            self._applied[link.node_id] = payload
            self._refusals.pop(link.node_id, None)
            if payload == self.config_payload(link.node_id):
                self._update_capacity(link.node_id)
            self.log.info("node {node} applied its config refresh", node=link.node_id)
        else:
            link.refresh = {"state": "refused", "reason": outcome.error}
            self._refusals[link.node_id] = (payload, outcome.error)
            self.log.warn(
                "node {node} refused its config refresh and keeps its previous adapters: {reason}",
                node=link.node_id,
                reason=outcome.error,
            )

    def say_draining(self, grace: float, reason: str) -> None:
        """
        Tell every connected Node that speaks wire version 2 or later that
        this Edge is draining: it will get no new work, and the coming
        close is no failed attempt. A Node that gets ready from now on
        keeps the background runs it reports (L{activate}).
        """
        self.stopping = True
        for link in self.registry.links():
            if link.wire_version >= DRAINING_WIRE_VERSION:
                link.send_quietly(messages.edge_draining(grace, reason))

    def close_all(self, reason: str) -> None:
        """
        Close every Node connection (the drain is over).
        """
        for link in self.registry.links():
            link.wire.close(reason)


def _adapters(payload: messages.NodeConfigPayload) -> list[dict[str, Any]]:
    """
    What a Node runs once it applied C{payload}, as the status shows it.
    """
    return [{"name": a.name, "type": a.type, "max_concurrency": a.max_concurrency} for a in payload.adapters]
