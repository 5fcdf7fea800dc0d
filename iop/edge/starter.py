"""
Starting placed work: from a placement to a run or tunnel in flight.

The admission line hands each piece of work it admits to
L{Starter.place}: the L{Placer} finds it a provider, and the starter
decides from that provider whether it travels as a normalized run or a
raw tunnel, asks the surface for the matching listener, and starts it in
one guarded step that returns the lease on any failure. An attempt that
fails before its caller saw a byte may be placed again (on another
provider for a provider failure): see L{Starter._failed_early}.
"""

import json
from collections.abc import Callable
from typing import Any

from twisted.internet import defer
from twisted.internet.defer import CancelledError, Deferred
from twisted.logger import Logger
from twisted.python.failure import Failure

from iop.edge.bus import EventBus
from iop.edge.dispatch import Placement, RunDispatch, TunnelDispatch
from iop.edge.drain import Drain, shutting_down
from iop.edge.errors import ServiceError
from iop.edge.failover import Work
from iop.edge.inflight import Inflight
from iop.edge.placement import Placer
from iop.edge.pool import ProviderPool
from iop.edge.runs import RUN, TUNNEL, RunBook, RunRecord
from iop.edge.spec import RunSpec, TunnelSpec, new_id
from iop.protocols import messages
from iop.protocols.wire import FrameTooLarge
from iop.run import CANCELLED, CAPACITY_EXCEEDED, RunFailure


def labels(pool: ProviderPool, spec: RunSpec) -> dict[str, Any]:
    """
    What the run book records of a request before it is placed.
    """
    model = spec.model if spec.model and pool.group(spec.model) is not None else None
    return {"model": model, "adapter": spec.adapter or "", "background": spec.background, "caller": spec.caller}


class Starter:
    """
    @param drain: a draining Edge starts nothing more.

    @ivar placing_again: C{{work id: Deferred}} of the work being placed
        again after an early failure (cancelled with L{cancel}).
    """

    log = Logger()

    def __init__(
        self, placer: Placer, pool: ProviderPool, runs: RunBook, inflight: Inflight, bus: EventBus, drain: Drain
    ) -> None:
        self.placer = placer
        self.pool = pool
        self.runs = runs
        self.inflight = inflight
        self.bus = bus
        self.drain = drain
        self.placing_again: dict[str, Deferred[str]] = {}

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
                self.runs.when_ended(record, lambda: ticket.settle_usage(opened.usage))
            message: messages.ProviderTunnelRequest | messages.RunRequest
            if tunnel is not None:
                message = _tunnel_request(wire_id, placement, tunnel, spec.caller)
                listener = work.listener_for(TUNNEL, work_id)
                dispatch = TunnelDispatch(self.inflight, wire_id, placement, listener, work_id, record)
            else:
                message = _run_request(wire_id, placement, spec)
                listener = work.listener_for(RUN, work_id)
                dispatch = RunDispatch(self.inflight, wire_id, placement, listener, work_id, record)
            dispatch.on_early_failure = lambda failed, failure: self._failed_early(failed, failure, work)
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
        An attempt failed before its caller saw a byte. If the failure
        qualifies and the work has retries left, @return: what places it
        again (on another provider for a provider failure; anywhere for a
        Node that refused admitted work); else C{None}.
        """
        if self.drain.draining:
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

    def _place_again(self, failed: RunDispatch | TunnelDispatch, failure: RunFailure, work: Work) -> None:
        work_id = failed.caller_id  # (the work's id, which its caller knows)
        d = self.place(work)
        self.placing_again[work_id] = d

        def not_placed(outcome: Failure) -> None:
            # Nowhere else to go (or the caller left): the caller gets the
            # provider's own failure.
            if not outcome.check(CancelledError):
                if not outcome.check(ServiceError):
                    self.log.failure("placing {id} again failed", outcome, id=work_id)
                failed.tell_failure(failure)
            elif failed.record is not None:
                self.runs.not_started(failed.record, CANCELLED, "cancelled while placed again", CANCELLED)

        d.addErrback(not_placed)
        d.addBoth(lambda _: self.placing_again.pop(work_id, None))


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
        background=spec.background,
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
