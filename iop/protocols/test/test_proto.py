"""
The committed C{iop_pb2.py} must be exactly what C{iop.proto} generates.
"""

import importlib.util
import os
import subprocess
import sys
import tempfile

from twisted.trial.unittest import SkipTest, SynchronousTestCase

from iop.protocols import iop_pb2

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class DriftTests(SynchronousTestCase):
    def test_generated_module_matches_proto(self):
        """
        Regenerating from the .proto gives the committed module byte for
        byte; run `make proto` after editing the schema.
        """
        if importlib.util.find_spec("grpc_tools") is None:
            raise SkipTest("grpcio-tools (a test dependency) is not installed")
        with tempfile.TemporaryDirectory() as out:
            subprocess.run(
                [sys.executable, "-m", "grpc_tools.protoc", "-I", HERE, f"--python_out={out}", "iop.proto"],
                check=True,
                cwd=HERE,
            )
            with open(os.path.join(out, "iop_pb2.py"), "rb") as f:
                fresh = f.read()
        with open(os.path.join(HERE, "iop_pb2.py"), "rb") as f:
            committed = f.read()
        self.assertEqual(fresh, committed, "iop_pb2.py is stale: run `make proto`")

    def test_every_spec_message_exists(self):
        """
        The schema carries every message the spec names.
        """
        names = set(iop_pb2.DESCRIPTOR.message_types_by_name)
        for required in [
            "RegisterRequest",
            "RegisterResponse",
            "NodeConfigPayload",
            "NodeReadyRequest",
            "NodeReadyResponse",
            "Ping",
            "Pong",
            "RunRequest",
            "RunEvent",
            "CancelRequest",
            "NodeCommandRequest",
            "NodeCommandResponse",
            "ProviderTunnelRequest",
            "ProviderTunnelFrame",
            "ConfigRefresh",
            "Usage",
        ]:
            self.assertIn(required, names)
        self.assertEqual(set(iop_pb2.CancelRequest.Kind.keys()), {"CANCEL_RUN", "TERMINATE_SESSION", "CANCEL_COMMAND"})

    def test_usage_breakdown_optional(self):
        """
        An unset breakdown field is distinguishable from zero on the wire.
        """
        usage = iop_pb2.Usage.FromString(iop_pb2.Usage(input_tokens=1, cached_input_tokens=0).SerializeToString())
        self.assertTrue(usage.HasField("cached_input_tokens"))
        self.assertFalse(usage.HasField("reasoning_tokens"))
