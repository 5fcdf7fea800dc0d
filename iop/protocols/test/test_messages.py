"""
The builders of L{iop.protocols.messages}: what they leave absent stays
absent, and the one-of parts and enum codes come out as the wire says.
"""

from twisted.trial.unittest import SynchronousTestCase

from iop.protocols import iop_pb2, messages
from iop.protocols.wire import envelope


class BuilderTests(SynchronousTestCase):
    def test_usage_breakdown_absent_is_not_zero(self):
        """
        A breakdown count of C{None} is absent on the wire; a zero is sent.
        """
        usage = messages.usage(3, 4, cached_input_tokens=0)
        self.assertFalse(usage.HasField("reasoning_tokens"))
        self.assertTrue(usage.HasField("cached_input_tokens"))

    def test_run_event_parts_left_out(self):
        """
        A run event without usage, error or tool call carries none of them.
        """
        event = messages.run_event("r1", 2, "delta", text="hi")
        self.assertEqual((event.run_id, event.seq, event.type, event.text), ("r1", 2, "delta", "hi"))
        self.assertEqual([f for f in ("usage", "error", "tool_call") if event.HasField(f)], [])

    def test_tunnel_frame_carries_its_one_part(self):
        """
        Each part of a tunnel frame lands in the frame's one-of; headers
        are given as pairs.
        """
        cases = {
            "status": messages.tunnel_frame("t", 1, status=200),
            "headers": messages.tunnel_frame("t", 2, headers=[("a", "b")]),
            "body": messages.tunnel_frame("t", 3, body=b"x"),
            "end": messages.tunnel_frame("t", 4, end=True),
            "error": messages.tunnel_frame("t", 5, error=messages.run_error("c", "m")),
        }
        self.assertEqual({kind: frame.WhichOneof("frame") for kind, frame in cases.items()}, {k: k for k in cases})
        self.assertEqual([(h.name, h.value) for h in cases["headers"].headers.headers], [("a", "b")])
        self.assertIsNone(messages.tunnel_frame("t", 6).WhichOneof("frame"))

    def test_cancel_kinds(self):
        """
        The three cancels carry their kind and the id they name; a
        session's end also the caller key asking.
        """
        self.assertEqual(
            [
                (m.kind, m.run_id, m.request_id, m.caller)
                for m in (
                    messages.cancel_run("r"),
                    messages.cancel_command("c"),
                    messages.terminate_session("q", "a", "t", "s", "alice"),
                )
            ],
            [
                (messages.CANCEL_RUN, "r", "", ""),
                (messages.CANCEL_COMMAND, "", "c", ""),
                (messages.TERMINATE_SESSION, "", "q", "alice"),
            ],
        )

    def test_run_error_always_builds(self):
        """
        A failure is told whatever a provider put in it: a lone surrogate
        in its message becomes U+FFFD, a pair the character it makes, and a
        status out of the wire's range is left out (negative exit codes
        stay).
        """
        error = messages.run_error("provider_error", "cut \ud83d here \ud83d\ude00", 2**40)
        self.assertEqual((error.message, error.status), ("cut \ufffd here \U0001f600", 0))
        self.assertEqual(messages.run_error("c", "m", -9).status, -9)
        self.assertTrue(error.SerializeToString())

    def test_codes_are_the_generated_ones(self):
        """
        The re-exported codes are the generated enum's values, and a code
        this side does not know is named by its number.
        """
        self.assertEqual(messages.INCOMPATIBLE_VERSION, iop_pb2.INCOMPATIBLE_VERSION)
        self.assertEqual(messages.reject_code_name(messages.UNKNOWN_TOKEN), "UNKNOWN_TOKEN")
        self.assertEqual(messages.reject_code_name(99), "99")


class TunnelBodyTests(SynchronousTestCase):
    def test_same_bytes_as_the_frame_in_an_envelope(self) -> None:
        """
        L{messages.tunnel_body} (built in its envelope) is on the wire what
        a body C{ProviderTunnelFrame} wrapped in an envelope is.
        """
        built = messages.tunnel_body("t1", 7, b"data: {}\n\n")
        wrapped = envelope(messages.tunnel_frame("t1", 7, body=b"data: {}\n\n"))
        self.assertEqual(built.SerializeToString(), wrapped.SerializeToString())
        self.assertEqual(built.WhichOneof("body"), "provider_tunnel_frame")
