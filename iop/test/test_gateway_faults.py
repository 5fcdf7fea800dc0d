"""
The whole gateway in memory with a faulty provider
(L{iop.testing.faulty}): the real adapter's deadlines and answer checks
on the shared clock, through the real Edge, to a caller. What a caller
gets for each fault (the Edge's own part: retries, fallbacks, health, is
tested with the Edge), and the leases at rest after each.
"""

import copy
import json
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from iop.testing import gateway
from iop.testing.faulty import FaultyAdapter
from iop.testing.gateway import GATEWAY_YAML, Gateway

FAULTS = ("stall", "cut", "silent", "malformed", "nodone")


def faulty_config() -> dict[str, Any]:
    config = copy.deepcopy(GATEWAY_YAML)
    (llm,) = [a for a in config["nodes"][0]["adapters"] if a["name"] == "llm"]
    llm.update(first_byte_timeout_sec=2, stall_timeout_sec=1)
    config["model_groups"] += [
        {"name": name, "providers": [{"node": "n1", "provider": "llm", "target": f"{name}-model"}], "retries": 0}
        for name in FAULTS
    ]
    return config


def sse_payloads(body: bytes) -> list[str]:
    return [line[6:] for line in body.decode().splitlines() if line.startswith("data: ")]


class GatewayFaultTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.patch(gateway, "GATEWAY_TYPES", dict(gateway.GATEWAY_TYPES, openai_compat=FaultyAdapter))
        self.gateway = Gateway(faulty_config())
        self.node = self.gateway.node()

    def tearDown(self) -> None:
        providers = self.gateway.service.status()["nodes"][0]["providers"]
        self.assertEqual([p["in_use"]["normal"] for p in providers], [0] * len(providers))

    def chat(self, model: str, stream: bool, wait: float) -> tuple[int, bytes]:
        d = self.gateway.post(
            "/v1/chat/completions", {"model": model, "stream": stream, "messages": [{"role": "user", "content": "x"}]}
        )
        self.gateway.advance(wait)
        code, _, body = self.successResultOf(self.gateway.read(d))
        return code, body

    def test_stall_and_cut_after_the_first_event(self) -> None:
        """
        A stream stalled or cut after its first event ends with an
        explicit incomplete error, not like a success.
        """
        for model, wait in (("stall", 1.5), ("cut", 0.1), ("malformed", 0.1)):
            code, body = self.chat(model, True, wait)
            self.assertEqual(code, 200, model)
            payloads = sse_payloads(body)
            self.assertEqual(json.loads(payloads[-2])["error"]["code"], "incomplete", model)
            self.assertNotIn("nope", body.decode(), model)

    def test_not_streamed_never_partial(self) -> None:
        """
        A non-streamed answer cut or stalled mid-body is an error status,
        never a 200 with part of a body.
        """
        for model, wait in (("cut", 0.1), ("stall", 1.5)):
            code, body = self.chat(model, False, wait)
            self.assertIn(code, (502, 504), model)
            self.assertIn(json.loads(body)["error"]["code"], ("provider_error", "provider_timeout"), model)

    def test_silent_bounded_by_first_byte(self) -> None:
        """
        A silent provider costs first_byte_timeout_sec, not the idle one.
        """
        code, body = self.chat("silent", True, 2.5)
        self.assertIn(code, (502, 504))
        self.assertEqual(json.loads(body)["error"]["code"], "provider_timeout")

    def test_finished_without_done(self) -> None:
        """
        A finished stream without [DONE] is ended promptly, whole.
        """
        code, body = self.chat("nodone", True, 2.5)
        self.assertEqual(code, 200)
        self.assertEqual(json.loads(sse_payloads(body)[-1])["choices"][0]["finish_reason"], "stop")
