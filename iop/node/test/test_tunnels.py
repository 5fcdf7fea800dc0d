"""
Raw provider tunnels: frame order, body chunking, exactly one end/error
frame, cancellation, and refusals.
"""

from twisted.trial.unittest import SynchronousTestCase

from iop.adapters.interface import NotSupported
from iop.adapters.streams import ProviderError, ProviderStalled
from iop.protocols import messages
from iop.protocols.wire import TUNNEL_CHUNK_BYTES
from iop.run import FIRST_BYTE, INCOMPLETE, STALL, Usage
from iop.testing.node import RecordingStore, adapter_config, hosted, manual, ready_node, session_wire, tunnel_request


def frames(edge, tunnel_id="t1"):
    return [f for f in edge.of("provider_tunnel_frame") if f.tunnel_id == tunnel_id]


def kinds(edge, tunnel_id="t1"):
    return [f.WhichOneof("frame") for f in frames(edge, tunnel_id)]


class TunnelTests(SynchronousTestCase):
    def setUp(self):
        self.session, self.edge, self.pump, self.context = ready_node()
        self.adapter = manual(self.context.host, "manual")

    def open(self, tunnel_id="t1", body=b'{"model": "m"}'):
        self.edge.connection.send(tunnel_request(tunnel_id, body=body))
        self.pump.flush()
        return self.adapter.tunnels[-1]

    def test_request(self):
        """
        The adapter receives the request's method, path, headers and body.
        """
        request, sink, d = self.open()
        self.assertEqual((request.tunnel_id, request.method, request.path), ("t1", "POST", "/chat/completions"))
        self.assertEqual(request.headers, [("Content-Type", "application/json")])
        self.assertEqual(request.body, b'{"model": "m"}')

    def test_frame_order_and_chunking(self):
        """
        status, headers, body pieces, then end, numbered 1..n; a body write
        larger than the chunk limit is split and the pieces rejoin into the
        provider's exact bytes; usage and metadata are frames of their own.
        """
        request, sink, d = self.open()
        big = bytes(range(256)) * (TUNNEL_CHUNK_BYTES // 256 * 2 + 3)
        sink.status(200)
        sink.headers([(b"Content-Type", b"text/event-stream")])
        sink.body(b"data: 1\n\n")
        sink.body(big)
        sink.usage(Usage(7, 9))
        sink.metadata({"model": "m"})
        d.callback(None)
        self.pump.flush()

        got = frames(self.edge)
        self.assertEqual(
            kinds(self.edge), ["status", "headers", "body", "body", "body", "body", "usage", "metadata_json", "end"]
        )
        self.assertEqual([f.seq for f in got], list(range(1, 10)))
        self.assertEqual(got[0].status, 200)
        self.assertEqual([(h.name, h.value) for h in got[1].headers.headers], [("Content-Type", "text/event-stream")])
        bodies = [f.body for f in got if f.WhichOneof("frame") == "body"]
        self.assertTrue(all(len(b) <= TUNNEL_CHUNK_BYTES for b in bodies))
        self.assertEqual(b"".join(bodies), b"data: 1\n\n" + big)
        self.assertEqual(got[6].usage.output_tokens, 9)
        self.assertFalse(got[6].usage.HasField("cached_input_tokens"))
        self.assertEqual(got[7].metadata_json, '{"model": "m"}')
        self.assertEqual(self.context.metrics.value("iop_node_tunnel_bytes_total"), len(big) + 9)
        self.assertEqual(self.context.usage.snapshot()["manual"]["output_tokens"], 9)

    def test_failure_ends_with_error(self):
        """
        A failing tunnel ends with exactly one error frame carrying the
        failure's message; nothing follows it.
        """
        request, sink, d = self.open()
        sink.status(502)
        d.errback(ConnectionError("provider went away"))
        sink.body(b"late")
        self.pump.flush()
        self.assertEqual(kinds(self.edge), ["status", "error"])
        error = frames(self.edge)[-1].error
        self.assertEqual(error.code, "adapter_error")
        self.assertIn("provider went away", error.message)
        self.flushLoggedErrors(ConnectionError)

    def test_failure_before_the_body(self):
        """
        An adapter's failure before any body (here a missed first-byte
        deadline) is the tunnel's only frame: an error with the failure's
        code and deadline, which the Edge may place elsewhere.
        """
        request, sink, d = self.open()
        d.errback(ProviderStalled("no first byte", deadline=FIRST_BYTE))
        self.pump.flush()
        self.assertEqual(kinds(self.edge), ["error"])
        error = frames(self.edge)[-1].error
        self.assertEqual((error.code, error.deadline), ("provider_timeout", "first_byte"))
        labels = {"adapter": "manual", "code": "provider_timeout", "deadline": "first_byte"}
        self.assertEqual(self.context.metrics.value("iop_node_provider_failures_total", labels), 1)

    def test_incomplete_after_the_body(self):
        """
        An answer that broke after body frames ends with the usage seen so
        far, then an error frame coded C{incomplete} (keeping the stall
        deadline and the provider's status); the store records it.
        """
        request, sink, d = self.open()
        sink.status(200)
        sink.headers([("Content-Type", "text/event-stream")])
        sink.body(b"data: {}\n\n")
        sink.usage(Usage(3, 1))
        d.errback(ProviderError("stalled", 200, INCOMPLETE, STALL))
        self.pump.flush()
        self.assertEqual(kinds(self.edge), ["status", "headers", "body", "usage", "error"])
        error = frames(self.edge)[-1].error
        self.assertEqual((error.code, error.deadline, error.status), ("incomplete", "stall", 200))
        labels = {"adapter": "manual", "code": "incomplete", "deadline": "stall"}
        self.assertEqual(self.context.metrics.value("iop_node_provider_failures_total", labels), 1)

    def test_retry_after_carried(self):
        """
        A provider error's Retry-After reaches the Edge as retry_after_sec.
        """
        request, sink, d = self.open()
        d.errback(ProviderError("busy", 503, retry_after_sec=2.5))
        self.pump.flush()
        error = frames(self.edge)[-1].error
        self.assertEqual((error.code, error.status, error.retry_after_sec), ("provider_error", 503, 2.5))

    def test_cancel(self):
        """
        CancelRequest(CANCEL_RUN, run_id=tunnel_id) cancels the adapter's
        Deferred; the tunnel ends with an error frame coded C{cancelled} and
        its slot is free.
        """
        request, sink, d = self.open()
        sink.status(200)
        self.edge.connection.send(messages.cancel_run("t1"))
        self.pump.flush()
        self.assertEqual(self.adapter.cancelled, ["t1"])
        self.assertEqual(kinds(self.edge), ["status", "error"])
        self.assertEqual(frames(self.edge)[-1].error.code, "cancelled")
        self.assertEqual(hosted(self.context.host, "manual").gate.in_use, 0)

    def test_slot_freed_before_end(self):
        """
        The gate slot is free by the time the end frame is sent.
        """
        gate = hosted(self.context.host, "manual").gate
        seen = []
        wire = session_wire(self.session)
        send = wire.send

        def spy(message):
            if message.DESCRIPTOR.name == "ProviderTunnelFrame" and message.WhichOneof("frame") in ("end", "error"):
                seen.append(gate.in_use)
            send(message)

        self.patch(wire, "send", spy)
        request, sink, d = self.open()
        d.callback(None)
        self.assertEqual(seen, [0])

    def test_loss_cancels(self):
        """
        Losing the connection cancels the tunnel and frees its slot.
        """
        self.open()
        self.edge.lose_connection()
        self.pump.flush()
        self.assertEqual(self.adapter.cancelled, ["t1"])
        self.assertEqual(hosted(self.context.host, "manual").gate.in_use, 0)


class TunnelRefusalTests(SynchronousTestCase):
    def test_not_supported(self):
        """
        An adapter with no raw tunnel answers with a single error frame,
        code C{tunnel_not_supported}, and gives its slot back.
        """
        session, edge, pump, context = ready_node(adapter_config("plain", type="plain"))
        edge.connection.send(tunnel_request("t1", adapter="plain"))
        pump.flush()
        [frame] = frames(edge)
        self.assertEqual((frame.seq, frame.error.code), (1, "tunnel_not_supported"))
        self.assertIn("no raw provider tunnel", frame.error.message)
        self.assertEqual(hosted(context.host, "plain").gate.in_use, 0)

    def test_not_supported_from_deferred(self):
        """
        L{NotSupported} arriving through the Deferred is reported the same
        way.
        """
        from twisted.internet import defer

        session, edge, pump, context = ready_node()
        self.patch(manual(context.host, "manual"), "tunnel", lambda request, sink: defer.fail(NotSupported("nope")))

        edge.connection.send(tunnel_request("t1"))
        pump.flush()
        self.assertEqual(frames(edge)[0].error.code, "tunnel_not_supported")

    def test_unknown_adapter(self):
        """
        A tunnel for an unknown adapter gets one error frame,
        C{unknown_adapter}.
        """
        session, edge, pump, context = ready_node()
        edge.connection.send(tunnel_request("t1", adapter="nope"))
        pump.flush()
        self.assertEqual(frames(edge)[0].error.code, "unknown_adapter")


class TunnelStoreTests(SynchronousTestCase):
    def setUp(self):
        self.store = RecordingStore()
        self.session, self.edge, self.pump, self.context = ready_node(store=self.store)
        self.adapter = manual(self.context.host, "manual")

    def test_recorded(self):
        """
        A tunnel is recorded like a run: its adapter and the model its body
        names at start; at its end the status, the usage observed and the
        body bytes relayed.
        """
        self.edge.connection.send(tunnel_request("t1", body=b'{"model": "big-v2"}'))
        self.pump.flush()
        request, sink, d = self.adapter.tunnels[-1]
        self.assertEqual(self.store.tunnel_starts, [("t1", "manual", "big-v2")])
        sink.status(200)
        sink.body(b"12345")
        sink.body(b"678")
        sink.usage(Usage(2, 3))
        d.callback(None)
        self.pump.flush()
        self.assertEqual(self.store.tunnel_ends, [("t1", "complete", None, 8)])
        self.assertEqual(self.store.rows["t1"]["usage"], {"input_tokens": 2, "output_tokens": 3})

    def test_cancelled_and_refused(self):
        """
        A cancelled tunnel ends cancelled; a refused one (unknown adapter)
        is recorded as an error with its code; a body that is not JSON
        names no target.
        """
        self.edge.connection.send(tunnel_request("t1", body=b"not json"))
        self.edge.connection.send(tunnel_request("t2", adapter="nope"))
        self.pump.flush()
        self.edge.connection.send(messages.cancel_run("t1"))
        self.pump.flush()
        self.assertEqual(self.store.tunnel_starts, [("t1", "manual", ""), ("t2", "nope", "")])
        self.assertEqual(
            sorted(self.store.tunnel_ends), [("t1", "cancelled", "cancelled", 0), ("t2", "error", "unknown_adapter", 0)]
        )
