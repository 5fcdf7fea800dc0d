"""
Starting placed work: from a placement to a run or tunnel in flight.

The admission line hands each piece of work it admits to
L{Starter.place}: the L{Placer} finds it a provider, and the starter
decides from that provider whether it travels as a normalized run or a
raw tunnel, asks the surface for the matching listener, and starts it in
one guarded step that returns the lease on any failure. An attempt that
fails before its caller saw a byte may be placed again (on another
provider, the same one after a delay, or a fallback group: see
L{iop.edge.failover.Failover.plan}), and a run's answer cut after its
caller saw part of it may be continued on another provider
(L{iop.edge.failover.Failover.continuation}).
"""

import json
from collections.abc import Callable
from typing import Any

from twisted.internet import defer, task
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from iop.edge.bus import EventBus
from iop.edge.dispatch import Placement, RunDispatch, TunnelDispatch
from iop.edge.drain import Drain, shutting_down
from iop.edge.errors import ServiceError
from iop.edge.failover import Failover, Work
from iop.edge.inflight import Inflight
from iop.edge.placement import Placer
from iop.edge.pool import ProviderPool
from iop.edge.runs import RUN, TUNNEL, RunBook, RunRecord
from iop.edge.spec import RunSpec, TunnelSpec, new_id
from iop.protocols import messages
from iop.protocols.wire import FrameTooLarge
from iop.run import INCOMPLETE, RunFailure


def labels(pool: ProviderPool, spec: RunSpec) -> dict[str, Any]:
    """
    What the run book records of a request before it is placed.
    """
    model = spec.model if spec.model and pool.group(spec.model) is not None else None
    return {"model": model, "adapter": spec.adapter or "", "background": spec.background, "caller": spec.caller}


class Starter:
    """
    @param drain: a draining Edge starts nothing more.
    @param clock: when work is placed again after a delay (Retry-After)
        and the queue deadline that delay must fit in.

    @ivar placing_again: C{{work id: Deferred}} of the work being placed
        again after a failure (cancelled with L{cancel}).
    @ivar resting: the ids of those waiting out a provider's Retry-After
        first (L{stop_resting} ends their wait).
    @ivar failover: the L{Failover} that says where.
    """

    log = Logger()

    def __init__(
        self,
        placer: Placer,
        pool: ProviderPool,
        runs: RunBook,
        inflight: Inflight,
        bus: EventBus,
        drain: Drain,
        clock: IReactorTime,
    ) -> None:
        self.clock = clock
        self.failover = Failover(pool, placer, clock, bus)
        self.placer = placer
        self.pool = pool
        self.runs = runs
        self.inflight = inflight
        self.bus = bus
        self.drain = drain
        self.placing_again: dict[str, Deferred[str]] = {}
        self.resting: set[str] = set()

    def place(self, work: Work) -> "Deferred[str]":
        """
        Place C{work} and start it there. @return: a Deferred firing with
        the work's id once it started.
        """
        if self.drain.draining:
            return defer.fail(shutting_down())
        placed = self.placer.place(work.spec, avoid=work.avoid, ticket=work.ticket)
        return placed.addCallback(self._start, work)

    def cancel(self, work_id: str) -> bool:
        """
        Cancel C{work_id} if it is being placed again. @return: whether it was.
        """
        placing = self.placing_again.get(work_id)
        if placing is None:
            return False
        placing.cancel()
        return True

    def _start(self, placement: Placement, work: Work) -> str:
        """
        Start placed work in one guarded step: whatever fails before the
        work is in flight returns the placement's lease. The work is on
        record in the run book (under the id its caller knows) before the
        surface's listener is made, so the listener may read it.
        """
        spec = work.spec
        work.attempts += 1
        clock = self.inflight.clock
        spec.timing.place(clock.seconds())
        record = None
        dispatch: RunDispatch | TunnelDispatch
        try:
            if self.drain.draining:
                raise shutting_down()
            tunnel = spec.tunnel if spec.tunnels_on(placement.adapter_type) else None
            if work.id is None:
                work.id = new_id("tun" if tunnel is not None else "run")
            work_id = work.id
            wire_id = work.wire_id()
            kind = TUNNEL if tunnel is not None else RUN
            record = self.runs.open(
                work_id,
                kind,
                node=placement.node_id,
                target=placement.target or spec.target,
                provider=placement.provider_id,
                wire_id=wire_id,
                **dict(labels(self.pool, spec), adapter=placement.adapter),
            )
            if work.ticket is not None:
                work.ticket.work_id = work_id
                ticket, opened = work.ticket, record
                self.runs.when_ended(record, lambda: ticket.settle_usage(opened.usage, opened.status))
            message: messages.ProviderTunnelRequest | messages.RunRequest
            if tunnel is not None:
                message = _tunnel_request(wire_id, placement, tunnel, spec.caller)
                listener = work.listener_for(TUNNEL, work_id)
                dispatch = TunnelDispatch(self.inflight, wire_id, placement, listener, work_id, record)
            else:
                message = _run_request(wire_id, placement, spec)
                # An attempt that continues a cut answer goes on with the
                # listener the caller's answer is being rendered by.
                listener = work.listener if spec.continues else work.listener_for(RUN, work_id)
                run = RunDispatch(self.inflight, wire_id, placement, listener, work_id, record)
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
        dispatch.timing = spec.timing
        try:
            dispatch.send(message)
            spec.timing.sent = clock.seconds()
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
        return work_id

    def _abandon(self, record: RunRecord | None, work: Work, error: ServiceError) -> None:
        """
        Work on record that could not start ends on record too (a later
        attempt's failure is the caller's, told by L{_place_again}).
        """
        if record is not None and work.attempts <= 1:
            self.runs.not_started(record, error.code, error.message)

    def _failed_early(
        self, failed: RunDispatch | TunnelDispatch, failure: RunFailure, work: Work
    ) -> Callable[[], None] | None:
        """
        An attempt failed before its caller saw a byte. @return: what
        places it again when L{Failover.plan} says where (another provider
        of its group, the same one after a delay, a fallback group; or
        anywhere for a Node that refused admitted work); else C{None}.
        """
        if self.drain.draining:
            return None
        delay = self.failover.plan(failed, failure, work)
        if delay is None:
            return None
        return lambda: self._place_again(failed, failure, work, delay)

    def _failed_late(
        self, failed: RunDispatch, failure: RunFailure, text: str, work: Work
    ) -> Callable[[], None] | None:
        """
        A run's answer was cut after its caller got C{text} of it.
        @return: what places the rest when L{Failover.continuation} says
            where; else C{None} (the caller gets the explicit error).
        """
        if self.drain.draining:
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

    def _provider_failed(self, failed: RunDispatch | TunnelDispatch, failure: RunFailure) -> None:
        """
        A provider failed a piece of work (before or after its first
        byte): deadline hits and cut answers are published (for metrics).
        """
        where = {"node": failed.link.node_id, "provider": failed.placement.provider_id}
        if failure.deadline:
            self.bus.publish("provider", dict(where, event="deadline", kind=failure.deadline))
        if failure.code == INCOMPLETE:
            self.bus.publish("provider", dict(where, event="incomplete", continued=failed.continued))

    def _place_again(
        self, failed: RunDispatch | TunnelDispatch, failure: RunFailure, work: Work, delay: float = 0.0
    ) -> None:
        work_id = failed.caller_id  # (the work's id, which its caller knows)
        if delay > 0:
            # (After the provider's Retry-After, on the Edge's clock.)
            d = task.deferLater(self.clock, delay, lambda: None).addCallback(lambda _: self.place(work))
            self.resting.add(work_id)
        else:
            d = self.place(work)
        self.placing_again[work_id] = d

        def not_placed(outcome: Failure) -> None:
            # Nowhere else to go (or the caller left, or a drain ended its
            # wait): the caller gets the provider's own failure.
            if not outcome.check(CancelledError) or self.drain.draining:
                if not outcome.check(ServiceError, CancelledError):
                    self.log.failure("placing {id} again failed", outcome, id=work_id)
                failed.tell_failure(failure)
            else:
                # Cancelled (the caller left, or asked by another request
                # while it still reads): the record and the listener end.
                failed.tell_cancelled("cancelled while placed again")

        def done(_: object) -> None:
            self.placing_again.pop(work_id, None)
            self.resting.discard(work_id)

        d.addErrback(not_placed)
        d.addBoth(done)

    def stop_resting(self) -> None:
        """
        The Edge is draining: work waiting out a provider's Retry-After is
        not placed again; its caller gets that provider's failure now.
        """
        for work_id in list(self.resting):
            self.cancel(work_id)


def _run_request(run_id: str, placement: Placement, spec: RunSpec) -> messages.RunRequest:
    chat = [
        messages.chat_message(
            m.get("role", "user"),
            m.get("content") or "",
            name=m.get("name", ""),
            tool_call_id=m.get("tool_call_id", ""),
            tool_calls_json=json.dumps(m["tool_calls"]) if m.get("tool_calls") else "",
            images=m.get("images", ()),
        )
        for m in spec.messages
    ]
    return messages.run_request(
        run_id,
        placement.adapter,
        chat,
        target=placement.target or spec.target,
        session_id=spec.session_id,
        # (The wire's background is what the Node keeps across a lost link.)
        background=spec.background or spec.outlives_edge,
        options_json=json.dumps(spec.options) if spec.options else "",
        caller=spec.caller or "",
        traceparent=spec.traceparent,
    )


def _tunnel_request(
    tunnel_id: str, placement: Placement, tunnel: TunnelSpec, caller: str | None
) -> messages.ProviderTunnelRequest:
    return messages.tunnel_request(
        tunnel_id,
        placement.adapter,
        tunnel.method,
        tunnel.path,
        tunnel.headers,
        tunnel.encoded_body(placement.target),
        caller=caller or "",
    )
