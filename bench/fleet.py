"""
A many-Nodes bench: N simulated Nodes (L{fleetsim}, the project's own wire
code, in one process) against a real C{iop-edge}, then S concurrent
streamed chat completions placed over them.

Three processes on loopback: the Edge; the simulator, whose reactor runs
every Node; and this program, whose asyncio loop (L{loadgen}) is every
caller — so neither the simulator nor the callers share a reactor with
the other, and the Edge is the process under load.

It reports:

  - registration: from the first dial until all N Nodes are ready (the
    simulator's clock), and the Edge's own count of connected Nodes;
  - heartbeat CPU at rest: the Edge's CPU over a quiet window, as a
    percentage of one core (every Node pings every 2 s and is pinged);
  - C{GET /v1/status} latency, p50 and p99;
  - S concurrent streams over the fleet (each Node has room for its
    share, so all are live at once): how many completed whole (HTTP 200,
    the right text, a finish reason, C{data: [DONE]}), how many Nodes were
    dropped (connected before and after, and the simulator's own count of
    lost connections), the duration, first-byte latency, and the CPU each
    process spent.

    .venv/bin/python bench/fleet.py            # short: 200 Nodes, 1,000 streams (make bench)
    .venv/bin/python bench/fleet.py --full     # 1,000 Nodes, 5,000 streams

Bounded: every wait has a deadline, the simulator stops itself after
C{--deadline}, and everything is torn down in C{finally}.
"""

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))  # the process harness: tests/support/
import fleetsim  # noqa: E402
import loadgen  # noqa: E402
import procstat  # noqa: E402
from support.daemons import Launcher  # noqa: E402


def connected(edge):
    """
    How many Nodes the Edge shows connected.
    """
    return sum(1 for node in edge.status()["nodes"] if node["connected"])


def stream_text(i, words):
    return f"stream {i} " + " ".join(f"w{i}-{k}" for k in range(words - 2))


def streams(edge, count, words, timeout):
    """
    C{count} concurrent streamed chat completions on the C{fleet} group.
    @return: C{(results, wall seconds, problems)}; C{problems} maps what
    went wrong to how many streams it happened to.
    """
    texts = [stream_text(i, words) for i in range(count)]
    requests = [
        loadgen.post(
            edge.http_port,
            "/v1/chat/completions",
            {"model": "fleet", "stream": True, "messages": [{"role": "user", "content": text}]},
        )
        for text in texts
    ]
    results, wall = loadgen.run_load(edge.http_port, requests, count, loadgen.SSE, keep=True, timeout=timeout)
    problems = {}
    for result, text in zip(results, texts, strict=True):
        problem = check(result, text)
        if problem:
            problems[problem] = problems.get(problem, 0) + 1
    return results, wall, problems


def check(result, text):
    """
    What is wrong with one stream, or C{None} if it came back whole.
    """
    if result.error:
        return result.error
    if result.status != 200:
        return f"HTTP {result.status}"
    try:
        got, finish, ended = loadgen.chat_stream(result.body)
    except ValueError:
        return "undecodable chunk"
    if not ended:
        return "no [DONE]"
    if finish != "stop":
        return f"finish_reason {finish}"
    if got != text:
        return "wrong text"
    return None


def percentile(values, q):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))] if ordered else float("nan")


def run(args):
    """
    @return: a dict of every figure.
    """
    procstat.raise_open_files()
    workdir = tempfile.mkdtemp(prefix="iop-bench-fleet-")
    launcher = Launcher(workdir)
    sim = None
    figures = {"nodes": args.nodes, "streams": args.streams, "words": args.words, "pace_ms": args.pace_ms}
    try:
        capacity = math.ceil(args.streams / args.nodes)
        gc_dir = os.path.join(workdir, "gc")
        with procstat.gc_watched(gc_dir):
            edge = launcher.edge(fleetsim.edge_config(args.nodes, capacity))
            sim = fleetsim.FleetProcess(workdir, edge.node_port, args.nodes, args.pace_ms, deadline=args.deadline)
        stats = sim.wait_ready(timeout=120)
        figures["registration_sec"] = stats["registration_sec"]
        figures["edge_connected"] = connected(edge)

        since = time.time()
        meter = procstat.Meter({"edge": edge.pid, "simulator": sim.pid}).start()
        time.sleep(args.rest)  # a measurement window, not a synchronisation
        spent = meter.stop()
        figures["rest_gc_edge"] = procstat.gc_summary(procstat.gc_passes(gc_dir, edge.pid, since, time.time()))
        figures["rest_sec"] = args.rest
        figures["rest_cpu_pct"] = {name: 100 * seconds / args.rest for name, seconds in spent.items()}

        latencies = []
        for _ in range(args.status_requests):
            start = time.perf_counter()
            status, _, _ = edge.request("GET", "/v1/status")
            latencies.append(time.perf_counter() - start)
            assert status == 200, status
        figures["status_p50"] = statistics.median(latencies)
        figures["status_p99"] = percentile(latencies, 0.99)

        before = connected(edge)
        since = time.time()
        overflows = procstat.listen_overflows()
        meter = procstat.Meter({"edge": edge.pid, "simulator": sim.pid, "callers": None}).start()
        results, wall, problems = streams(edge, args.streams, args.words, args.stream_timeout)
        spent = meter.stop()
        figures["listen_overflows"] = procstat.listen_overflows() - overflows
        figures["streams_gc_edge"] = procstat.gc_summary(procstat.gc_passes(gc_dir, edge.pid, since, time.time()))
        after = connected(edge)
        sim_stats = sim.fresh_stats()
        firsts = [r.first for r in results if r.first is not None]
        figures.update(
            {
                "completed": args.streams - sum(problems.values()),
                "problems": problems,
                "connected_before": before,
                "connected_after": after,
                "simulator_lost": sim_stats["lost"],
                "simulator_reasons": sim_stats["reasons"],
                "streams_sec": wall,
                "ttfb_p50": percentile(firsts, 0.5),
                "ttfb_p99": percentile(firsts, 0.99),
                "ttfb_max": max(firsts, default=float("nan")),
                "streams_cpu_pct": {name: 100 * seconds / wall for name, seconds in spent.items()},
                "edge_rss": procstat.memory(edge.pid),
            }
        )
    finally:
        if sim is not None:
            sim.stop()
        launcher.stop_all()
        procstat.keep_on_failure(workdir)
    return figures


def summary(f):
    """
    The fleet rows of issue 11's table: C{(figure, measured, target)}.
    """
    n, s = f["nodes"], f["streams"]
    cpu = f["streams_cpu_pct"]
    dropped = f["connected_before"] - f["connected_after"]
    return [
        (
            f"{n:,} Nodes: registration; heartbeat CPU at rest",
            f"{f['registration_sec']:.3f} s; {f['rest_cpu_pct']['edge']:.1f}% of a core (over {f['rest_sec']:g} s)",
            "<= 2 s; <= 3%",
        ),
        (
            f"`GET /v1/status` with {n:,} Nodes, p50 (p99)",
            f"{f['status_p50'] * 1000:.1f} ms ({f['status_p99'] * 1000:.1f} ms)",
            "<= 10 ms",
        ),
        (
            f"{s:,} live streams over {n:,} Nodes",
            f"{f['completed']:,} of {s:,} completed, {dropped} Nodes dropped "
            f"({f['simulator_lost']} lost by the simulator), {f['streams_sec']:.1f} s; "
            f"first byte p50 {f['ttfb_p50'] * 1000:.0f} ms, p99 {f['ttfb_p99'] * 1000:.0f} ms; "
            f"CPU Edge {cpu['edge']:.0f}%, simulator {cpu['simulator']:.0f}%, callers {cpu['callers']:.0f}%; "
            f"{f['listen_overflows']:,} connections overflowed a listen queue",
            "all complete, no Node dropped",
        ),
        (
            "Edge garbage collection: longest pass at rest; during the streams (full collections)",
            f"{f['rest_gc_edge'][0] * 1000:.0f} ms; {f['streams_gc_edge'][0] * 1000:.0f} ms "
            f"({f['streams_gc_edge'][2]} full, {f['streams_gc_edge'][1] * 1000:.0f} ms of CPU)",
            "(reported)",
        ),
        (
            f"Edge RSS with {n:,} Nodes, after {s:,} streams; peak",
            f"{f['edge_rss'][0] / 2**20:.0f} MiB; {f['edge_rss'][1] / 2**20:.0f} MiB",
            "(reported)",
        ),
    ]


def parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--full", action="store_true", help="1,000 Nodes, 5,000 streams, 10 s at rest")
    p.add_argument("--nodes", type=int, help="simulated Nodes (short 200, full 1000)")
    p.add_argument("--streams", type=int, help="concurrent streams (short 1000, full 5000)")
    p.add_argument("--words", type=int, default=16, help="chunks per stream (default 16)")
    p.add_argument("--pace-ms", type=float, default=50.0, help="between two events of a run (default 50)")
    p.add_argument("--rest", type=float, help="seconds of the at-rest CPU window (short 5, full 10)")
    p.add_argument("--status-requests", type=int, default=20)
    p.add_argument("--stream-timeout", type=float, default=120.0, help="per stream, seconds")
    p.add_argument("--deadline", type=float, default=600.0, help="the simulator stops itself after this")
    p.add_argument("--json", help="also write every figure to this file")
    return p


def configure(args):
    args.nodes = args.nodes or (1000 if args.full else 200)
    args.streams = args.streams or (5000 if args.full else 1000)
    args.rest = args.rest if args.rest is not None else (10.0 if args.full else 5.0)
    return args


def main(argv=None):
    from relay import print_table

    args = configure(parser().parse_args(argv))
    figures = run(args)
    print_table(summary(figures), f"issue 11, fleet figures ({args.nodes} Nodes, {args.streams} streams)")
    if figures["problems"]:
        print(f"stream problems: {figures['problems']}")
    if figures["simulator_reasons"]:
        print(f"simulator: connections refused, failed or lost: {figures['simulator_reasons']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
