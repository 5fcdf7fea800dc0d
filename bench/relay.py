"""
Relay overhead of the Edge–Node path, as ratios against a direct
connection to the same provider in the same run.

Starts two loopback fake providers (OpenAI-compatible and Ollama, from
C{tests/support/fake_providers.py}, 5 ms per event for the C{slow-model}),
a real C{iop-edge} and a real C{iop-node} (the process harness of the
multi-process tests, C{tests/support/}) and the floor relay (L{floor}),
then streams the same chat six ways:

  direct         caller -> fake OpenAI provider
  tunnel         caller -> Edge -> Node -> fake OpenAI provider  (raw bytes relayed)
  floor          caller -> floor Edge -> floor Node -> fake OpenAI provider  (the stack alone)
  direct-ollama  caller -> fake Ollama provider (NDJSON)
  run            caller -> Edge native /v1/runs -> Node -> fake Ollama  (normalized)
  run-openai     caller -> Edge /v1/chat/completions -> Node -> fake Ollama  (normalized, OpenAI chunks)

Tunnels and the floor are compared with C{direct}, normalized runs with
C{direct-ollama}.

Scenarios: burst (the provider writes every event at once) at c=1, c=50
and c=1000 concurrent callers; paced (5 ms between events) at c=50 and
at c=256, where streams that stalled (a gap of more than 20 ms between
two reads) are counted on each path; one stream of 20,000 chunks. For each: time to the first body byte, content
chunks per second (one chunk per word of the answer), the longest gap
between two reads that brought events, and the CPU the Edge and the Node
each spent per request and per chunk (C{/proc/<pid>/stat} before and
after), plus their resident memory. The callers are one asyncio process
(L{loadgen}), so the caller's own cost stays small and the same on every
path.

    .venv/bin/python bench/relay.py              # short (make bench)
    .venv/bin/python bench/relay.py --full       # medians of 3, larger counts
    .venv/bin/python bench/relay.py --requests N --concurrency C   # every count N, c=50 becomes c=C

Nothing here is a pass/fail test: speed is read from the ratios.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))  # the process harness: tests/support/
import floor  # noqa: E402
import loadgen  # noqa: E402
import procstat  # noqa: E402
from loadgen import NDJSON, SSE  # noqa: E402
from support.daemons import FakeProvider, Launcher  # noqa: E402

PROVIDER = os.path.join(HERE, "provider.py")  # fake_providers with a deep listen backlog
PACE_MS = 5
#: A gap between two reads of a paced stream longer than this is a stall.
STALL_SEC = 0.020
CAPACITY = 1100  # above the widest concurrency: the relay, not the queue, is measured
WORDS = 64


@dataclass(frozen=True)
class Scenario:
    name: str
    concurrency: int
    requests: int
    words: int = WORDS
    paced: bool = False
    repeats: int = 1


@dataclass(frozen=True)
class Path:
    name: str
    base: str  # the direct path it is compared with
    edge: bool  # through the Edge (else straight to the provider)
    separator: bytes

    def target(self, ports, scenario):
        """
        C{(port, request bytes)} for one request of C{scenario}.
        """
        prompt = " ".join(f"w{i}" for i in range(scenario.words))
        messages = [{"role": "user", "content": prompt}]
        slow = scenario.paced
        if self.name in ("direct", "floor"):
            port, path = ports["openai" if self.name == "direct" else "floor"], "/v1/chat/completions"
            body = {"model": "slow-model" if slow else "fake-model", "stream": True, "messages": messages}
        elif self.name == "tunnel":
            port, path = ports["edge"], "/v1/chat/completions"
            body = {"model": "bench-slow" if slow else "bench", "stream": True, "messages": messages}
        elif self.name == "direct-ollama":
            port, path = ports["ollama"], "/api/chat"
            body = {"model": "slow-model" if slow else "fake-model", "stream": True, "messages": messages}
        elif self.name == "run":
            port, path = ports["edge"], "/v1/runs"
            body = {"model": "bench-ollama-slow" if slow else "bench-ollama", "stream": True, "input": messages}
        else:
            port, path = ports["edge"], "/v1/chat/completions"
            body = {"model": "bench-ollama-slow" if slow else "bench-ollama", "stream": True, "messages": messages}
        return port, loadgen.post(port, path, body)


PATHS = [
    Path("direct", "direct", False, SSE),
    Path("tunnel", "direct", True, SSE),
    # The tunnel's processes and libraries without the product (floor.py):
    # the best any relay on this stack reaches on this machine.
    Path("floor", "direct", True, SSE),
    Path("direct-ollama", "direct-ollama", False, NDJSON),
    Path("run", "direct-ollama", True, SSE),
    Path("run-openai", "direct-ollama", True, SSE),
]


def scenarios(args):
    """
    The scenarios, with C{requests} per run and C{repeats} runs: the paths
    take turns run by run, so a load that comes and goes on a shared
    machine weighs on every path alike, and the median of the runs is
    kept.
    """
    full = args.full
    n = args.requests
    mid = args.concurrency
    # --requests asks for an exact count: one run, unless --repeats too.
    repeats = args.repeats or (1 if n else 3)
    # c=1000 needs 1,000 requests for a single round: once in the short form.
    wide_repeats = args.repeats or (3 if full else 1)
    return [
        Scenario("burst c=1", 1, n or (500 if full else 100), repeats=repeats),
        Scenario(f"burst c={mid}", mid, n or (2000 if full else 400), repeats=repeats),
        Scenario(f"burst c={args.wide}", args.wide, n or (2 * args.wide if full else args.wide), repeats=wide_repeats),
        Scenario(f"paced c={mid}", mid, n or (500 if full else 100), paced=True, repeats=repeats),
        Scenario(f"paced c={args.paced_wide}", args.paced_wide, n or args.paced_wide, paced=True, repeats=repeats),
        # One stream at a time, three in a row (one with --requests), each
        # run: a single 20,000-chunk stream lasts a fraction of a second.
        Scenario(f"one {args.long_chunks}-chunk stream", 1, 1 if n else 3, words=args.long_chunks, repeats=repeats),
    ]


def percentile(values, q):
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


def measure(path, scenario, ports, pids, gc_dir):
    """
    Run C{scenario} once on C{path}. @return: a dict of figures.
    """
    port, request = path.target(ports, scenario)
    since = time.time()
    overflows = procstat.listen_overflows()
    meter = procstat.Meter({**pids, "client": None}).start()
    results, wall = loadgen.run_load(port, [request] * scenario.requests, scenario.concurrency, path.separator)
    # Work a daemon still does after the last answer (a store catching
    # up) belongs to this path, not to the next one measured.
    trailing = procstat.settle([pids["edge"], pids["node"]])
    spent = meter.stop()
    ok = [r for r in results if r.ok]
    errors = {}
    for r in results:
        if not r.ok:
            reason = r.error or f"HTTP {r.status}"
            errors[reason] = errors.get(reason, 0) + 1
    chunks = len(ok) * scenario.words
    firsts = [r.first for r in ok]
    gaps = [r.max_gap for r in ok]
    figures = {
        "requests": len(results),
        "ok": len(ok),
        "errors": errors,
        "wall": wall,
        "ttfb_p50": percentile(firsts, 0.5),
        "ttfb_p99": percentile(firsts, 0.99),
        "chunks_per_s": chunks / wall if wall else 0.0,
        "max_gap": max(gaps, default=float("nan")),
        "gap_p99": percentile(gaps, 0.99),
        "stalls": sum(1 for gap in gaps if gap > STALL_SEC),
        "events": statistics.median(r.events for r in ok) if ok else 0,
        "trailing": trailing,
        "listen_overflows": procstat.listen_overflows() - overflows,
    }
    for name in ("edge", "node"):
        longest, cpu, full = procstat.gc_summary(procstat.gc_passes(gc_dir, pids[name], since, time.time()))
        figures[f"gc_{name}_longest"] = longest
        figures[f"gc_{name}_cpu"] = cpu
        figures[f"gc_{name}_full"] = full
    for name, seconds in spent.items():
        figures[f"cpu_{name}"] = seconds
        figures[f"cpu_{name}_per_request"] = seconds / max(len(ok), 1)
        figures[f"cpu_{name}_per_chunk"] = seconds / max(chunks, 1)
    return figures


def median_of(runs):
    """
    The median of each figure over repeated runs (errors are summed).
    """
    merged = {}
    for key in runs[0]:
        values = [run[key] for run in runs]
        if key == "errors":
            total = {}
            for errors in values:
                for reason, count in errors.items():
                    total[reason] = total.get(reason, 0) + count
            merged[key] = total
        elif key in ("requests", "ok", "listen_overflows", "stalls"):
            merged[key] = sum(values)
        else:
            merged[key] = statistics.median(values)
    return merged


def start(workdir, edge_config_extra=None):
    """
    Start both fake providers, the Edge and the Node. @return:
    C{(launcher, providers, ports, pids)}; the caller stops them.
    """
    providers = {}
    launcher = Launcher(workdir)
    try:
        for kind in ("openai", "ollama"):
            providers[kind] = FakeProvider(PROVIDER, workdir, kind, PACE_MS)
        node_conf = {
            "id": "bench-node",
            "token": "bench-token",
            "adapters": [
                {
                    "name": "openai",
                    "type": "openai_compat",
                    "max_concurrency": CAPACITY,
                    "base_url": providers["openai"].url("/v1"),
                },
                {
                    "name": "ollama",
                    "type": "ollama",
                    "max_concurrency": CAPACITY,
                    "base_url": providers["ollama"].url(),
                },
            ],
            "providers": [
                {"id": "openai", "adapter": "openai", "capacity": {"normal": CAPACITY, "long": 0}},
                {"id": "ollama", "adapter": "ollama", "capacity": {"normal": CAPACITY, "long": 0}},
            ],
        }

        def group(name, provider, target):
            member = {"node": "bench-node", "provider": provider, "target": target}
            return {"name": name, "providers": [member], "queue_timeout_sec": 120}

        groups = [
            group("bench", "openai", "fake-model"),
            group("bench-slow", "openai", "slow-model"),
            group("bench-ollama", "ollama", "fake-model"),
            group("bench-ollama-slow", "ollama", "slow-model"),
        ]
        # Every caller is this one process on 127.0.0.1, as behind a load
        # balancer: the doors per source address are off, as there.
        limits = {"max_http_connections_per_address": 0}
        edge = launcher.edge(
            {"nodes": [node_conf], "model_groups": groups, "limits": limits, **(edge_config_extra or {})}
        )
        node = launcher.node(edge.node_port, "bench-token")
        edge.wait_connected("bench-node")
    except BaseException:
        launcher.stop_all()
        for provider in providers.values():
            provider.stop()
        raise
    ports = {"edge": edge.http_port, "openai": providers["openai"].port, "ollama": providers["ollama"].port}
    pids = {"edge": edge.pid, "node": node.pid}
    return launcher, providers, ports, pids


def run(args):
    """
    Every scenario on every path. @return: C{{"scenarios": {name: {path:
    figures}}, "memory": {...}}}.
    """
    procstat.raise_open_files()
    workdir = tempfile.mkdtemp(prefix="iop-bench-relay-")
    gc_dir = os.path.join(workdir, "gc")
    floor_processes = []
    with procstat.gc_watched(gc_dir):
        launcher, providers, ports, pids = start(workdir)
    try:
        with procstat.gc_watched(gc_dir):
            floor_processes, ports["floor"] = floor.start(workdir, providers["openai"].url("/v1/chat/completions"))
        # The provider that serves a path is the one whose CPU counts, and
        # the floor's path has its own Edge and Node.
        daemons = {
            "openai": {"edge": pids["edge"], "node": pids["node"], "provider": providers["openai"].process.pid},
            "ollama": {"edge": pids["edge"], "node": pids["node"], "provider": providers["ollama"].process.pid},
        }
        pids_for = {path.name: daemons["ollama" if "ollama" in path.base else "openai"] for path in PATHS}
        pids_for["floor"] = {**daemons["openai"], "edge": floor_processes[0].pid, "node": floor_processes[1].pid}
        warm = Scenario("warm-up", 4, 16)
        for path in PATHS:  # warm up connections and code paths
            measure(path, warm, ports, pids_for[path.name], gc_dir)
        memory = {"rest": {name: procstat.memory(pids[name])[0] for name in ("edge", "node")}}
        results = {}
        for scenario in scenarios(args):
            results[scenario.name] = {}
            runs = {path.name: [] for path in PATHS}
            for _ in range(scenario.repeats):
                for path in PATHS:
                    runs[path.name].append(measure(path, scenario, ports, pids_for[path.name], gc_dir))
            for path in PATHS:
                results[scenario.name][path.name] = median_of(runs[path.name])
            print_scenario(scenario, results[scenario.name])
            memory[scenario.name] = {name: procstat.memory(pids[name])[0] for name in ("edge", "node")}
        memory["peak"] = {name: procstat.memory(pids[name])[1] for name in ("edge", "node")}
        result = {"scenarios": results, "memory": memory, "order": [s.name for s in scenarios(args)]}
    finally:
        floor.stop(floor_processes)
        launcher.stop_all()
        for provider in providers.values():
            provider.stop()
        procstat.keep_on_failure(workdir)
    return result


def ms(seconds):
    return f"{seconds * 1000:.2f}"


def added_ms(seconds):
    return f"{seconds * 1000:+.2f}"


def us(seconds):
    return f"{seconds * 1e6:.1f}"


def print_scenario(scenario, figures):
    paced = "paced 5 ms/event" if scenario.paced else "burst"
    print(
        f"\n{scenario.name}: {scenario.words} chunks per stream, {paced}, "
        f"{scenario.requests} requests per path and run, median of {scenario.repeats} run(s)"
    )
    header = (
        f"{'path':14} {'ok':>11} {'ttfb p50':>9} {'ttfb p99':>9} {'chunks/s':>9} {'x direct':>8} "
        f"{'max gap':>8} {'gap p99':>8} {'Edge ms/req':>11} {'Node ms/req':>11} {'Edge us/ch':>10} {'Node us/ch':>10} "
        f"{'prov ms/req':>11} {'caller ms/req':>13} {'busy after':>10} {'GC max E/N ms':>13}"
    )
    print(header)
    for name, f in figures.items():
        path = next(p for p in PATHS if p.name == name)
        base = figures[path.base]
        ratio = f["chunks_per_s"] / base["chunks_per_s"] if base["chunks_per_s"] else float("nan")
        through = path.edge
        print(
            f"{name:14} {f['ok']:>5}/{f['requests']:<5} {ms(f['ttfb_p50']):>9} {ms(f['ttfb_p99']):>9} "
            f"{f['chunks_per_s']:9.0f} {ratio:8.2f} {ms(f['max_gap']):>8} {ms(f['gap_p99']):>8} "
            f"{ms(f['cpu_edge_per_request']) if through else '-':>11} "
            f"{ms(f['cpu_node_per_request']) if through else '-':>11} "
            f"{us(f['cpu_edge_per_chunk']) if through else '-':>10} "
            f"{us(f['cpu_node_per_chunk']) if through else '-':>10} "
            f"{ms(f['cpu_provider_per_request']):>11} {ms(f['cpu_client_per_request']):>13} "
            f"{f['trailing']:9.2f}s "
            f"{ms(f['gc_edge_longest']) + '/' + ms(f['gc_node_longest']) if through else '-':>13}"
        )
        if f["errors"]:
            print(f"{'':14} errors: {f['errors']}")
        if f["listen_overflows"]:
            print(f"{'':14} {f['listen_overflows']} connections overflowed a listen queue (retried by TCP)")


def ratio(figures, scenario, path):
    f = figures[scenario][path]
    base = figures[scenario][next(p.base for p in PATHS if p.name == path)]
    return f["chunks_per_s"] / base["chunks_per_s"] if base["chunks_per_s"] else float("nan")


#: The direct provider's CPU per request (ms) in the reference run
#: (bench/README.md, 2026-11-29) at c=1 and c=50, where the targets of
#: 0.6 ms (Edge) and 0.8 ms (Node) per request were set: the targets as
#: multiples of the provider's own CPU, for a machine of another speed.
REFERENCE_PROVIDER_MS = (0.54, 0.44)
CPU_TARGETS_MS = (0.6, 0.8)


def per_provider(path, direct):
    """
    A path's Edge and Node CPU per request over the direct provider's.
    """
    provider = direct["cpu_provider_per_request"]
    if not provider:
        return "-"
    return f"{path['cpu_edge_per_request'] / provider:.2f} / {path['cpu_node_per_request'] / provider:.2f}x"


def cpu_ratio_targets():
    edge, node = CPU_TARGETS_MS
    return " ; ".join(f"<= {edge / ref:.2f} / <= {node / ref:.2f}x" for ref in REFERENCE_PROVIDER_MS)


def summary(result):
    """
    The relay rows of the table: C{(figure, measured, target)}; the
    targets are the lean relay's (relay CPU, throughput and stalls as
    ratios against direct).
    """
    s = result["scenarios"]
    c1, c50, wide, paced, paced_wide, long = result["order"]
    t, d, f = s[c1]["tunnel"], s[c1]["direct"], s[c1]["floor"]
    rows = [
        (
            "added first-byte latency at c=1 (tunnel), p50 / p99",
            f"{added_ms(t['ttfb_p50'] - d['ttfb_p50'])} / {added_ms(t['ttfb_p99'] - d['ttfb_p99'])} ms "
            f"(floor {added_ms(f['ttfb_p50'] - d['ttfb_p50'])} / {added_ms(f['ttfb_p99'] - d['ttfb_p99'])} ms)",
            "<= +2 / <= +5 ms",
        ),
        (
            f"Edge / Node CPU per request (tunnel), {c1} ; {c50}",
            f"{ms(t['cpu_edge_per_request'])} / {ms(t['cpu_node_per_request'])} ms ; "
            f"{ms(s[c50]['tunnel']['cpu_edge_per_request'])} / {ms(s[c50]['tunnel']['cpu_node_per_request'])} ms",
            "<= 0.6 / <= 0.8 ms",
        ),
        (
            f"the same over the direct provider's CPU per request (same run), {c1} ; {c50}",
            f"{per_provider(t, d)} ; {per_provider(s[c50]['tunnel'], s[c50]['direct'])}",
            cpu_ratio_targets(),
        ),
        (
            f"the floor's Edge / Node CPU per request (floor.py: the same stack, no product), {c1} ; {c50}",
            f"{ms(s[c1]['floor']['cpu_edge_per_request'])} / {ms(s[c1]['floor']['cpu_node_per_request'])} ms ; "
            f"{ms(s[c50]['floor']['cpu_edge_per_request'])} / {ms(s[c50]['floor']['cpu_node_per_request'])} ms",
            "(reported)",
        ),
        (
            f"burst chunks/s vs direct, {c1} / {c50.split()[-1]} / one long stream",
            f"{ratio(s, c1, 'tunnel'):.2f} / {ratio(s, c50, 'tunnel'):.2f} / {ratio(s, long, 'tunnel'):.2f} "
            f"(floor {ratio(s, c1, 'floor'):.2f} / {ratio(s, c50, 'floor'):.2f} / {ratio(s, long, 'floor'):.2f})",
            ">= 0.5 each",
        ),
    ]
    for path, label in (("run", "native runs"), ("run-openai", "OpenAI rendering")):
        rows.append(
            (
                f"normalized path ({label}), same scenarios",
                f"{ratio(s, c1, path):.2f} / {ratio(s, c50, path):.2f} / {ratio(s, long, path):.2f}",
                ">= 0.4 each",
            )
        )
    o = s[c1]["direct-ollama"]
    rows.append(
        (
            "added first-byte latency at c=1, normalized (native ; OpenAI rendering), p50 / p99",
            f"{added_ms(s[c1]['run']['ttfb_p50'] - o['ttfb_p50'])} / "
            f"{added_ms(s[c1]['run']['ttfb_p99'] - o['ttfb_p99'])} ms ; "
            f"{added_ms(s[c1]['run-openai']['ttfb_p50'] - o['ttfb_p50'])} / "
            f"{added_ms(s[c1]['run-openai']['ttfb_p99'] - o['ttfb_p99'])} ms",
            "(reported)",
        )
    )
    rows.append(
        (
            f"Edge / Node CPU per request, normalized (native ; OpenAI rendering), {c1}",
            f"{ms(s[c1]['run']['cpu_edge_per_request'])} / {ms(s[c1]['run']['cpu_node_per_request'])} ms ; "
            f"{ms(s[c1]['run-openai']['cpu_edge_per_request'])} / {ms(s[c1]['run-openai']['cpu_node_per_request'])} ms",
            "(reported)",
        )
    )
    p, pd = s[paced]["tunnel"], s[paced]["direct"]
    rows.append(
        (
            f"paced provider (5 ms/event), {paced.split()[-1]}: ratio; longest gap",
            f"{ratio(s, paced, 'tunnel'):.2f} (floor {ratio(s, paced, 'floor'):.2f}); "
            f"{ms(p['max_gap'])} ms (direct {ms(pd['max_gap'])} ms); "
            f"p99 of per-stream longest gaps {ms(p['gap_p99'])} ms (direct {ms(pd['gap_p99'])} ms)",
            ">= 0.95; <= 2x direct's",
        )
    )
    stalls = {name: s[paced_wide][name]["stalls"] for name in ("direct", "tunnel", "floor", "direct-ollama", "run")}
    rows.append(
        (
            f"streams stalled (a gap over {STALL_SEC * 1000:.0f} ms), {paced_wide}: "
            "tunnel (direct; floor) / run (direct)",
            f"{stalls['tunnel']} ({stalls['direct']}; {stalls['floor']}) / {stalls['run']} ({stalls['direct-ollama']}) "
            f"of {s[paced_wide]['tunnel']['requests']:,}",
            "<= 1.25x direct's",
        )
    )
    w = s[wide]
    failed = {name: w[name]["requests"] - w[name]["ok"] for name in ("tunnel", "run", "run-openai")}
    rows.append(
        (
            f"{wide.split()[-1]} concurrent streams: failed (tunnel / run / run-openai)",
            f"{failed['tunnel']} / {failed['run']} / {failed['run-openai']} of {w['tunnel']['requests']:,} "
            f"(all runs), {w['tunnel']['listen_overflows']:,} / {w['run']['listen_overflows']:,} / "
            f"{w['run-openai']['listen_overflows']:,} listen-queue overflows (direct {w['direct']['listen_overflows']:,}); "
            f"chunks/s vs direct {ratio(s, wide, 'tunnel'):.2f} / {ratio(s, wide, 'run'):.2f} / "
            f"{ratio(s, wide, 'run-openai'):.2f}",
            "0 errors",
        )
    )
    mem = result["memory"]
    mib = 1024 * 1024
    rows.append(
        (
            "RSS Edge / Node: at rest; peak",
            f"{mem['rest']['edge'] / mib:.0f} / {mem['rest']['node'] / mib:.0f} MiB; "
            f"{mem['peak']['edge'] / mib:.0f} / {mem['peak']['node'] / mib:.0f} MiB",
            "(reported)",
        )
    )
    return rows


def print_table(rows, title="figures and targets"):
    width = max(len(r[0]) for r in rows)
    mwidth = max(len(r[1]) for r in rows)
    print(f"\n{title}")
    print(f"| {'figure':{width}} | {'measured':{mwidth}} | target |")
    print(f"|{'-' * (width + 2)}|{'-' * (mwidth + 2)}|---|")
    for figure, measured, target in rows:
        print(f"| {figure:{width}} | {measured:{mwidth}} | {target} |")


def parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--full", action="store_true", help="larger counts, medians of 3 runs")
    p.add_argument(
        "--requests", type=int, default=0, help="requests of every scenario, one run each (default: by mode)"
    )
    p.add_argument("--concurrency", type=int, default=50, help="the middle concurrency (default 50)")
    p.add_argument("--wide", type=int, default=1000, help="the widest concurrency (default 1000)")
    p.add_argument("--paced-wide", type=int, default=256, help="paced streams at once for stalls (default 256)")
    p.add_argument("--long-chunks", type=int, default=20000, help="chunks of the one long stream (default 20000)")
    p.add_argument(
        "--repeats", type=int, default=0, help="runs per scenario, medians kept (default 3; c=1000 short: 1)"
    )
    p.add_argument("--json", help="also write every figure to this file")
    return p


def main(argv=None):
    args = parser().parse_args(argv)
    result = run(args)
    print_table(summary(result), "relay figures")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
