"""
Registration and readiness from the Node's side: what makes the handshake
succeed, which refusals are fatal and which retryable, and what a session
accepts in which state.
"""

import json

from OpenSSL import SSL
from twisted.internet.task import Clock
from twisted.logger import capturedLogs
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase

from iop.node.host import AdapterHost
from iop.node.session import READY, FatalRefusal, IncompatibleVersion, RetryableRefusal
from iop.protocols import messages
from iop.protocols.wire import WIRE_VERSION, Heartbeat
from iop.testing.node import (
    TOKEN,
    FakeEdge,
    accepted,
    adapter_config,
    build,
    connect,
    hosted,
    make_context,
    manual,
    node_config,
    ready_node,
    run_request,
    session_wire,
)


def refused(code, reason="nope"):
    return messages.register_refused(code, reason)


READY_OK = messages.ready_response(ready=True)


class HandshakeTests(SynchronousTestCase):
    def test_accepted_registration_starts_adapters_then_sends_ready(self):
        """
        The Node sends its token, starts the adapters from the Edge's
        config before declaring itself ready with the assigned node id, and
        the handshake fires with the session once the Edge says ready.
        """
        context = make_context()
        edge = FakeEdge(accepted(node_config(adapter_config("a"), adapter_config("b"))), READY_OK)
        session, pump = connect(context, edge)
        pump.flush()

        self.assertEqual(edge.kinds(), ["register_request", "run_reconcile", "node_ready_request"])
        self.assertEqual(edge.of("register_request")[0].token, TOKEN)
        self.assertEqual(edge.of("node_ready_request")[0].node_id, "node-1")
        self.assertIs(self.successResultOf(session.ready), session)
        self.assertEqual(session.state, READY)
        self.assertEqual(sorted(h.name for h in context.host.all()), ["a", "b"])
        self.assertTrue(all(manual(context.host, h.name).started == 1 for h in context.host.all()))
        self.assertTrue(context.transport.connected)
        self.assertEqual(context.transport.node_id, "node-1")

    def test_ready_is_sent_only_after_adapters_started(self):
        """
        While an adapter's C{start} is still pending, the Node does not
        declare itself ready.
        """
        from twisted.internet import defer

        pending: defer.Deferred[None] = defer.Deferred()
        context = make_context()
        edge = FakeEdge(accepted(node_config(adapter_config("slow"))), READY_OK)

        original = build

        def slow_build(*args):
            adapter = original(*args)
            self.patch(adapter, "start", lambda: pending)
            return adapter

        context.host = AdapterHost(context.clock, slow_build)
        session, pump = connect(context, edge)
        pump.flush()
        self.assertEqual(edge.kinds(), ["register_request"])
        self.assertNoResult(session.ready)
        pending.callback(None)
        pump.flush()
        self.assertEqual(edge.kinds(), ["register_request", "run_reconcile", "node_ready_request"])
        self.successResultOf(session.ready)

    def test_unknown_token_is_fatal(self):
        """
        C{UNKNOWN_TOKEN} fails the handshake with L{FatalRefusal} naming
        the code and the Edge's reason, and closes the connection.
        """
        edge = FakeEdge(refused(messages.UNKNOWN_TOKEN, "token matches no node"))
        session, pump = connect(make_context(), edge)
        pump.flush()
        failure = self.failureResultOf(session.ready, FatalRefusal)
        self.assertIn("UNKNOWN_TOKEN", str(failure.value))
        self.assertIn("token matches no node", str(failure.value))
        self.assertIsNotNone(edge.lost_reason)
        self.successResultOf(session.lost)

    def test_wire_version_declared(self):
        """
        The Node's RegisterRequest declares the wire version it speaks.
        """
        edge = FakeEdge()
        connect(make_context(), edge)[1].flush()
        self.assertEqual(edge.of("register_request")[0].wire_version, WIRE_VERSION)

    def test_edge_wire_version_remembered(self):
        """
        The Edge's wire version comes from the accepted RegisterResponse;
        an Edge that declares none is version 1.
        """
        for declared, expected in [(2, 2), (0, 1)]:
            response = accepted(node_config())
            response.wire_version = declared
            session, pump = connect(make_context(), FakeEdge(response, READY_OK))
            pump.flush()
            self.assertEqual(session.edge_wire_version, expected)

    def test_incompatible_version_is_fatal(self):
        """
        C{INCOMPATIBLE_VERSION} fails the handshake with
        L{IncompatibleVersion} (a L{FatalRefusal}) naming the code, the
        Edge's reason and the version this Node speaks.
        """
        edge = FakeEdge(refused(messages.INCOMPATIBLE_VERSION, "this edge serves wire versions 1 to 1"))
        session, pump = connect(make_context(), edge)
        pump.flush()
        failure = self.failureResultOf(session.ready, IncompatibleVersion)
        self.assertIsInstance(failure.value, FatalRefusal)
        message = str(failure.value)
        self.assertIn("INCOMPATIBLE_VERSION", message)
        self.assertIn("serves wire versions 1 to 1", message)
        self.assertIn(f"speaks wire version {WIRE_VERSION}", message)
        self.assertIsNotNone(edge.lost_reason)

    def test_config_build_failure_is_fatal(self):
        """
        C{CONFIG_BUILD_FAILED} is fatal too: retrying would get the same
        configuration.
        """
        edge = FakeEdge(refused(messages.CONFIG_BUILD_FAILED))
        session, pump = connect(make_context(), edge)
        pump.flush()
        self.failureResultOf(session.ready, FatalRefusal)

    def test_duplicate_connection_is_retryable(self):
        """
        C{DUPLICATE_CONNECTION} (another live connection owns the node) is
        worth retrying: L{RetryableRefusal}.
        """
        edge = FakeEdge(refused(messages.DUPLICATE_CONNECTION, "node-1 already connected"))
        session, pump = connect(make_context(), edge)
        pump.flush()
        failure = self.failureResultOf(session.ready, RetryableRefusal)
        self.assertIn("DUPLICATE_CONNECTION", str(failure.value))
        self.assertIsNotNone(edge.lost_reason)

    def test_adapter_build_failure_is_fatal(self):
        """
        An adapter the Node cannot build from the Edge's config is fatal,
        names the adapter and the problem, and no ready is sent.
        """
        edge = FakeEdge(accepted(node_config(adapter_config("good"), adapter_config("bad", type="broken"))), READY_OK)
        context = make_context()
        session, pump = connect(context, edge)
        pump.flush()
        failure = self.failureResultOf(session.ready, FatalRefusal)
        self.assertIn("adapter bad", str(failure.value))
        self.assertIn("base_url is required", str(failure.value))
        self.assertEqual(edge.kinds(), ["register_request"])
        self.assertEqual(context.host.all(), [])

    def test_ready_refused_is_retryable(self):
        """
        C{NodeReadyResponse(ready=false)} (a stale connection) is retryable.
        """
        edge = FakeEdge(accepted(node_config()), messages.ready_response(ready=False, reason="stale"))
        session, pump = connect(make_context(), edge)
        pump.flush()
        failure = self.failureResultOf(session.ready, RetryableRefusal)
        self.assertIn("stale", str(failure.value))

    def test_register_timeout(self):
        """
        A RegisterRequest with no answer within C{register_timeout} fails
        the attempt (retryable) and closes the connection.
        """
        clock = Clock()
        context = make_context(clock, register_timeout=10)
        edge = FakeEdge()
        session, pump = connect(context, edge)
        pump.flush()
        clock.advance(9.9)
        self.assertNoResult(session.ready)
        clock.advance(0.2)
        pump.flush()
        failure = self.failureResultOf(session.ready, RetryableRefusal)
        self.assertIn("no RegisterResponse from the Edge within 10s", str(failure.value))
        self.assertIsNotNone(edge.lost_reason)

    def test_ready_timeout(self):
        """
        The ready request has its own timeout, started when it is sent.
        """
        clock = Clock()
        context = make_context(clock, register_timeout=3)
        edge = FakeEdge(accepted(node_config()))
        session, pump = connect(context, edge)
        pump.flush()
        clock.advance(3)
        failure = self.failureResultOf(session.ready, RetryableRefusal)
        self.assertIn("NodeReadyResponse", str(failure.value))

    def test_connection_lost_during_handshake_is_retryable(self):
        """
        Losing the connection before ready fails the handshake with
        L{RetryableRefusal}, and C{lost} fires.
        """
        edge = FakeEdge()
        session, pump = connect(make_context(), edge)
        pump.flush()
        edge.lose_connection()
        pump.flush()
        failure = self.failureResultOf(session.ready, RetryableRefusal)
        self.assertIn("connection lost during registration", str(failure.value))
        self.successResultOf(session.lost)

    def test_failed_tls_handshake_in_words(self):
        """
        A connection the Edge closed at the TLS handshake says so in words
        (OpenSSL's reason), not as a list of tuples.
        """
        session, pump = connect(make_context(), FakeEdge())
        pump.flush()
        assert session.wire is not None
        session.wire.connectionLost(Failure(SSL.Error([("SSL routines", "", "tlsv1 alert unknown ca")])))
        failure = self.failureResultOf(session.ready, RetryableRefusal)
        self.assertEqual(
            str(failure.value),
            "connection lost during registration: the TLS handshake with the Edge failed: tlsv1 alert unknown ca",
        )

    def test_work_before_ready_is_a_protocol_violation(self):
        """
        A run request before the session is ready closes the connection:
        the Edge must not send work to a pending connection.
        """
        edge = FakeEdge()
        session, pump = connect(make_context(), edge)
        pump.flush()
        edge.connection.send(run_request())
        pump.flush()
        self.assertIsNotNone(edge.lost_reason)
        self.assertIn("run_request is not acceptable", session_wire(session).close_reason)
        self.failureResultOf(session.ready, RetryableRefusal)

    def test_edge_draining_recorded_when_ready(self):
        """
        C{EdgeDraining} to a ready session is recorded on it (for the
        supervisor) and the connection stays up.
        """
        session, edge, pump, context = ready_node()
        edge.connection.send(messages.edge_draining(grace_sec=15, reason="edge restarting"))
        pump.flush()
        draining = session.edge_draining
        assert draining is not None
        self.assertEqual((draining.grace_sec, draining.reason), (15, "edge restarting"))
        self.assertIsNone(edge.lost_reason)

    def test_edge_draining_before_ready_ignored(self):
        """
        C{EdgeDraining} during the handshake is ignored harmlessly: not a
        protocol violation, and the handshake goes on.
        """
        edge = FakeEdge()
        session, pump = connect(make_context(), edge)
        pump.flush()
        edge.connection.send(messages.edge_draining(grace_sec=15))
        edge.connection.send(accepted(node_config()))
        pump.flush()
        self.assertIsNone(edge.lost_reason)
        self.assertIsNone(session.edge_draining)
        self.assertEqual(edge.kinds(), ["register_request", "run_reconcile", "node_ready_request"])

    def test_heartbeat_timings_from_the_edge(self):
        """
        Non-zero heartbeat timings in the config replace the defaults on
        this connection; zero keeps the default.
        """
        context = make_context()
        edge = FakeEdge(accepted(node_config(interval=1.5, timeout=0)), READY_OK)
        session, pump = connect(context, edge)
        pump.flush()
        self.assertEqual(session_wire(session).heartbeat, Heartbeat(interval=1.5, timeout=5.0))
        self.assertEqual(context.transport.heartbeat, Heartbeat(interval=1.5, timeout=5.0))

    def test_token_never_logged(self):
        """
        Neither the handshake's log lines nor the context's repr contain
        the token.
        """
        with capturedLogs() as events:
            ready_node()
            edge = FakeEdge(refused(messages.UNKNOWN_TOKEN))
            session, pump = connect(make_context(), edge)
            pump.flush()
            self.failureResultOf(session.ready)
        self.assertTrue(events)
        for event in events:
            self.assertNotIn(TOKEN, repr(event))
        self.assertNotIn(TOKEN, repr(make_context()))


class AdapterLifetimeTests(SynchronousTestCase):
    def test_adapters_kept_across_reconnects(self):
        """
        A reconnect with the same adapter configuration keeps the running
        instances (not rebuilt, not restarted).
        """
        clock = Clock()
        session, edge, pump, context = ready_node(clock=clock)
        first = manual(context.host, "manual")
        edge.lose_connection()
        pump.flush()

        edge2 = FakeEdge(accepted(node_config(adapter_config("manual"))), READY_OK)
        session2, pump2 = connect(context, edge2)
        pump2.flush()
        self.successResultOf(session2.ready)
        self.assertIs(manual(context.host, "manual"), first)
        self.assertEqual(first.started, 1)
        self.assertEqual(first.stopped, 0)

    def test_changed_adapter_rebuilt(self):
        """
        A reconnect whose config changes an adapter's options rebuilds that
        adapter (and stops the old instance) but keeps the unchanged one.
        """
        session, edge, pump, context = ready_node(adapter_config("a"), adapter_config("b"))
        a, b = manual(context.host, "a"), manual(context.host, "b")
        edge.lose_connection()
        pump.flush()

        edge2 = FakeEdge(accepted(node_config(adapter_config("a"), adapter_config("b", delay=1))), READY_OK)
        session2, pump2 = connect(context, edge2)
        pump2.flush()
        self.successResultOf(session2.ready)
        self.assertIs(manual(context.host, "a"), a)
        self.assertIsNot(manual(context.host, "b"), b)
        self.assertEqual(b.stopped, 1)
        self.assertEqual(manual(context.host, "b").options, {"delay": 1})

    def test_config_refresh(self):
        """
        A ConfigRefresh to a ready node adds, changes and removes adapters
        through the same path as registration.
        """
        session, edge, pump, context = ready_node(adapter_config("a"), adapter_config("gone"))
        gone = manual(context.host, "gone")
        edge.connection.send(
            messages.config_refresh(config=node_config(adapter_config("a"), adapter_config("new", max_concurrency=7)))
        )
        pump.flush()
        self.assertEqual(sorted(h.name for h in context.host.all()), ["a", "new"])
        self.assertEqual(hosted(context.host, "new").gate.limit, 7)
        self.assertEqual(gone.stopped, 1)

    def test_bad_config_refresh_keeps_previous_adapters(self):
        """
        A refresh with an adapter that cannot be built changes nothing and
        keeps the connection.
        """
        session, edge, pump, context = ready_node(adapter_config("a"))
        a = manual(context.host, "a")
        edge.connection.send(messages.config_refresh(config=node_config(adapter_config("b", type="broken"))))
        pump.flush()
        self.assertIs(manual(context.host, "a"), a)
        self.assertIsNone(context.host.get("b"))
        self.assertIsNone(edge.lost_reason)
        self.flushLoggedErrors()

    def test_config_refresh_acknowledged(self):
        """
        A refresh with a request id is answered: applied (with the adapter
        names) or refused (code C{refused}, the reason naming the adapter,
        the old adapters kept).
        """
        session, edge, pump, context = ready_node(adapter_config("a"))
        edge.connection.send(
            messages.config_refresh(config=node_config(adapter_config("a"), adapter_config("b")), request_id="r1")
        )
        edge.connection.send(
            messages.config_refresh(config=node_config(adapter_config("c", type="broken")), request_id="r2")
        )
        pump.flush()
        applied, refused = edge.of("node_command_response")
        self.assertEqual(
            (applied.request_id, applied.ok, json.loads(applied.result_json)), ("r1", True, {"applied": ["a", "b"]})
        )
        self.assertEqual((refused.request_id, refused.ok, refused.code), ("r2", False, "refused"))
        self.assertIn("adapter c", refused.error)
        self.assertEqual(sorted(h.name for h in context.host.all()), ["a", "b"])
        self.flushLoggedErrors()

    def test_config_refresh_without_request_id_not_answered(self):
        """
        An older Edge's refresh (no request id) gets no answer.
        """
        session, edge, pump, context = ready_node(adapter_config("a"))
        edge.connection.send(messages.config_refresh(config=node_config(adapter_config("b"))))
        pump.flush()
        self.assertEqual(edge.of("node_command_response"), [])
