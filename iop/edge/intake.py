"""
Work's way in: what the Edge takes, what it refuses at the door, and
cancelling what it took.

L{Intake.submit} is SubmitRun, the one call every surface makes: it
refuses work a draining or overloaded Edge cannot take, hands a request
another Edge of the cluster should serve back as a L{Forward}, reserves
the caller key's tokens, puts a background run on record while it waits,
and queues the work in the admission line, which hands it to its
L{Starter} when there is room. Work another Edge forwarded here for nodes
still registering here waits for them first (L{iop.edge.arrivals}).
"""

from collections.abc import Callable
from typing import Any

from twisted.internet import defer
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.python.failure import Failure

from iop.edge.admission import Admission
from iop.edge.arrivals import Arrivals
from iop.edge.bus import EventBus
from iop.edge.config import EdgeConfig
from iop.edge.drain import Drain, shutting_down
from iop.edge.errors import ServiceError
from iop.edge.failover import Work
from iop.edge.inflight import Inflight
from iop.edge.placement import Placer
from iop.edge.pool import ProviderPool
from iop.edge.runs import QUEUED, RUN, RunBook, RunRecord, visible
from iop.edge.seam import ICluster
from iop.edge.spec import RunSpec, new_id
from iop.edge.starter import Starter, labels
from iop.edge.tenants import ANONYMOUS, Tenant, Ticket, TokenBudgets
from iop.run import CANCELLED


def _never_ran(failure: Failure, ticket: Ticket) -> Failure:
    """
    Work that never started cost its tenant nothing.
    """
    ticket.settle(0)
    return failure


class Intake:
    """
    @param config: returns the running L{EdgeConfig} (its limits, run grace).
    @param clock: for the admission line and the token budgets.
    @param cluster: says which requests another Edge serves.

    @ivar starter: the L{Starter} of the work admitted.
    @ivar admission: the line work waits in before it is placed.
    @ivar budgets: the caller keys' L{TokenBudgets}.
    @ivar arrivals: the nodes on their way in that forwarded work waits for.
    """

    def __init__(
        self,
        config: Callable[[], EdgeConfig],
        clock: IReactorTime,
        drain: Drain,
        cluster: ICluster,
        placer: Placer,
        pool: ProviderPool,
        runs: RunBook,
        inflight: Inflight,
        bus: EventBus,
    ) -> None:
        self._config = config
        self.clock = clock
        self.drain = drain
        self.cluster = cluster
        self.placer = placer
        self.pool = pool
        self.runs = runs
        self.inflight = inflight
        self.bus = bus
        self.starter = Starter(placer, pool, runs, inflight, bus, drain, clock)
        self.admission = Admission(clock, self.starter.place)
        self.budgets = TokenBudgets(clock.seconds)
        self.arrivals = Arrivals(clock, bus, placer.registry)
        self._queued: dict[str, Deferred[str]] = {}
        pool.on_wait_end = self._wait_ended

    def submit(
        self,
        spec: RunSpec,
        listener_for: Callable[[str, str], Any],
        may_forward: bool = True,
        on_queued: Callable[[int, int], None] | None = None,
    ) -> "Deferred[str]":
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
            Edge cluster it fails with L{iop.edge.seam.Forward} when
            another Edge should serve it (unless C{may_forward} is false:
            the request was forwarded here already).
        @param on_queued: C{on_queued(position, eta_ms)} is called while the
            work waits for room (first as soon as it queues).

        The work is its caller key's (C{spec.tenant}): it waits in its
        model group's line by the key's priority and fair share, and its
        estimated tokens are reserved against the key's token budgets
        (refused with 429 C{token_budget_exceeded} when they cannot hold
        it), settled with the tokens reported when it ends.
        """
        if self.drain.draining:
            return defer.fail(shutting_down())
        forward = self.cluster.forward_target(spec) if may_forward else None
        if forward is not None:
            return defer.fail(forward)
        spec.timing.submitted = self.clock.seconds()
        config = self._config()
        tenant = spec.tenant or Tenant(spec.caller or ANONYMOUS)
        if spec.background and not spec.runs:
            return defer.fail(
                ServiceError("invalid", "only chat completions can run in the background", code="invalid_background")
            )
        ticket = Ticket(
            tenant,
            spec.token_estimate(config.limits.token_estimate),
            spec.priority,
            on_queued,
            provisional=spec.token_estimate(config.limits.token_estimate, capped=True),
        )
        try:
            self.budgets.reserve(ticket)
        except ServiceError as e:
            return defer.fail(e)
        # The bound on waiting work comes after every refusal of the
        # request itself: a place another key gives up must go to a
        # request that takes it (see the end of this method).
        at_bound = len(self.admission) + self.pool.waiting() >= config.limits.max_waiting
        if at_bound and not self.pool.can_make_room(tenant.name):
            ticket.settle(0)
            return defer.fail(
                ServiceError(
                    "unavailable",
                    "the Edge is overloaded: too much work is waiting",
                    code="overloaded",
                    retry_after=self.pool.retry_after(spec.model),
                )
            )
        record = None
        if spec.background:
            spec.tunnel = None
            spec.run_id = spec.run_id or new_id("run")
            ticket.work_id = spec.run_id
            record = self.runs.open(spec.run_id, RUN, status=QUEUED, **labels(self.pool, spec))
            queued = record
            self.runs.when_ended(record, lambda: ticket.settle_usage(queued.usage, queued.status))
        work = Work(
            spec,
            listener_for,
            retries=self.placer.retries(spec),
            id=spec.run_id or None,
            ticket=ticket,
            since=self.clock.seconds(),
        )
        arriving = self._arriving(spec, may_forward)
        if at_bound:
            if arriving is None and self.admission.places_now():
                # Placed in this call: it takes a place only if it must
                # wait (the pool), not if it is served at once or refused.
                ticket.at_bound = True
            else:
                # It waits (in the backlog, or for a node's news) already.
                self.pool.make_room(tenant.name)
        if arriving is None:
            d = self.admission.submit(work)
            ticket.at_bound = False  # a later acquire (a retry) is not at this bound
        else:
            d = arriving.addCallback(lambda _: self.admission.submit(work))
        d.addErrback(_never_ran, ticket)
        if record is not None:
            self._queued[record.id] = d
            d.addErrback(self._not_started, record)
            d.addBoth(self._left_queue, record.id)
        return d

    def _arriving(self, spec: RunSpec, may_forward: bool) -> "Deferred[None] | None":
        """
        If C{spec} was forwarded here (not C{may_forward}) and only nodes
        still registering here could serve it: the wait for their news
        (see L{iop.edge.arrivals}). Else C{None}: it is placed at once.
        """
        if may_forward:
            return None
        if spec.node:
            nodes, timeout = [spec.node], self._config().direct_queue_timeout_sec
        else:
            group = self.pool.group(spec.model) if spec.model else None
            if group is None:
                return None
            klass = self.pool.classify(group.name, spec.input_chars())
            if self.pool.has_candidate(group.name, klass, None, lambda p: spec.serves(p.adapter_type)):
                return None
            nodes, timeout = [m.node_id for m in group.members], group.queue_timeout_sec
        registering = self.arrivals.registering(nodes)
        return self.arrivals.wait(registering, timeout) if registering else None

    def _wait_ended(self, ticket: Ticket, queue: str, seconds: float, outcome: str) -> None:
        """
        Work left a queue: C{queue} events on the bus (queue wait by key).
        """
        self.bus.publish(
            "queue", {"event": outcome, "key": ticket.tenant.name, "model": queue, "waited_sec": round(seconds, 6)}
        )

    def _not_started(self, failure: Failure, record: RunRecord) -> Failure:
        if failure.check(CancelledError):
            self.runs.not_started(record, CANCELLED, "cancelled while queued", CANCELLED)
        elif isinstance(failure.value, ServiceError):
            self.runs.not_started(record, failure.value.code, failure.value.message)
        else:
            self.runs.not_started(record, "internal_error", "internal error")
        return failure

    def _left_queue(self, result: object, run_id: str) -> object:
        self._queued.pop(run_id, None)
        return result

    def cancel(self, work_id: str, owner: str | None = None) -> bool:
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
        if self.starter.cancel(work_id):
            return True
        waiting = self._queued.get(work_id)
        if waiting is not None:
            waiting.cancel()
            return True
        dispatch = self.inflight.for_caller(work_id)
        if dispatch is None:
            return self._cancel_detached(work_id)
        dispatch.cancel(self._config().run_grace_sec)
        return True

    def _cancel_detached(self, work_id: str) -> bool:
        """
        A background run waiting for its Node to come back ends here; the
        Node is told when it reports the run. One whose Node went to
        another Edge of the cluster is not in flight here: that Edge took
        it on, and is where it is cancelled.
        """
        where = self.inflight.detached_for_caller(work_id)
        if where is None or self.cluster.node_target(where[0]) is not None:
            return False
        dispatch = self.inflight.take_detached(*where)
        assert dispatch is not None  # (found waiting just now)
        dispatch.end_cancelled("cancelled while its node was away")
        return True
