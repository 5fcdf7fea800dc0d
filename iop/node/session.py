"""
One Node <-> Edge connection, from the Node's side.

A L{NodeSession} registers with the Edge, applies the configuration it is
given, declares itself ready, and from then on turns the Edge's requests
into runs, tunnels, commands and config changes. The registration outcome
is L{NodeSession.ready}; the end of the connection is L{NodeSession.lost}.
Retrying is not the session's business: the supervisor watches both
Deferreds and decides.
"""

import json
from collections.abc import Callable
from typing import Any, cast

from twisted.internet import defer
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall, ITCPTransport
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

from iop.adapters.interface import NotSupported
from iop.node.commands import CommandHandler
from iop.node.context import NodeContext
from iop.node.drain import Drain
from iop.node.flow import Message
from iop.node.host import AdapterSetupError
from iop.node.runs import RunManager, RunRelay, encoded
from iop.node.store import stored_event
from iop.node.tunnels import TunnelManager
from iop.node.work import Inflight
from iop.protocols import messages
from iop.protocols.convert import event_to_wire
from iop.protocols.wire import (
    DRAINING_WIRE_VERSION,
    RECONCILE_WIRE_VERSION,
    WIRE_VERSION,
    FrameTooLarge,
    Heartbeat,
    IWireReceiver,
    ProtocolViolation,
    WireProtocol,
    peer_wire_version,
)
from iop.run import (
    CANCELLED,
    ERROR,
    FAILED,
    NODE_DISCONNECTED,
    NOT_SUPPORTED,
    REFRESH_REFUSED,
    UNKNOWN_ADAPTER,
    UNKNOWN_RUN,
    UNKNOWN_SESSION,
    RunEventData,
    RunFailure,
)
from iop.tlserrors import tls_failure


class RetryableRefusal(Exception):
    """
    This attempt failed, but another one may succeed: a duplicate
    connection, no answer in time, the connection lost mid-handshake, a
    refused ready.
    """


class FatalRefusal(Exception):
    """
    Retrying cannot help: the Edge does not know the token, could not
    build this Node's configuration, cannot serve its wire version, or an
    adapter it configured cannot be built here.
    """


class IncompatibleVersion(FatalRefusal):
    """
    The Edge cannot serve this Node's wire version. Fatal like a bad
    token, but the cure is different (upgrade one side), so the process
    ends with its own exit status.
    """


_FATAL_CODES = {messages.UNKNOWN_TOKEN, messages.CONFIG_BUILD_FAILED}


def _refusal(response: Message) -> "RetryableRefusal | FatalRefusal":
    """
    The exception for a C{RegisterResponse(accepted=false)}.
    """
    code = messages.reject_code_name(response.code)
    text = f"registration refused ({code}): {response.reason or 'no reason given'}"
    if response.code == messages.INCOMPATIBLE_VERSION:
        return IncompatibleVersion(f"{text} (this node speaks wire version {WIRE_VERSION})")
    if response.code in _FATAL_CODES:
        return FatalRefusal(text)
    return RetryableRefusal(text)


# Session states, in order.
CONNECTING = "connecting"
REGISTERING = "registering"
CONFIGURING = "configuring"
READYING = "readying"
READY = "ready"
REFUSED = "refused"
CLOSED = "closed"


@implementer(IWireReceiver)
class NodeSession:
    """
    @ivar ready: fires with this session once the Edge answered
        C{NodeReadyResponse(ready=true)}; fails with L{RetryableRefusal} or
        L{FatalRefusal}. Fires exactly once.
    @ivar lost: fires with a one-line reason once the connection is gone.
    @ivar node_id: the id the Edge assigned, once registered.
    @ivar edge_wire_version: the wire version the Edge declared when it
        accepted this session (1 when it declared none); C{None} before.
    @ivar edge_draining: the Edge's C{EdgeDraining} message once it said
        it is shutting down, else C{None}; the supervisor then expects the
        connection to close.
    """

    log = Logger()

    def __init__(self, context: NodeContext) -> None:
        self.context = context
        self.ready: Deferred[NodeSession] = defer.Deferred()
        self.lost: Deferred[str] = defer.Deferred()
        self.state = CONNECTING
        self.wire: WireProtocol | None = None
        self.node_id: str | None = None
        self.edge_wire_version: int | None = None
        self.edge_draining: Message | None = None
        self.inflight = Inflight()
        self.runs = RunManager(
            context.host, self.inflight, self.send, context.store, context.usage, context.metrics, context.owners
        )
        self.tunnels = TunnelManager(
            context.host, self.inflight, self.send, context.usage, context.metrics, context.store
        )
        self.commands = CommandHandler(context, self.send)
        self._timer: IDelayedCall | None = None
        #: The configuration being applied (adapters started, session
        #: owners loaded) while the session is configuring, else C{None}.
        self._configuring: Deferred[None] | None = None
        self._closing = False
        self._drain: Drain | None = None
        self._handlers: dict[str, Callable[[Message], object]] = {
            "run_request": self.runs.start,
            "provider_tunnel_request": self.tunnels.start,
            "cancel_request": self._cancel,
            "node_command_request": self.commands.handle,
            "config_refresh": self._refresh,
            "edge_draining": self._on_edge_draining,
            "window_update": lambda message: self.inflight.grant(message.id, message.bytes),
            "run_resume": self._resume,
        }

    # -- IWireReceiver -------------------------------------------------------

    def wire_connected(self, wire: WireProtocol) -> None:
        self.wire = wire
        self.state = REGISTERING
        self.send(messages.register_request(self.context.token, WIRE_VERSION, self.context.node_version))
        self._expect("RegisterResponse")

    def message_received(self, kind: str, message: Message) -> None:
        if self.state == READY and kind in self._handlers:
            self._handlers[kind](message)
        elif self.state == REGISTERING and kind == "register_response":
            self._registered(message)
        elif self.state == READYING and kind == "node_ready_response":
            self._readied(message)
        elif self.state in (REFUSED, CLOSED) or kind == "edge_draining":
            # Nothing to drain before ready: the Edge closes, and the
            # attempt fails like any other.
            pass
        else:
            raise ProtocolViolation(f"{kind} is not acceptable while the session is {self.state}")

    def wire_lost(self, reason: Failure) -> None:
        previous, self.state = self.state, CLOSED
        self._cancel_timer()
        # The Edge forgets a pending link with its connection: an adapter
        # start still pending serves no one and must not hold the host.
        self._abandon_configuration()
        tls = tls_failure(reason)
        why = (self.wire.close_reason if self.wire is not None else None) or (
            f"the TLS handshake with the Edge failed: {tls}" if tls else reason.getErrorMessage()
        )
        if previous == READY:
            # An unexpected loss is logged by the supervisor with its retry.
            if self._closing:
                self.log.info("connection to the Edge closed: {why}", why=why)
            self.context.transport.connected = False
            self._keep_background_runs()
            # As the Edge ended them for its callers: node_disconnected.
            self.inflight.cancel_all("connection to the Edge lost", NODE_DISCONNECTED)
            self.commands.cancel_all()
        elif previous != REFUSED:
            self._settle(RetryableRefusal(f"connection lost during registration: {why}"))
        self.lost.callback(why)

    def _keep_background_runs(self) -> None:
        """
        The connection was lost (not closed by a local shutdown): the
        background runs go on without it, for the next Edge connection to
        take back (L{iop.node.detached}) — if this Edge could ever ask for
        them (wire version 4).
        """
        if self._closing or self._drain is not None or (self.edge_wire_version or 1) < RECONCILE_WIRE_VERSION:
            return
        kept = 0
        for work in self.inflight.works():
            # One that ended but whose rest still waits for credit goes
            # too: its rest is replayed from the store when resumed.
            if isinstance(work, RunRelay) and work.background:
                self.context.detached.keep(work)
                kept += 1
        if kept:
            self.log.info("{count} background run(s) go on without the Edge", count=kept)

    # -- sending -------------------------------------------------------------

    def send(self, message: Message) -> None:
        """
        Send one message on this connection; a no-op once it is gone (a
        terminal for work cancelled by the disconnect cannot be delivered).
        """
        if self.state == CLOSED or self.wire is None:
            return
        try:
            self.wire.send(message)
        except FrameTooLarge:
            self.log.failure("not sent: {kind} too large", kind=message.DESCRIPTOR.name)

    def drain(self, grace_sec: float, reason: str) -> Deferred[None]:
        """
        The Node is stopping: take no new work (it is refused with
        C{node_draining}), tell an Edge that understands it
        (C{NodeDraining}, wire version 2) so that it stops leasing this
        Node's providers, and let the work in flight end within
        C{grace_sec}; then cancel the rest. See L{Drain}.

        @return: a Deferred firing once nothing is in flight any more.
        """
        if self.state == READY and (self.edge_wire_version or 1) >= DRAINING_WIRE_VERSION:
            self.send(messages.node_draining(grace_sec, reason))
        self._drain = Drain(self.inflight, self.context.clock, grace_sec, reason)
        return self._drain.start()

    def hurry(self) -> None:
        """
        Cut a drain's grace period to zero (a second stop signal).
        """
        if self._drain is not None:
            self._drain.hurry()

    def shutdown(self, reason: str) -> None:
        """
        The Node is stopping: cancel every run and tunnel of this session,
        still telling the Edge while the connection is up.
        """
        self._closing = True
        self.inflight.cancel_all(reason)
        self.commands.cancel_all()

    def close(self) -> None:
        """
        Close the connection at once.
        """
        if self.wire is not None and self.state != CLOSED:
            # Every stream transport the wire runs on (TCP, TLS, a test's
            # loopback) can abort; ITransport does not say so.
            cast(ITCPTransport, self.wire.transport).abortConnection()

    # -- registration and readiness -------------------------------------------

    def _expect(self, what: str) -> None:
        timeout = self.context.register_timeout
        self._cancel_timer()
        self._timer = self.context.clock.callLater(timeout, self._timed_out, what, timeout)

    def _cancel_timer(self) -> None:
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None

    def _timed_out(self, what: str, timeout: float) -> None:
        self._timer = None
        self._refuse(RetryableRefusal(f"no {what} from the Edge within {timeout:g}s"))

    def _registered(self, response: Message) -> None:
        self._cancel_timer()
        if not response.accepted:
            self._refuse(_refusal(response))
            return
        config = response.config
        self.node_id = config.node_id
        # The "absent is version 1" rule reads the same in both directions.
        self.edge_wire_version = peer_wire_version(response)
        self.state = CONFIGURING
        self.log.info(
            "registered with the Edge as {node_id}; starting {count} adapter(s)",
            node_id=config.node_id,
            count=len(config.adapters),
        )
        self._adopt_heartbeat(config)
        # No run may be checked against the session owners before the run
        # store's are in: the ready waits for them.
        d = self.context.host.apply(config.adapters).addCallback(lambda _: self.context.owners.loaded())
        self._configuring = d
        timeout = self.context.configure_timeout
        self._timer = self.context.clock.callLater(timeout, self._configure_timed_out, timeout)
        d.addCallbacks(self._configured, self._config_failed)
        d.addErrback(lambda f: self.log.failure("registration step failed", f))

    def _configure_timed_out(self, timeout: float) -> None:
        """
        The configuration is not running in time (an adapter's C{start}
        hangs, or the run store's session owners do not come): without a
        deadline the Node would never be ready and never retry. Refuse the
        attempt as retryable (the next one may find the back end up), then
        abandon the apply, which leaves the host as it was.
        """
        self._timer = None
        what = self._not_started("the run store's session owners did not load")
        self._refuse(RetryableRefusal(f"configuration not running within {timeout:g}s (configure_timeout_sec): {what}"))
        self._abandon_configuration()

    def _not_started(self, otherwise: str = "the adapters did not start") -> str:
        """
        What holds a configuration that is late, for its operator: the
        adapters still starting, or C{otherwise}.
        """
        names = self.context.host.starting
        return f"adapter(s) {', '.join(names)} did not start" if names else otherwise

    def _abandon_configuration(self) -> None:
        """
        Cancel the apply under way, if any. Its end then finds the session
        refused or closed and does nothing more.
        """
        d, self._configuring = self._configuring, None
        if d is not None:
            d.cancel()

    def _configured(self, _: object) -> None:
        self._configuring = None
        if self.state != CONFIGURING:
            return
        self.state = READYING
        if (self.edge_wire_version or 1) >= RECONCILE_WIRE_VERSION:
            # Before the ready: the Edge takes their leases back before it
            # gives this node new work.
            self.send(self.context.detached.report())
        assert self.node_id is not None  # (set by the accepted registration)
        self.send(messages.ready_request(self.node_id))
        self._expect("NodeReadyResponse")

    def _config_failed(self, failure: Failure) -> None:
        self._configuring = None
        if self.state != CONFIGURING:
            # The attempt already ended (its deadline, a lost connection)
            # and was refused once: this is the abandoned apply ending.
            return
        if failure.check(AdapterSetupError):
            text = f"this node cannot run its configuration: {failure.value}"
        else:
            self.log.failure("applying the Edge's configuration failed", failure)
            text = f"applying the Edge's configuration failed: {failure.value}"
        self._refuse(FatalRefusal(text))

    def _readied(self, response: Message) -> None:
        self._cancel_timer()
        if not response.ready:
            self._refuse(RetryableRefusal(f"readiness refused: {response.reason or 'no reason given'}"))
            return
        self.state = READY
        transport = self.context.transport
        transport.node_id = self.node_id
        transport.connected = True
        transport.connected_since = self.context.now()
        self.log.info("node {node_id} is ready", node_id=self.node_id)
        self._drop_unclaimable_runs()
        self._settle(self)

    def _drop_unclaimable_runs(self) -> None:
        """
        Ready with an Edge older than wire version 4: it can never ask for
        the background runs kept from an earlier link (L{iop.node.detached}),
        and it does not know they hold their adapters' slots. They end now,
        as the Edge that waited for them ends them for their callers
        (C{node_disconnected}); else a run that does not end by itself
        would hold its slot, unreachable, for as long as the Node runs.
        """
        if (self.edge_wire_version or 1) >= RECONCILE_WIRE_VERSION or not len(self.context.detached):
            return
        self.log.info(
            "the Edge (wire version {version}) cannot take back {count} background run(s): ending them",
            version=self.edge_wire_version or 1,
            count=len(self.context.detached),
        )
        self.context.detached.cancel_all(
            "connection to the Edge lost; the Edge reconnected to cannot take background runs back", NODE_DISCONNECTED
        )

    def _refuse(self, error: Exception) -> None:
        """
        End the handshake with C{error} and close the connection.
        """
        if self.state in (REFUSED, CLOSED):
            return
        self._cancel_timer()
        self.state = REFUSED
        self._settle(error)
        if self.wire is not None:
            self.wire.drop(str(error))

    def _settle(self, outcome: "NodeSession | Exception") -> None:
        if self.ready.called:
            return
        if isinstance(outcome, Exception):
            self.ready.errback(outcome)
        else:
            self.ready.callback(outcome)

    def _adopt_heartbeat(self, config: Message) -> None:
        """
        Take the Edge's heartbeat timings (zero means "keep the default").
        """
        assert self.wire is not None, "the heartbeat comes after the connection"
        current = self.wire.heartbeat
        heartbeat = Heartbeat(
            interval=config.heartbeat_interval_sec or current.interval,
            timeout=config.heartbeat_timeout_sec or current.timeout,
        )
        if heartbeat != current:
            self.wire.set_heartbeat(heartbeat)
        self.context.transport.heartbeat = heartbeat

    # -- after ready -------------------------------------------------------------

    def _cancel(self, request: Message) -> None:
        if request.kind == messages.TERMINATE_SESSION:
            self._terminate_session(request)
        elif request.kind == messages.CANCEL_COMMAND:
            self.commands.cancel(request.request_id)
        elif not self.inflight.cancel(request.run_id) and not self.context.detached.cancel(
            request.run_id,
            request.error_message or "the Edge did not take it back",
            request.error_code or CANCELLED,
        ):
            self.log.debug("cancel for {run_id}, which is not in flight: ignored", run_id=request.run_id)

    def _resume(self, message: Message) -> None:
        """
        The Edge takes a background run back (L{iop.node.detached}): it
        becomes this session's, and its events after the Edge's last one
        are sent from the store, then the live ones. A run that ended
        meanwhile ends with the terminal the relay kept when the store
        lacks it (L{iop.node.runs.Resumed}); a stored event that cannot be
        sent is left out, logged, and the rest still go.
        """
        relay = self.context.detached.take(message.run_id)
        if relay is None:
            failure = RunFailure(UNKNOWN_RUN, f"this node no longer has run {message.run_id}")
            self.send(event_to_wire(message.run_id, message.after_seq + 1, RunEventData(ERROR, error=failure)))
            return
        self.log.info(
            "background run {run_id} taken back by the Edge after event {seq}",
            run_id=relay.run_id,
            seq=message.after_seq,
        )
        resumed = relay.attach(self.runs, message.after_seq)
        d = defer.maybeDeferred(self.context.store.get, message.run_id, message.after_seq)

        def history(found: dict[str, Any] | None) -> list[Message]:
            sent = []
            for e in (found or {}).get("events", []):
                try:
                    sent.append(encoded(message.run_id, e["seq"], stored_event(e))[0])
                except Exception:
                    self.log.failure("run {run_id}: stored event {e!r} cannot be sent", run_id=message.run_id, e=e)
            return sent

        def unreadable(failure: Failure) -> list[Message]:
            self.log.failure("run {run_id}: its events could not be read back", failure, run_id=message.run_id)
            return []

        events = d.addCallbacks(history, unreadable)
        events.addCallback(resumed.replay)
        events.addErrback(lambda f: self.log.failure("resuming run {run_id} failed", f, run_id=message.run_id))

    def _terminate_session(self, request: Message) -> None:
        """
        End a logical session and say truthfully how it went: done, the
        adapter knew no such session (C{unknown_session}), the adapter
        keeps no sessions (C{not_supported}), no such adapter, or failed.
        A session of another caller key than C{request.caller} (when the
        Edge names one) is answered exactly as one the adapter does not
        know, and the adapter is not asked: a caller learns nothing of
        other keys' sessions.
        """

        def answer(ok: bool, reason: str = "", code: str = "") -> None:
            self.send(messages.cancel_response(request.request_id, ok, reason, code))

        hosted = self.context.host.get(request.adapter)
        if hosted is None:
            answer(False, f"no adapter named {request.adapter!r} on this node", UNKNOWN_ADAPTER)
            return
        unknown = f"adapter {hosted.name} has no session {request.session_id!r}"
        if hosted.adapter.capabilities().sessions and not self.context.owners.owned_by(
            hosted.name, request.session_id, request.caller
        ):
            answer(False, unknown, UNKNOWN_SESSION)
            return
        d = defer.maybeDeferred(hosted.adapter.terminate_session, request.target, request.session_id)

        def done(result: object) -> None:
            if isinstance(result, dict) and result.get("terminated") is False:
                answer(False, unknown, UNKNOWN_SESSION)
            else:
                answer(True)

        def failed(failure: Failure) -> None:
            if failure.check(NotSupported):
                detail = str(failure.value) or f"adapter {hosted.name} does not support sessions"
                answer(False, f"not supported: {detail}", NOT_SUPPORTED)
            else:
                self.log.failure("terminating session {session_id} failed", failure, session_id=request.session_id)
                answer(False, f"terminating the session failed: {failure.value}", FAILED)

        d.addCallbacks(done, failed)
        d.addErrback(lambda f: self.log.failure("answering terminate-session failed", f))

    def _on_edge_draining(self, message: Message) -> None:
        self.edge_draining = message
        self.log.info(
            "the Edge is draining ({reason}, grace {grace:g}s); it sends no new work",
            grace=message.grace_sec,
            reason=message.reason or "no reason given",
        )

    def _refresh(self, message: Message) -> None:
        """
        Apply a configuration refresh (all or nothing: a refused one leaves
        the running adapters as they were) and, when the Edge asks for it,
        say which happened.
        """
        config = message.config
        self._adopt_heartbeat(config)
        names = [a.name for a in config.adapters]
        d = self.context.host.apply(config.adapters)
        # The same deadline as at registration: a start that hangs would
        # hold the host (and so every later registration) for ever.
        timeout = self.context.configure_timeout
        late: list[str] = []

        def timed_out() -> None:
            # (Read before the cancel: the host forgets what was starting.)
            late.append(f"refresh not running within {timeout:g}s (configure_timeout_sec): {self._not_started()}")
            d.cancel()

        timer = self.context.clock.callLater(timeout, timed_out)

        def settled(result: object) -> object:
            if timer.active():
                timer.cancel()
            return result

        def applied(_: object) -> Message:
            self.log.info("configuration refreshed ({count} adapter(s))", count=len(names))
            return messages.command_result(message.request_id, json.dumps({"applied": names}))

        def refused(failure: Failure) -> Message:
            why = late[0] if late else failure.getErrorMessage()
            if not late and not failure.check(AdapterSetupError):
                self.log.failure("applying a configuration refresh failed", failure)
            self.log.error("configuration refresh refused, keeping the previous adapters: {why}", why=why)
            return messages.command_error(message.request_id, REFRESH_REFUSED, why)

        d.addBoth(settled).addCallbacks(applied, refused)
        if message.request_id:
            d.addCallback(self.send)
        d.addErrback(lambda f: self.log.failure("answering a configuration refresh failed", f))
