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
from twisted.internet import defer, task
from twisted.internet.defer import CancelledError
from twisted.logger import Logger

from iop.edge.admission import Admission
from iop.edge.bus import EventBus
from iop.edge.dispatch import RunDispatch, TunnelDispatch
from iop.edge.errors import ServiceError
from iop.edge.failover import Failover, Work
from iop.edge.inflight import Inflight
from iop.edge.links import NodeLinks
from iop.edge.placement import Placer
from iop.edge.pool import ProviderPool
from iop.edge.probes import probe_provider
from iop.edge.registry import NodeRegistry
from iop.edge.runs import QUEUED, RUN, TUNNEL, RunBook, no_such_run, stored_json, visible
from iop.edge.spec import new_id
from iop.edge.status import model_names, snapshot
from iop.edge.tenants import ANONYMOUS, Tenant, Ticket, TokenBudgets
from iop.protocols import iop_pb2
from iop.protocols.wire import FrameTooLarge
from iop.run import (
    CANCELLED,
    FAILED,
    INCOMPLETE,
    INVALID_ARGS,
    NOT_SUPPORTED,
    SHUTTING_DOWN,
    UNKNOWN_ADAPTER,
    UNKNOWN_COMMAND,
    UNKNOWN_RUN,
)

#: How long a drained Edge waits for its HTTP connections to flush their
#: last bytes before it aborts them.
FLUSH_TIMEOUT_SEC = 5.0

#: What a failed node command's code says about whose mistake it was.
_COMMAND_FAILURE_KINDS = {
    UNKNOWN_COMMAND: "invalid",
    NOT_SUPPORTED: "invalid",
    INVALID_ARGS: "invalid",
    UNKNOWN_ADAPTER: "not_found",
    UNKNOWN_RUN: "not_found",
    CANCELLED: "unavailable",
}


def _never_ran(failure, ticket):
    """
    Work that never started cost its tenant nothing.
    """
    ticket.settle(0)
    return failure


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
            reactor,
            config.providers(),
            config.model_groups,
            config.direct_queue_timeout_sec,
            config.health,
            prober=lambda spec: probe_provider(self, spec),
        )
        run_log = config.run_log
        self.runs = RunBook(
            reactor, self.bus, self._fetch_run, run_log.max_bytes, run_log.max_age_sec, run_log.max_runs
        )
        self.inflight = Inflight(reactor, self.runs)
        self.links = NodeLinks(lambda: self.config, self.registry, self.pool, self.inflight, self.bus)
        self.placer = Placer(lambda: self.config, self.registry, self.pool)
        self.failover = Failover(self.pool, self.placer, reactor, self.bus)
        self.admission = Admission(reactor, self._place)
        self.budgets = TokenBudgets(reactor.seconds)
        self.pool.on_wait_end = self._wait_ended
        self.draining = False
        self.site = None
        self.node_port = None
        self._listeners = ()
        self._grace_timer = None
        self._drained = None
        self._placing_again = {}
        self._queued = {}
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

    def submit(self, spec, listener_for, may_forward=True, on_queued=None):
        """
        SubmitRun: place the work, then start it as a run or a tunnel.

        @param spec: a L{iop.edge.spec.RunSpec}. A background run gets its
            id here (C{spec.run_id}), so the caller can be told at once,
            and is on record (C{queued}) while it waits for room.
        @param listener_for: C{listener_for(kind, work_id)} returns the
            listener for the chosen kind: an L{IRunListener} for L{RUN}, an
            L{ITunnelListener} for L{TUNNEL} (only asked when
            C{spec.tunnel} is set and the provider takes raw HTTP).
        @return: a cancellable Deferred firing with the work's id once it
            started; cancelling it while it waits leaves the queue. In an
            Edge cluster it fails with L{iop.edge.cluster.load.Forward}
            when another Edge should serve it (unless C{may_forward} is
            false: the request was forwarded here already).
        @param on_queued: C{on_queued(position, eta_ms)} is called while the
            work waits for room (first as soon as it queues).

        The work is its caller key's (C{spec.tenant}): it waits in its
        model group's line by the key's priority and fair share, and its
        estimated tokens are reserved against the key's token budgets
        (refused with 429 C{token_budget_exceeded} when they cannot hold
        it), settled with the tokens reported when it ends.
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
                ServiceError(
                    "unavailable",
                    "the Edge is overloaded: too much work is waiting",
                    code="overloaded",
                    retry_after=self.pool.retry_after(spec.model),
                )
            )
        if spec.background and not spec.runs:
            return defer.fail(
                ServiceError("invalid", "only chat completions can run in the background", code="invalid_background")
            )
        ticket = Ticket(
            spec.tenant or Tenant(spec.caller or ANONYMOUS),
            spec.token_estimate(self.config.limits.token_estimate),
            spec.priority,
            on_queued,
        )
        try:
            self.budgets.reserve(ticket)
        except ServiceError as e:
            return defer.fail(e)
        record = None
        if spec.background:
            spec.tunnel = None
            spec.run_id = spec.run_id or new_id("run")
            ticket.work_id = spec.run_id
            record = self.runs.open(spec.run_id, RUN, status=QUEUED, **self._labels(spec))
            self.runs.when_ended(record, lambda: ticket.settle_usage(record.usage))
        work = Work(
            spec,
            listener_for,
            retries=self.placer.retries(spec),
            id=spec.run_id or None,
            ticket=ticket,
            since=self.clock.seconds(),
        )
        d = self.admission.submit(work)
        d.addErrback(_never_ran, ticket)
        if record is not None:
            self._queued[record.id] = d
            d.addErrback(self._not_started, record)
            d.addBoth(self._left_queue, record.id)
        return d

    def _wait_ended(self, ticket, queue, seconds, outcome):
        """
        Work left a queue: C{queue} events on the bus (queue wait by key).
        """
        self.bus.publish(
            "queue", {"event": outcome, "key": ticket.tenant.name, "model": queue, "waited_sec": round(seconds, 6)}
        )

    def _labels(self, spec):
        """
        What the run book records of a request before it is placed.
        """
        model = spec.model if spec.model and self.pool.group(spec.model) is not None else None
        return {"model": model, "adapter": spec.adapter or "", "background": spec.background, "caller": spec.caller}

    def _not_started(self, failure, record):
        if failure.check(CancelledError):
            self.runs.not_started(record, CANCELLED, "cancelled while queued", CANCELLED)
        elif failure.check(ServiceError):
            self.runs.not_started(record, failure.value.code, failure.value.message)
        else:
            self.runs.not_started(record, "internal_error", "internal error")
        return failure

    def _left_queue(self, result, run_id):
        self._queued.pop(run_id, None)
        return result

    def _place(self, work):
        if self.draining:
            return defer.fail(_shutting_down())
        d = self.placer.place(work.spec, avoid=work.avoid, ticket=work.ticket)
        d.addCallback(self._start, work)
        return d

    def _start(self, placement, work):
        """
        Start placed work in one guarded step: whatever fails before the
        work is in flight returns the placement's lease. The work is on
        record in the run book (under the id its caller knows) before the
        surface's listener is made, so the listener may read it.
        """
        spec = work.spec
        work.attempts += 1
        record = None
        try:
            if self.draining:
                raise _shutting_down()
            tunnel = spec.tunnels_on(placement.adapter_type)
            if work.id is None:
                work.id = new_id("tun" if tunnel else "run")
            wire_id = work.wire_id()
            kind = TUNNEL if tunnel else RUN
            record = self.runs.open(
                work.id,
                kind,
                node=placement.node_id,
                target=placement.target or spec.target,
                provider=placement.provider_id,
                wire_id=wire_id,
                **dict(self._labels(spec), adapter=placement.adapter),
            )
            if work.ticket is not None:
                work.ticket.work_id = work.id
                ticket = work.ticket
                self.runs.when_ended(record, lambda: ticket.settle_usage(record.usage))
            if tunnel:
                message = _tunnel_request(wire_id, placement, spec.tunnel, spec.caller)
                listener = work.listener_for(TUNNEL, work.id)
                dispatch: RunDispatch | TunnelDispatch = TunnelDispatch(
                    self.inflight, wire_id, placement, listener, work.id, record
                )
            else:
                message = _run_request(wire_id, placement, spec)
                # An attempt that continues a cut answer goes on with the
                # listener the caller's answer is being rendered by.
                listener = work.listener if spec.continues else work.listener_for(RUN, work.id)
                run = RunDispatch(self.inflight, wire_id, placement, listener, work.id, record)
                run.on_late_failure = lambda failed, failure, text: self._failed_late(failed, failure, text, work)
                if spec.continues:
                    run.continuing = True
                    run.seq_base = record.last_seq
                dispatch = run
            work.listener = listener
            dispatch.on_early_failure = lambda failed, failure: self._failed_early(failed, failure, work)
            dispatch.on_failure = self._provider_failed
        except ServiceError as e:
            placement.release()
            self._abandon(record, work, e)
            raise
        except Exception:
            placement.release()
            self.log.failure("could not start work on node {node}", node=placement.node_id)
            error = ServiceError("failed", "internal error", code="internal_error")
            self._abandon(record, work, error)
            raise error from None
        self.inflight.add(dispatch)
        self.runs.started(record)
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
            error = ServiceError("failed", f"could not send to node {dispatch.link.node_id}: {e}", code="send_failed")
            self.runs.not_started(record, error.code, error.message)
            raise error from None
        return work.id

    def _abandon(self, record, work, error):
        """
        Work on record that could not start ends on record too (a later
        attempt's failure is the caller's, told by L{_place_again}).
        """
        if record is not None and work.attempts <= 1:
            self.runs.not_started(record, error.code, error.message)

    def _failed_early(self, failed, failure, work):
        """
        An attempt failed before its caller saw a byte. @return: what
        places it again when L{Failover.plan} says where (another provider
        of its group, the same one after a delay, a fallback group; or
        anywhere for a Node that refused admitted work); else C{None}.
        """
        if self.draining:
            return None
        delay = self.failover.plan(failed, failure, work)
        if delay is None:
            return None
        return lambda: self._place_again(failed, failure, work, delay)

    def _failed_late(self, failed, failure, text, work):
        """
        A run's answer was cut after its caller got C{text} of it.
        @return: what places the rest when L{Failover.continuation} says
            where; else C{None} (the caller gets the explicit error).
        """
        if self.draining:
            return None
        delay = self.failover.continuation(failed, failure, work, text)
        if delay is None:
            return None
        self.log.info(
            "{id}: the answer was cut on {node}/{provider} ({reason}); continuing it on model group {group}",
            id=work.id,
            node=failed.link.node_id,
            provider=failed.placement.provider_id,
            reason=failure.message,
            group=work.spec.model,
        )
        return lambda: self._place_again(failed, failure, work, delay)

    def _provider_failed(self, failed, failure):
        """
        A provider failed a piece of work (before or after its first
        byte): deadline hits and cut answers are published (for metrics).
        """
        where = {"node": failed.link.node_id, "provider": failed.placement.provider_id}
        if failure.deadline:
            self.bus.publish("provider", dict(where, event="deadline", kind=failure.deadline))
        if failure.code == INCOMPLETE:
            self.bus.publish("provider", dict(where, event="incomplete", continued=failed.continued))

    def _place_again(self, failed, failure, work, delay=0.0):
        d = task.deferLater(self.clock, delay, self._place, work) if delay > 0 else self._place(work)
        self._placing_again[work.id] = d

        def not_placed(outcome):
            # Nowhere else to go (or the caller left): the caller gets the
            # provider's own failure.
            if not outcome.check(CancelledError):
                if not outcome.check(ServiceError):
                    self.log.failure("placing {id} again failed", outcome, id=work.id)
                failed.tell_failure(failure)
            elif failed.record is not None:
                self.runs.not_started(failed.record, CANCELLED, "cancelled while placed again", CANCELLED)

        d.addErrback(not_placed)
        d.addBoth(lambda _: self._placing_again.pop(work.id, None))

    def cancel(self, work_id, owner=None):
        """
        Cancel a run or tunnel.

        @param owner: only work of this caller key's (C{None}: any).
        @return: whether it was in flight (and C{owner}'s).
        """
        if owner is not None:
            # Work in flight or queued is on record until it ends.
            record = self.runs.get(work_id)
            if record is None or not visible(owner, record.caller):
                return False
        waiting = self._placing_again.get(work_id) or self._queued.get(work_id)
        if waiting is not None:
            waiting.cancel()
            return True
        dispatch = self.inflight.for_caller(work_id)
        if dispatch is None:
            return self._cancel_detached(work_id)
        dispatch.cancel(self.config.run_grace_sec)
        return True

    def _cancel_detached(self, work_id):
        """
        A background run waiting for its Node to come back ends here; the
        Node is told when it reports the run.
        """
        where = self.inflight.detached_for_caller(work_id)
        if where is None:
            return False
        dispatch = self.inflight.take_detached(*where)
        dispatch.end_cancelled("cancelled while its node was away")
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

        tell_node = None if abort is None else (lambda: link.send_quietly(abort))
        d = self.inflight.expect(link, request_id, on_progress, tell_node)
        try:
            link.wire.send(message)
        except Exception as e:
            self.inflight.unexpect(request_id)
            return defer.fail(ServiceError("failed", f"could not send to node {node_id}: {e}"))

        def timed_out(result, timeout):
            raise ServiceError("timeout", f"node {node_id} did not answer within {timeout:g}s")

        return d.addTimeout(timeout, self.clock, onTimeoutCancel=timed_out)

    # -- run history --------------------------------------------------------------

    def get_run(self, run_id, owner=None):
        """
        One run or tunnel: from the run book while it is in memory (and
        its log whole), else from the store of the Node it ran on.

        @param owner: only work of this caller key's (C{None}: any).
        @return: a Deferred firing with its JSON object (C{GET
            /v1/runs/{id}}), or failing with a L{ServiceError}
            (C{not_found}, also for another key's run; C{unavailable} when
            its node is offline).
        """
        record = self.runs.get(run_id)
        if record is not None and not visible(owner, record.caller):
            return defer.fail(no_such_run(run_id))
        if record is not None and (record.complete_log or record.kind == TUNNEL):
            return defer.succeed(record.as_json())
        node_id, wire_id = self.runs.locate(run_id)
        d = self._fetch_run(wire_id, node_id, 0)

        def fetched(found):
            node_id, answer = found
            stored = stored_json(node_id, answer["run"], run_id)
            if record is None:
                if not visible(owner, stored["key"]):
                    raise no_such_run(run_id)
                return stored
            # The Edge's view is the current one; the Node has the whole text.
            return dict(record.as_json(), output=stored.get("output", ""))

        def failed(failure):
            if record is None:
                return failure
            self.log.warn(
                "run {run_id}: its whole output could not be read from node {node}: {why}",
                run_id=run_id,
                node=record.node,
                why=failure.getErrorMessage(),
            )
            return dict(record.as_json(), output_partial=True)

        return d.addCallbacks(fetched, failed)

    def list_runs(self, node_id=None, status=None, limit=50, owner=None):
        """
        Recent runs and tunnels, newest first: those the Edge has in
        memory (queued ones included) and those in the stores of the ready
        nodes (only C{node_id}'s, when given), only C{owner}'s when given
        (a caller key's name).

        @return: a Deferred firing with C{{"runs": [...]}}, plus
            C{"incomplete": [node ids]} naming nodes that could not be
            asked.
        """
        if node_id is not None and self.config.node(node_id) is None:
            return defer.fail(ServiceError("not_found", f"no node {node_id!r} is configured"))
        known = {}
        for record in self.runs.records():
            if (
                (node_id is None or record.node == node_id)
                and (status is None or record.status == status)
                and visible(owner, record.caller)
            ):
                known[record.id] = record.as_json(output=False)
        nodes = [node_id] if node_id is not None else [n.id for n in self.config.nodes]
        asked, incomplete = [], []
        for node in nodes:
            if self.registry.ready_link(node) is None:
                incomplete.append(node)
                continue
            args = {"limit": limit}
            if status is not None:
                args["status"] = status
            if owner is not None:
                args["caller"] = owner
            asked.append((node, self.command(node, "run_list", "", args)))

        def merge(results):
            for (node, _), (ok, answer) in zip(asked, results, strict=True):
                if not ok:
                    self.log.info("run_list on node {node} failed: {why}", node=node, why=answer.getErrorMessage())
                    incomplete.append(node)
                    continue
                for row in answer.get("runs", []):
                    # (An older node does not filter by caller.)
                    if visible(owner, row.get("caller")):
                        known.setdefault(row["run_id"], stored_json(node, row))
            runs = sorted(known.values(), key=lambda r: r.get("created_at") or 0, reverse=True)[:limit]
            answer = {"runs": runs}
            if incomplete:
                answer["incomplete"] = sorted(incomplete)
            return answer

        return defer.DeferredList([d for _, d in asked], consumeErrors=True).addCallback(merge)

    def follow(self, run_id, after, write, end, owner=None):
        """
        Replay a run's events after C{after} and follow it to its terminal
        (see L{RunBook.follow}); only C{owner}'s run when given.
        """
        return self.runs.follow(run_id, after, write, end, owner)

    def _fetch_run(self, run_id, node_id, after):
        """
        Ask C{node_id} (every ready node, when C{None}) for a run from its
        store. @return: a Deferred of C{(node_id, answer)}.
        """
        if node_id is not None:
            return self._run_get(node_id, run_id, after)
        nodes = [link.node_id for link in self.registry.ready_links()]
        if not nodes:
            return defer.fail(ServiceError("not_found", f"no run {run_id} (no node is connected to ask)"))
        asks = [self._run_get(node, run_id, after) for node in nodes]

        def first(results):
            for ok, found in results:
                if ok:
                    return found
            for _ok, failure in results:
                if not failure.check(ServiceError) or failure.value.kind != "not_found":
                    return failure
            raise ServiceError("not_found", f"no run {run_id}", code="run_not_found")

        return defer.DeferredList(asks, consumeErrors=True).addCallback(first)

    def _run_get(self, node_id, run_id, after):
        d = self.command(node_id, "run_get", "", {"run_id": run_id, "after": after})

        def older_node(failure):
            failure.trap(ServiceError)
            if failure.value.code == UNKNOWN_COMMAND:
                raise ServiceError("not_found", f"node {node_id} keeps no run history (an older node)")
            if failure.value.code == UNKNOWN_RUN:
                raise ServiceError("not_found", f"no run {run_id}", code="run_not_found")
            return failure

        return d.addCallbacks(lambda answer: (node_id, answer), older_node)

    def status(self):
        """
        The snapshot: every configured node (connected or not) with its
        providers, and every model group with its queue length.
        """
        state = snapshot(self.config, self.registry, self.pool, self.inflight)
        if self.cluster is not None:
            self.cluster.annotate(state)
        return state

    def queue(self, tenant=None):
        """
        Work waiting for room, in the order it will be served (only the
        key C{tenant}'s, when given): see L{ProviderPool.queued}.
        """
        return self.pool.queued(tenant)

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
        self._hand_back_background_runs()
        idle = self.inflight.when_idle()
        self._grace_timer = self.clock.callLater(grace, self.hurry)
        idle.addCallback(self._drain_done)
        self._drained = defer.gatherResults(stopping + [idle], consumeErrors=True)
        self._drained.addErrback(lambda f: self.log.failure("draining failed", f))
        return self._drained

    def _hand_back_background_runs(self):
        """
        A stopping Edge neither waits for nor cancels the background runs
        of Nodes that keep runs across a lost link (wire version 4): they
        go on there, and the next Edge takes them back when the Node
        reconnects (docs/wire.md, "Background runs across a lost link").
        """
        handed = 0
        for dispatch in self.inflight.all():
            if dispatch.outlives_link:
                dispatch.finish()
                handed += 1
        if handed:
            self.log.info("{count} background run(s) go on on their nodes for the next Edge", count=handed)

    def hurry(self):
        """
        End a drain now (the grace passed, or a second stop signal): work
        in flight ends with a C{shutting_down} terminal to its caller and
        pending commands fail.
        """
        if not self.draining:
            return
        self._end_grace()
        left = self.inflight.all()
        if left:
            self.log.info("ending {count} run(s)/tunnel(s) still in flight", count=len(left))
        for dispatch in left:
            dispatch.shut_down("the Edge is shutting down")
        self.inflight.fail_requests(_shutting_down())

    def _end_grace(self):
        if self._grace_timer is not None and self._grace_timer.active():
            self._grace_timer.cancel()
        self._grace_timer = None

    def _drain_done(self, _):
        self._end_grace()
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
        caller=spec.caller or "",
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


def _tunnel_request(tunnel_id, placement, tunnel, caller):
    message = iop_pb2.ProviderTunnelRequest(
        tunnel_id=tunnel_id,
        adapter=placement.adapter,
        method=tunnel.method,
        path=tunnel.path,
        body=tunnel.encoded_body(placement.target),
        caller=caller or "",
    )
    for name, value in tunnel.headers:
        message.headers.add(name=name, value=value)
    return message
