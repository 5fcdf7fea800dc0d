"""
Keeping one Node connected to its Edge.

One supervisor handles both a failed first dial or registration and the
loss of an established session, with one policy (C{node.yaml}
C{reconnect}): an interval between attempts (jittered, so a fleet that
lost its Edge at once does not redial in one instant), and either no limit
or a limit on consecutive failed attempts. An attempt succeeds only when the
session is ready (registered, configured, acknowledged), and only that
resets the count. A fatal refusal from the Edge ends the process at once.

It is built on C{ClientService} for dialling and waiting, but the
handshake is not C{ClientService}'s C{prepareConnection}: when that fails,
C{ClientService} leaves the connection open, and when the connection then
closes it raises C{automat.NoTransition} out of C{connectionLost} (checked
with Twisted 26.10), and a late close can be mistaken for the loss of a
newer connection. So every TCP connection counts as "connected" to
C{ClientService}; a failed handshake closes its connection, which
C{ClientService} sees as a disconnect, and the supervisor counts attempts
itself.
"""

from collections.abc import Callable
from random import Random

from twisted.application.internet import ClientService
from twisted.application.service import Service
from twisted.internet import defer
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import (
    IDelayedCall,
    IProtocol,
    IProtocolFactory,
    IReactorTime,
    IStreamClientEndpoint,
)
from twisted.logger import ILogObserver, LogEvent, Logger, globalLogPublisher
from twisted.python.failure import Failure
from zope.interface import implementer, provider

from iop.node.config import ReconnectPolicy
from iop.node.context import NodeContext
from iop.node.edges import EdgeRotation
from iop.node.exit import EXIT_EXHAUSTED, EXIT_INCOMPATIBLE, EXIT_REFUSED, Exit
from iop.node.session import FatalRefusal, IncompatibleVersion, NodeSession
from iop.protocols.wire import WireFactory

#: How long a local shutdown waits for the connection to close cleanly
#: before aborting it.
STOP_TIMEOUT_SEC = 5.0


@provider(ILogObserver)
def _without_retry_notices(event: LogEvent) -> None:
    # ClientService logs its own "Scheduling retry N" line with a count
    # that is not ours; the supervisor logs the real one.
    if not str(event.get("log_format", "")).startswith("Scheduling retry"):
        globalLogPublisher(event)


class _QuietClientService(ClientService):
    _log = Logger(namespace="twisted.application.internet.ClientService", observer=_without_retry_notices)


@implementer(IStreamClientEndpoint)
class _ObservedEndpoint:
    """
    An endpoint that reports why a dial failed before C{ClientService}
    sees the failure (its retry policy is told only the count).
    """

    def __init__(self, endpoint: IStreamClientEndpoint, on_failure: Callable[[str], object]) -> None:
        self._endpoint = endpoint
        self._on_failure = on_failure

    def connect(self, factory: IProtocolFactory) -> "Deferred[IProtocol]":
        d = self._endpoint.connect(factory)
        d.addErrback(self._failed)
        return d

    def _failed(self, failure: Failure) -> Failure:
        if not failure.check(defer.CancelledError):
            self._on_failure((failure.getErrorMessage() or type(failure.value).__name__).rstrip("."))
        return failure


class Supervisor(Service):
    """
    @param endpoint: an C{IStreamClientEndpoint} for the Edge, or an
        L{EdgeRotation} of several (an Edge cluster): after every failed
        attempt and every lost session the next one is dialled.
    @param context: the L{iop.node.context.NodeContext} sessions share.
    @param policy: the L{iop.node.config.ReconnectPolicy}.
    @param exit: C{exit(status, message)}, called once when the Node must
        end (L{iop.node.exit.ProcessExit} in the daemon, a recorder in tests).
    @param random: the L{random.Random} the pauses between attempts are
        drawn from (C{policy.jitter}); a new one by default.

    @ivar session: the current L{NodeSession}, if a connection is up.
    @ivar ready_session: the current session if it is ready, else C{None}.
    @ivar failures: consecutive failed attempts (reset by a ready session).
    """

    log = Logger()

    def __init__(
        self,
        endpoint: IStreamClientEndpoint,
        context: NodeContext,
        policy: ReconnectPolicy,
        reactor: IReactorTime,
        exit: Exit,
        random: Random | None = None,
    ) -> None:
        #: Several Edges (L{EdgeRotation}), tried in turn; else C{None}.
        self.edges = endpoint if isinstance(endpoint, EdgeRotation) and len(endpoint) > 1 else None
        if self.edges is not None:
            context.transport.edge = self.edges.current
        self.context = context
        self.policy = policy
        self.reactor = reactor
        self.exit = exit
        self.random = random if random is not None else Random()
        self.session: NodeSession | None = None
        self.ready_session: NodeSession | None = None
        self.failures = 0
        self.finished = False
        self._last_failure: str | None = None
        self._session_was_ready = False
        self._edge_drained = False
        self._ready_waiters: list[Deferred[NodeSession]] = []
        factory = WireFactory(self._new_session, reactor)
        factory.noisy = False
        self.client = _QuietClientService(
            _ObservedEndpoint(endpoint, self._attempt_failed),
            factory,
            retryPolicy=self._retry_delay,
            clock=reactor,
        )

    # -- service ---------------------------------------------------------------

    def startService(self) -> None:
        super().startService()
        self.log.info("connecting to the Edge at {edge}", edge=self.context.transport.edge)
        self.client.startService()

    def drain(self, grace_sec: float, reason: str) -> Deferred[None]:
        """
        The first step of a local shutdown: stop counting attempts and
        let the ready session's work end within C{grace_sec}
        (L{NodeSession.drain}). Call L{stopService} once it is done.

        No reconnect can happen meanwhile: the connection stays up, and if
        it drops, the work in flight is cancelled with it, the drain is
        over at once, and L{stopService} cancels the pending retry.

        @return: a Deferred firing once the drain is over (at once without
            a ready session).
        """
        self.finished = True
        if self.ready_session is None:
            return defer.succeed(None)
        return self.ready_session.drain(grace_sec, reason)

    def hurry(self) -> None:
        """
        Cut the drain's grace period to zero.
        """
        if self.ready_session is not None:
            self.ready_session.hurry()

    def stopService(self) -> Deferred[None]:
        """
        Cancel in-flight work (telling the Edge while the link is up),
        close the connection and stop retrying.

        @return: a Deferred firing once the connection is really gone.
        """
        super().stopService()
        self.finished = True
        session = self.session
        if session is not None:
            session.shutdown("the node is shutting down")
        # Background runs kept from a lost link end with the Node.
        self.context.detached.cancel_all("the node is shutting down")
        d = self.client.stopService()
        if session is not None:
            # A peer that stopped reading must not hold the shutdown up.
            aborter = self.reactor.callLater(STOP_TIMEOUT_SEC, session.close)
            d.addBoth(_cancelling, aborter)
        for waiter in list(self._ready_waiters):
            waiter.cancel()
        return d

    def when_ready(self) -> Deferred[NodeSession]:
        """
        @return: a Deferred firing with the ready L{NodeSession}: the
            current one, or the next one to become ready.
        """
        if self.ready_session is not None:
            return defer.succeed(self.ready_session)
        d: Deferred[NodeSession] = Deferred(self._ready_waiters.remove)
        self._ready_waiters.append(d)
        return d

    # -- one attempt -------------------------------------------------------------

    def _new_session(self) -> NodeSession:
        self.context.transport.attempts += 1
        session = NodeSession(self.context)
        self.session = session
        self._session_was_ready = False
        session.ready.addCallbacks(self._ready, self._refused)
        session.lost.addCallback(self._lost, session)
        return session

    def _ready(self, session: NodeSession) -> None:
        self.ready_session = session
        self.failures = 0
        self._session_was_ready = True
        self.context.transport.failures = 0
        self.context.transport.sessions += 1
        waiters, self._ready_waiters = self._ready_waiters, []
        for waiter in waiters:
            waiter.callback(session)

    def _refused(self, failure: Failure) -> None:
        if failure.check(IncompatibleVersion):
            self._finish(EXIT_INCOMPATIBLE, f"the Edge cannot serve this node's wire version: {failure.value}")
        elif failure.check(FatalRefusal):
            self._finish(EXIT_REFUSED, f"the Edge refused this node: {failure.value}")
        else:
            self._attempt_failed(str(failure.value))

    def _lost(self, why: str, session: NodeSession) -> None:
        if self.session is session:
            self.session = None
        if self.ready_session is session:
            self.ready_session = None
        if self._session_was_ready:
            self._edge_drained = session.edge_draining is not None
            self._last_failure = (
                f"connection to the Edge {'closed' if self._edge_drained else 'lost'}: {why.rstrip('.')}"
            )

    def _attempt_failed(self, why: str) -> None:
        self._last_failure = why

    # -- the policy ----------------------------------------------------------------

    def _retry_delay(self, _client_service_count: int) -> float:
        """
        C{ClientService}'s retry policy: called once per failed attempt or
        lost session. Counts, logs, and decides whether to go on.
        """
        delay = self.policy.delay(self.random.uniform)
        why, self._last_failure = self._last_failure or "unknown reason", None
        if self.finished:
            return delay
        where = self._move_on()
        if self._session_was_ready:
            # Losing a ready session is not a failed attempt.
            self._session_was_ready = False
            if self._edge_drained:
                self.log.info(
                    "the Edge was draining; {why}; reconnecting in {delay:g}s{where}", why=why, delay=delay, where=where
                )
            else:
                self.log.warn("{why}; reconnecting in {delay:g}s{where}", why=why, delay=delay, where=where)
            return delay
        self.failures += 1
        self.context.transport.failures = self.failures
        if self.policy.exhausted(self.failures):
            self.log.error("connect attempt {n} failed: {why}", n=self.failures, why=why)
            self._finish(
                EXIT_EXHAUSTED,
                f"giving up on the Edge at {self._edge_names()}: "
                f"{self.failures} consecutive connect attempts failed (last: {why})",
            )
            return delay
        self.log.warn(
            "connect attempt {n} failed: {why}; retrying in {delay:g}s{where}",
            n=self.failures,
            why=why,
            delay=delay,
            where=where,
        )
        return delay

    def _move_on(self) -> str:
        """
        With several Edges, dial the next one from now on.

        @return: a few words for the log line saying where (empty with one
            Edge).
        """
        if self.edges is None:
            return ""
        self.context.transport.edge = self.edges.move_on()
        return f" at {self.edges.current}"

    def _edge_names(self) -> str:
        if self.edges is None:
            return self.context.transport.edge
        return ", ".join(description for description, _ in self.edges.endpoints)

    def _finish(self, status: int, message: str) -> None:
        """
        End the Node. Scheduled rather than called in place: stopping
        C{ClientService} from inside its own retry policy is re-entrant.
        """
        if self.finished:
            return
        self.finished = True
        self.reactor.callLater(0, self.exit, status, message)


def _cancelling(result: object, call: IDelayedCall) -> object:
    if call.active():
        call.cancel()
    return result
