"""
The operator-facing smoke scripts keep working.
"""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_provider_capacity_smoke():
    """
    scripts/e2e-provider-capacity-smoke.sh passes: one capacity-1 provider
    behind two model names serves concurrent requests one at a time and
    ends with every counter at 0.
    """
    result = subprocess.run(
        [os.path.join(ROOT, "scripts", "e2e-provider-capacity-smoke.sh")],
        env=dict(os.environ, PYTHON=sys.executable),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "provider capacity smoke: OK" in result.stdout


def test_relay_benchmark_runs():
    """
    bench/relay.py still runs end to end (tiny sizes; no timing is
    asserted — speed is read from its ratios, not tested).
    """
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "relay.py"), "--requests", "2", "--concurrency", "2"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    for path in ("direct", "tunnel", "floor", "run"):
        assert path in result.stdout
    # The floor relay (bench/floor.py) answers every request of every
    # scenario, or its ratios would mean nothing.
    floor_rows = re.findall(r"^floor +(\d+)/(\d+) ", result.stdout, re.M)
    assert floor_rows and all(ok == total for ok, total in floor_rows), floor_rows
