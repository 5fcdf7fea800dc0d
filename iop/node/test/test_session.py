"""
Registration and readiness from the Node's side: what makes the handshake
succeed, which refusals are fatal and which retryable, and what a session
accepts in which state.
"""

from twisted.internet.task import Clock
from twisted.logger import capturedLogs
from twisted.trial.unittest import SynchronousTestCase

from iop.node.host import AdapterHost
from iop.node.session import READY, FatalRefusal, IncompatibleVersion, RetryableRefusal
from iop.node.test.fakes import (
    TOKEN,
    FakeEdge,
    accepted,
    adapterConfig,
    build,
    connect,
    makeContext,
    nodeConfig,
    readyNode,
    runRequest,
)
from iop.protocols import iop_pb2
from iop.protocols.wire import WIRE_VERSION, Heartbeat


def refused(code, reason="nope"):
    return iop_pb2.RegisterResponse(accepted=False, code=code, reason=reason)


READY_OK = iop_pb2.NodeReadyResponse(ready=True)


class HandshakeTests(SynchronousTestCase):
    def test_acceptedRegistrationStartsAdaptersThenSendsReady(self):
        """
        The Node sends its token, starts the adapters from the Edge's
        config before declaring itself ready with the assigned node id, and
        the handshake fires with the session once the Edge says ready.
        """
        context = makeContext()
        edge = FakeEdge(accepted(nodeConfig(adapterConfig("a"), adapterConfig("b"))), READY_OK)
        session, pump = connect(context, edge)
        pump.flush()

        self.assertEqual(edge.kinds(), ["register_request", "node_ready_request"])
        self.assertEqual(edge.of("register_request")[0].token, TOKEN)
        self.assertEqual(edge.of("node_ready_request")[0].node_id, "node-1")
        self.assertIs(self.successResultOf(session.ready), session)
        self.assertEqual(session.state, READY)
        self.assertEqual(sorted(h.name for h in context.host.all()), ["a", "b"])
        self.assertTrue(all(h.adapter.started == 1 for h in context.host.all()))
        self.assertTrue(context.transport.connected)
        self.assertEqual(context.transport.node_id, "node-1")

    def test_readyIsSentOnlyAfterAdaptersStarted(self):
        """
        While an adapter's C{start} is still pending, the Node does not
        declare itself ready.
        """
        from twisted.internet import defer

        pending = defer.Deferred()
        context = makeContext()
        edge = FakeEdge(accepted(nodeConfig(adapterConfig("slow"))), READY_OK)

        original = build

        def slowBuild(*args):
            adapter = original(*args)
            adapter.start = lambda: pending
            return adapter

        context.host = AdapterHost(context.clock, slowBuild)
        session, pump = connect(context, edge)
        pump.flush()
        self.assertEqual(edge.kinds(), ["register_request"])
        self.assertNoResult(session.ready)
        pending.callback(None)
        pump.flush()
        self.assertEqual(edge.kinds(), ["register_request", "node_ready_request"])
        self.successResultOf(session.ready)

    def test_unknownTokenIsFatal(self):
        """
        C{UNKNOWN_TOKEN} fails the handshake with L{FatalRefusal} naming
        the code and the Edge's reason, and closes the connection.
        """
        edge = FakeEdge(refused(iop_pb2.UNKNOWN_TOKEN, "token matches no node"))
        session, pump = connect(makeContext(), edge)
        pump.flush()
        failure = self.failureResultOf(session.ready, FatalRefusal)
        self.assertIn("UNKNOWN_TOKEN", str(failure.value))
        self.assertIn("token matches no node", str(failure.value))
        self.assertIsNotNone(edge.lostReason)
        self.successResultOf(session.lost)

    def test_wire_version_declared(self):
        """
        The Node's RegisterRequest declares the wire version it speaks.
        """
        edge = FakeEdge()
        connect(makeContext(), edge)[1].flush()
        self.assertEqual(edge.of("register_request")[0].wire_version, WIRE_VERSION)

    def test_edge_wire_version_remembered(self):
        """
        The Edge's wire version comes from the accepted RegisterResponse;
        an Edge that declares none is version 1.
        """
        for declared, expected in [(2, 2), (0, 1)]:
            response = accepted(nodeConfig())
            response.wire_version = declared
            session, pump = connect(makeContext(), FakeEdge(response, READY_OK))
            pump.flush()
            self.assertEqual(session.edge_wire_version, expected)

    def test_incompatible_version_is_fatal(self):
        """
        C{INCOMPATIBLE_VERSION} fails the handshake with
        L{IncompatibleVersion} (a L{FatalRefusal}) naming the code, the
        Edge's reason and the version this Node speaks.
        """
        edge = FakeEdge(refused(iop_pb2.INCOMPATIBLE_VERSION, "this edge serves wire versions 1 to 1"))
        session, pump = connect(makeContext(), edge)
        pump.flush()
        failure = self.failureResultOf(session.ready, IncompatibleVersion)
        self.assertIsInstance(failure.value, FatalRefusal)
        message = str(failure.value)
        self.assertIn("INCOMPATIBLE_VERSION", message)
        self.assertIn("serves wire versions 1 to 1", message)
        self.assertIn(f"speaks wire version {WIRE_VERSION}", message)
        self.assertIsNotNone(edge.lostReason)

    def test_configBuildFailureIsFatal(self):
        """
        C{CONFIG_BUILD_FAILED} is fatal too: retrying would get the same
        configuration.
        """
        edge = FakeEdge(refused(iop_pb2.CONFIG_BUILD_FAILED))
        session, pump = connect(makeContext(), edge)
        pump.flush()
        self.failureResultOf(session.ready, FatalRefusal)

    def test_duplicateConnectionIsRetryable(self):
        """
        C{DUPLICATE_CONNECTION} (another live connection owns the node) is
        worth retrying: L{RetryableRefusal}.
        """
        edge = FakeEdge(refused(iop_pb2.DUPLICATE_CONNECTION, "node-1 already connected"))
        session, pump = connect(makeContext(), edge)
        pump.flush()
        failure = self.failureResultOf(session.ready, RetryableRefusal)
        self.assertIn("DUPLICATE_CONNECTION", str(failure.value))
        self.assertIsNotNone(edge.lostReason)

    def test_adapterBuildFailureIsFatal(self):
        """
        An adapter the Node cannot build from the Edge's config is fatal,
        names the adapter and the problem, and no ready is sent.
        """
        edge = FakeEdge(accepted(nodeConfig(adapterConfig("good"), adapterConfig("bad", type="broken"))), READY_OK)
        context = makeContext()
        session, pump = connect(context, edge)
        pump.flush()
        failure = self.failureResultOf(session.ready, FatalRefusal)
        self.assertIn("adapter bad", str(failure.value))
        self.assertIn("base_url is required", str(failure.value))
        self.assertEqual(edge.kinds(), ["register_request"])
        self.assertEqual(context.host.all(), [])

    def test_readyRefusedIsRetryable(self):
        """
        C{NodeReadyResponse(ready=false)} (a stale connection) is retryable.
        """
        edge = FakeEdge(accepted(nodeConfig()), iop_pb2.NodeReadyResponse(ready=False, reason="stale"))
        session, pump = connect(makeContext(), edge)
        pump.flush()
        failure = self.failureResultOf(session.ready, RetryableRefusal)
        self.assertIn("stale", str(failure.value))

    def test_registerTimeout(self):
        """
        A RegisterRequest with no answer within C{register_timeout} fails
        the attempt (retryable) and closes the connection.
        """
        context = makeContext(register_timeout=10)
        edge = FakeEdge()
        session, pump = connect(context, edge)
        pump.flush()
        context.clock.advance(9.9)
        self.assertNoResult(session.ready)
        context.clock.advance(0.2)
        pump.flush()
        failure = self.failureResultOf(session.ready, RetryableRefusal)
        self.assertIn("no RegisterResponse from the Edge within 10s", str(failure.value))
        self.assertIsNotNone(edge.lostReason)

    def test_readyTimeout(self):
        """
        The ready request has its own timeout, started when it is sent.
        """
        context = makeContext(register_timeout=3)
        edge = FakeEdge(accepted(nodeConfig()))
        session, pump = connect(context, edge)
        pump.flush()
        context.clock.advance(3)
        failure = self.failureResultOf(session.ready, RetryableRefusal)
        self.assertIn("NodeReadyResponse", str(failure.value))

    def test_connectionLostDuringHandshakeIsRetryable(self):
        """
        Losing the connection before ready fails the handshake with
        L{RetryableRefusal}, and C{lost} fires.
        """
        edge = FakeEdge()
        session, pump = connect(makeContext(), edge)
        pump.flush()
        edge.wire.transport.loseConnection()
        pump.flush()
        failure = self.failureResultOf(session.ready, RetryableRefusal)
        self.assertIn("connection lost during registration", str(failure.value))
        self.successResultOf(session.lost)

    def test_workBeforeReadyIsAProtocolViolation(self):
        """
        A run request before the session is ready closes the connection:
        the Edge must not send work to a pending connection.
        """
        edge = FakeEdge()
        session, pump = connect(makeContext(), edge)
        pump.flush()
        edge.wire.send(runRequest())
        pump.flush()
        self.assertIsNotNone(edge.lostReason)
        self.assertIn("run_request is not acceptable", session.wire.closeReason)
        self.failureResultOf(session.ready, RetryableRefusal)

    def test_edge_draining_recorded_when_ready(self):
        """
        C{EdgeDraining} to a ready session is recorded on it (for the
        supervisor) and the connection stays up.
        """
        session, edge, pump, context = readyNode()
        edge.wire.send(iop_pb2.EdgeDraining(grace_sec=15, reason="edge restarting"))
        pump.flush()
        self.assertEqual((session.edge_draining.grace_sec, session.edge_draining.reason), (15, "edge restarting"))
        self.assertIsNone(edge.lostReason)

    def test_edge_draining_before_ready_ignored(self):
        """
        C{EdgeDraining} during the handshake is ignored harmlessly: not a
        protocol violation, and the handshake goes on.
        """
        edge = FakeEdge()
        session, pump = connect(makeContext(), edge)
        pump.flush()
        edge.wire.send(iop_pb2.EdgeDraining(grace_sec=15))
        edge.wire.send(accepted(nodeConfig()))
        pump.flush()
        self.assertIsNone(edge.lostReason)
        self.assertIsNone(session.edge_draining)
        self.assertEqual(edge.kinds(), ["register_request", "node_ready_request"])

    def test_heartbeatTimingsFromTheEdge(self):
        """
        Non-zero heartbeat timings in the config replace the defaults on
        this connection; zero keeps the default.
        """
        context = makeContext()
        edge = FakeEdge(accepted(nodeConfig(interval=1.5, timeout=0)), READY_OK)
        session, pump = connect(context, edge)
        pump.flush()
        self.assertEqual(session.wire.heartbeat, Heartbeat(interval=1.5, timeout=5.0))
        self.assertEqual(context.transport.heartbeat, Heartbeat(interval=1.5, timeout=5.0))

    def test_tokenNeverLogged(self):
        """
        Neither the handshake's log lines nor the context's repr contain
        the token.
        """
        with capturedLogs() as events:
            readyNode()
            edge = FakeEdge(refused(iop_pb2.UNKNOWN_TOKEN))
            session, pump = connect(makeContext(), edge)
            pump.flush()
            self.failureResultOf(session.ready)
        self.assertTrue(events)
        for event in events:
            self.assertNotIn(TOKEN, repr(event))
        self.assertNotIn(TOKEN, repr(makeContext()))


class AdapterLifetimeTests(SynchronousTestCase):
    def test_adaptersKeptAcrossReconnects(self):
        """
        A reconnect with the same adapter configuration keeps the running
        instances (not rebuilt, not restarted).
        """
        clock = Clock()
        session, edge, pump, context = readyNode(clock=clock)
        first = context.host.get("manual").adapter
        edge.wire.transport.loseConnection()
        pump.flush()

        edge2 = FakeEdge(accepted(nodeConfig(adapterConfig("manual"))), READY_OK)
        session2, pump2 = connect(context, edge2)
        pump2.flush()
        self.successResultOf(session2.ready)
        self.assertIs(context.host.get("manual").adapter, first)
        self.assertEqual(first.started, 1)
        self.assertEqual(first.stopped, 0)

    def test_changedAdapterRebuilt(self):
        """
        A reconnect whose config changes an adapter's options rebuilds that
        adapter (and stops the old instance) but keeps the unchanged one.
        """
        session, edge, pump, context = readyNode(adapterConfig("a"), adapterConfig("b"))
        a, b = context.host.get("a").adapter, context.host.get("b").adapter
        edge.wire.transport.loseConnection()
        pump.flush()

        edge2 = FakeEdge(accepted(nodeConfig(adapterConfig("a"), adapterConfig("b", delay=1))), READY_OK)
        session2, pump2 = connect(context, edge2)
        pump2.flush()
        self.successResultOf(session2.ready)
        self.assertIs(context.host.get("a").adapter, a)
        self.assertIsNot(context.host.get("b").adapter, b)
        self.assertEqual(b.stopped, 1)
        self.assertEqual(context.host.get("b").adapter.options, {"delay": 1})

    def test_configRefresh(self):
        """
        A ConfigRefresh to a ready node adds, changes and removes adapters
        through the same path as registration.
        """
        session, edge, pump, context = readyNode(adapterConfig("a"), adapterConfig("gone"))
        gone = context.host.get("gone").adapter
        edge.wire.send(
            iop_pb2.ConfigRefresh(config=nodeConfig(adapterConfig("a"), adapterConfig("new", max_concurrency=7)))
        )
        pump.flush()
        self.assertEqual(sorted(h.name for h in context.host.all()), ["a", "new"])
        self.assertEqual(context.host.get("new").gate.limit, 7)
        self.assertEqual(gone.stopped, 1)

    def test_badConfigRefreshKeepsPreviousAdapters(self):
        """
        A refresh with an adapter that cannot be built changes nothing and
        keeps the connection.
        """
        session, edge, pump, context = readyNode(adapterConfig("a"))
        a = context.host.get("a").adapter
        edge.wire.send(iop_pb2.ConfigRefresh(config=nodeConfig(adapterConfig("b", type="broken"))))
        pump.flush()
        self.assertIs(context.host.get("a").adapter, a)
        self.assertIsNone(context.host.get("b"))
        self.assertIsNone(edge.lostReason)
        self.flushLoggedErrors()
