"""
Every benchmark of issue 11 in one run, and its table: figure, measured,
target.

  relay.py      the Edge–Node path against direct (latency, throughput,
                CPU per request and chunk, memory)
  fleet.py      many simulated Nodes against one Edge
  placement.py  the pool's choice of a provider in a large group
  tenants.py    caller keys sharing the Edge: a light key's wait beside a
                heavy backlog, token shares against weights

    .venv/bin/python bench/report.py            # short: under a minute or two (make bench)
    .venv/bin/python bench/report.py --full     # the reference sizes (make bench BENCH_FLAGS=--full)
    .venv/bin/python bench/report.py --tiny     # seconds: that it all runs (the test suite)

It first prints where it ran (date, CPU, cores, load average, commit):
figures from a shared or loaded machine are read as ratios, and with the
load in mind.
"""

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time

import fleet
import placement
import relay
import tenants

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

RELAY_FLAGS = {
    "tiny": [
        "--requests",
        "2",
        "--concurrency",
        "2",
        "--wide",
        "4",
        "--paced-wide",
        "4",
        "--long-chunks",
        "500",
        "--repeats",
        "1",
    ],
    "short": [],
    "full": ["--full"],
}
FLEET_FLAGS = {
    "tiny": ["--nodes", "20", "--streams", "40", "--rest", "0.5", "--status-requests", "3"],
    "short": [],
    "full": ["--full"],
}
PLACEMENT_SIZES = {"tiny": {"members": 100, "cycles": 1000}, "short": {}, "full": {}}


def machine():
    model = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        commit = subprocess.run(
            ["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = "?"
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": model,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "commit": commit,
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--full", action="store_true", help="the reference sizes (about 10 minutes)")
    size.add_argument("--tiny", action="store_true", help="the smallest sizes: only that everything runs")
    parser.add_argument("--json", help="write every figure to this file")
    args = parser.parse_args(argv)
    mode = "full" if args.full else "tiny" if args.tiny else "short"
    where = machine()
    where["load_before"] = os.getloadavg()
    print(
        f"{mode} run, {where['date']}, {where['cpu']}, {where['cores']} cores, "
        f"Python {where['python']}, commit {where['commit']}, load average {where['load_before'][0]:.2f}"
    )
    started = time.monotonic()
    relay_args = relay.parser().parse_args(RELAY_FLAGS[mode])
    relay_figures = relay.run(relay_args)
    fleet_args = fleet.configure(fleet.parser().parse_args(FLEET_FLAGS[mode]))
    fleet_figures = fleet.run(fleet_args)
    placement_figures = placement.run(**PLACEMENT_SIZES[mode])
    tenant_figures = tenants.run(tiny=mode == "tiny")
    where["load_after"] = os.getloadavg()
    where["minutes"] = (time.monotonic() - started) / 60
    rows = (
        relay.summary(relay_figures)
        + fleet.summary(fleet_figures)
        + placement.summary(placement_figures)
        + tenants.summary(tenant_figures)
    )
    relay.print_table(rows, "figures and targets")
    if fleet_figures["problems"]:
        print(f"fleet stream problems: {fleet_figures['problems']}")
    print(
        f"\n{where['minutes']:.1f} min; load average before {where['load_before'][0]:.2f}, "
        f"after {where['load_after'][0]:.2f} (1 min)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "machine": where,
                    "relay": relay_figures,
                    "fleet": fleet_figures,
                    "placement": placement_figures,
                    "tenants": tenant_figures,
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
