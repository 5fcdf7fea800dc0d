"""
Relay overhead of the Edge–Node path, as ratios against a direct
connection to the same provider in the same run.

Starts a loopback fake OpenAI-compatible provider, a real `iop-edge` and a
real `iop-node`, then times the same streamed chat completion three ways:

  direct   caller -> provider
  tunnel   caller -> Edge -> Node -> provider  (raw bytes relayed)
  run      caller -> Edge (native /v1/runs) -> Node -> provider (normalized)

For each: time to first byte and to the end of the stream, median and p95
over sequential requests, then the same under concurrency. Ratios (path /
direct) are what to compare between versions; absolute numbers depend on
the machine.

    .venv/bin/python bench/relay.py [--requests N] [--concurrency C]
"""

import argparse
import http.client
import json
import os
import statistics
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))  # the process harness: tests/support/
from support.daemons import FAKE_PROVIDERS, FakeProvider, Launcher  # noqa: E402

PROMPT = " ".join(f"word{i}" for i in range(64))


def timed_stream(port, path, body):
    """
    @return: (seconds to the first body byte, seconds to the end)
    """
    start = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", path, body=json.dumps(body), headers={"content-type": "application/json"})
        response = conn.getresponse()
        assert response.status == 200, response.read()
        response.read(1)
        first = time.perf_counter() - start
        response.read()
        return first, time.perf_counter() - start
    finally:
        conn.close()


def paths(provider_port, edge_port):
    messages = [{"role": "user", "content": PROMPT}]
    return {
        "direct": (
            provider_port,
            "/v1/chat/completions",
            {"model": "fake-model", "stream": True, "messages": messages},
        ),
        "tunnel": (edge_port, "/v1/chat/completions", {"model": "bench", "stream": True, "messages": messages}),
        "run": (edge_port, "/v1/runs", {"model": "bench", "stream": True, "input": messages}),
    }


def measure(target, requests, concurrency):
    samples = []
    lock = threading.Lock()
    per_worker = max(1, requests // concurrency)

    def worker():
        for _ in range(per_worker):
            sample = timed_stream(*target)
            with lock:
                samples.append(sample)

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    wall = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - wall
    return samples, wall


def p95(values):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.95))]


def report(name, results, concurrency):
    direct = results["direct"]
    print(f"\n{name} (concurrency {concurrency}, {len(direct[0])} requests per path)")
    print(
        f"{'path':8} {'ttfb p50':>10} {'ttfb p95':>10} {'total p50':>10} {'total p95':>10} {'req/s':>8} {'x direct (p50 total)':>22}"
    )
    base = statistics.median(s[1] for s in direct[0])
    for path, (samples, wall) in results.items():
        firsts = [s[0] for s in samples]
        totals = [s[1] for s in samples]
        print(
            f"{path:8} {statistics.median(firsts) * 1000:9.2f}ms {p95(firsts) * 1000:9.2f}ms "
            f"{statistics.median(totals) * 1000:9.2f}ms {p95(totals) * 1000:9.2f}ms "
            f"{len(samples) / wall:8.1f} {statistics.median(totals) / base:21.2f}x"
        )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args(argv)
    workdir = tempfile.mkdtemp(prefix="iop-bench-")
    provider = FakeProvider(FAKE_PROVIDERS, workdir, "openai", 0)
    node_conf = {
        "id": "bench-node",
        "token": "bench-token",
        "adapters": [{"name": "fake", "type": "openai_compat", "max_concurrency": 64, "base_url": provider.url("/v1")}],
        "providers": [{"id": "fake", "adapter": "fake", "capacity": {"normal": 64, "long": 0}}],
    }
    group = {"name": "bench", "providers": [{"node": "bench-node", "provider": "fake", "target": "fake-model"}]}
    launcher = Launcher(workdir)
    try:
        edge = launcher.edge({"nodes": [node_conf], "model_groups": [group]})
        launcher.node(edge.node_port, "bench-token")
        edge.wait_connected("bench-node")
        targets = paths(provider.port, edge.http_port)
        for target in targets.values():  # warm up connections and code paths
            timed_stream(*target)
        for concurrency in (1, args.concurrency):
            results = {name: measure(target, args.requests, concurrency) for name, target in targets.items()}
            report("streamed chat completion, 64 chunks", results, concurrency)
    finally:
        launcher.stop_all()
        provider.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
