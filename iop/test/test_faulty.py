"""
Tests for L{iop.testing.faulty}: the real OpenAI adapter against a
scripted provider in memory, each fault as the adapter tests see it on a
socket.
"""

import json

from twisted.internet import defer
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from iop.adapters.interface import RunInput, TunnelInput
from iop.adapters.streams import ProviderError
from iop.run import RunEventData
from iop.testing.faulty import WORDS, FaultyAdapter
from iop.testing.tunnels import TunnelRecorder


class FaultyTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        options = {"first_byte_timeout_sec": 10, "stall_timeout_sec": 5, "idle_timeout_sec": 60}
        self.adapter = FaultyAdapter("llm", 2, options, self.clock)

    def run_on(self, model: str, advance: float = 0) -> list[RunEventData]:
        events: list[RunEventData] = []
        d = self.adapter.execute(RunInput("r1", model, [{"role": "user", "content": "hi"}]), events.append)
        self.turn_then(advance)
        self.successResultOf(d)
        return events

    def tunnel_on(self, model: str, stream: bool, advance: float = 0) -> tuple[TunnelRecorder, "defer.Deferred[None]"]:
        sink = TunnelRecorder()
        body = json.dumps({"model": model, "stream": stream}).encode()
        d = self.adapter.tunnel(TunnelInput("t1", "POST", "/chat/completions", [], body), sink)
        self.turn_then(advance)
        return sink, d

    def turn_then(self, seconds: float) -> None:
        """
        One reactor turn (the clock is the adapter's reactor: what the
        provider wrote reaches the adapter in the next turn), then
        C{seconds} later.
        """
        self.clock.advance(0)
        self.clock.advance(seconds)

    def test_whole_answers(self) -> None:
        """
        Any other model gets the whole answer, streamed or not.
        """
        events = self.run_on("m")
        self.assertEqual([e.type for e in events], ["start", "delta", "complete"])
        self.assertEqual("".join(e.text for e in events), "".join(WORDS))
        for stream in (True, False):
            sink, d = self.tunnel_on("m", stream)
            self.successResultOf(d)
            self.assertEqual([c[0] for c in sink.calls][:2], ["status", "headers"])

    def test_run_faults(self) -> None:
        """
        Each fault ends a run as the real adapter ends it on a socket.
        """
        cases = {
            "silent-model": (10, "provider_timeout", "first_byte", False),
            "slow-model": (10, "provider_timeout", "first_byte", False),
            "cut-model": (0, "incomplete", "", True),
            "stall-model": (5, "incomplete", "stall", True),
            "malformed-model": (0.01, "incomplete", "", True),
            "context-model": (0, "context_length_exceeded", "", False),
            "error-model": (0, "provider_error", "", False),
        }
        for model, (advance, code, deadline, started) in cases.items():
            events = self.run_on(model, advance)
            error = events[-1].error
            assert error is not None, model
            self.assertEqual((error.code, error.deadline), (code, deadline), model)
            self.assertEqual(events[0].type == "start", started, model)
        busy = self.run_on("busy-model")[-1].error
        assert busy is not None
        self.assertEqual((busy.status, busy.retry_after_sec), (429, 2.0))

    def test_finished_without_done(self) -> None:
        """
        A finished stream without [DONE] completes after the grace.
        """
        events = self.run_on("nodone-model", 2.0)
        self.assertEqual(events[-1].type, "complete")

    def test_tunnel_faults(self) -> None:
        """
        A streamed tunnel cut after its first event fails incomplete; a
        non-streamed one cut mid-body fails with nothing relayed, even when
        its connection seemed to end cleanly (no length: only its JSON
        says it was cut).
        """
        sink, d = self.tunnel_on("cut-model", True)
        self.assertEqual(self.failureResultOf(d, ProviderError).value.code, "incomplete")
        self.assertTrue(sink.bodies)
        sink, d = self.tunnel_on("cut-model", False)
        self.assertEqual(self.failureResultOf(d, ProviderError).value.status, 502)
        self.assertEqual(sink.calls, [])
        sink, d = self.tunnel_on("lossy-model", False)
        self.assertEqual(self.failureResultOf(d, ProviderError).value.status, 502)
        self.assertEqual(sink.calls, [])
        sink, d = self.tunnel_on("silent-model", True, 10)
        self.assertEqual(self.failureResultOf(d, ProviderError).value.deadline, "first_byte")

    def test_outage_and_probe(self) -> None:
        """
        While down every request answers 503 and the probe says so.
        """
        self.adapter.down = True
        self.assertEqual(self.successResultOf(self.adapter.command("probe", {}))["status"], 503)
        self.adapter.down = False
        self.assertEqual(self.successResultOf(self.adapter.command("probe", {})), {"ok": True})
