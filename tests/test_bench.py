"""
The benchmarks of bench/ keep running, in their tiniest form. Nothing is
timed or compared here: speed is read from the benchmarks' ratios, never
asserted by a test. (The relay benchmark alone also runs in
test_smoke_scripts.py with its original arguments.)
"""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_report_runs():
    """
    bench/report.py --tiny runs every benchmark (relay, fleet, placement,
    tenants)
    end to end on loopback and prints issue 11's table with every row,
    the fleet's streams all complete (a tiny fleet under no load: a
    failure here is a bug, not a slow machine).
    """
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "report.py"), "--tiny"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    for row in (
        "added first-byte latency",
        "Edge / Node CPU per request",
        "burst chunks/s vs direct",
        "normalized path (native runs)",
        "paced provider",
        "streams stalled",
        "concurrent streams: failed",
        "Nodes: registration; heartbeat CPU at rest",
        "GET /v1/status",
        "40 of 40 completed, 0 Nodes dropped",
        "placement in a 100-member group",
        "light tenant wait beside 30 queued heavy streams",
        "Jain's fairness index",
    ):
        assert row in result.stdout, row
