"""
Caller keys sharing one Edge (docs/edge.md, "Tenants"): a real Edge and
a real Node with one echo back end of 2 slots, on loopback.

  light wait   a heavy key keeps 30 streams queued; a light key sends one
               request after another (with a pause between, as a person
               does). Its wait until the first chunk, p50 and p99, as a
               ratio to one service time (the same request alone).
  shares       two keys, weights 3 and 1, both always backlogged, the
               second's requests twice as long: tokens served to each
               against its weight's share, and Jain's fairness index of
               (share / fair share) — 1.0 is perfectly fair.

    .venv/bin/python bench/tenants.py            # short: about a minute
    .venv/bin/python bench/tenants.py --tiny     # seconds: that it runs
"""

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

from support.daemons import Launcher, echo_node, wait_for  # noqa: E402

KEYS = {"heavy": 1, "light": 1, "big": 3, "small": 1}


def start(workdir, word_ms):
    launcher = Launcher(workdir)
    try:
        config = {
            "api_keys": [{"key": f"sk-{name}", "name": name, "weight": weight} for name, weight in KEYS.items()],
            "nodes": [echo_node("n1", "tok-n1", delay_ms=word_ms, max_concurrency=2)],
            "model_groups": [
                {"name": "m", "providers": [{"node": "n1", "provider": "echo"}], "queue_timeout_sec": 600}
            ],
        }
        edge = launcher.edge(config)
        launcher.node(edge.node_port, "tok-n1")
        edge.wait_connected("n1")
    except BaseException:
        launcher.stop_all()
        raise
    return launcher, edge


def request(edge, key, words):
    """
    One streamed completion read to its end. @return: seconds until its
    first chunk and until its end, from sending it.
    """
    body = {
        "model": "m",
        "stream": True,
        "messages": [{"role": "user", "content": " ".join(f"w{i}" for i in range(words))}],
    }
    sent = time.monotonic()
    conn, response = edge.stream("POST", "/v1/chat/completions", body, {"authorization": f"Bearer sk-{key}"}, 600)
    try:
        first = None
        for _ in range(100_000):
            line = response.readline()
            if not line or line.startswith(b"data: [DONE]"):
                break
            if first is None and line.startswith(b"data: "):
                first = time.monotonic()
        return (first or time.monotonic()) - sent, time.monotonic() - sent
    finally:
        conn.close()


class Backlog:
    """
    C{streams} threads sending C{key}'s requests one after another until
    stopped, so the key always has work waiting.
    """

    def __init__(self, edge, key, streams, words):
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._loop, args=(edge, key, words)) for _ in range(streams)]
        for thread in self.threads:
            thread.start()

    def _loop(self, edge, key, words):
        while not self.stop.is_set():
            try:
                request(edge, key, words)
            except OSError:
                if not self.stop.is_set():
                    raise

    def end(self):
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=120)


def tokens_by_key(edge):
    """
    Input plus output tokens served so far, by key, from C{/metrics}.
    """
    _, _, body = edge.request("GET", "/metrics")
    served = {}
    for line in body.decode().splitlines():
        if line.startswith("iop_edge_tokens_total{") and ('kind="input"' in line or 'kind="output"' in line):
            key = line.split('key="', 1)[1].split('"', 1)[0]
            served[key] = served.get(key, 0) + float(line.rsplit(" ", 1)[1])
    return served


def light_wait(edge, heavy_streams, light_requests, words, seed=7):
    _, service = request(edge, "light", words)
    heavy = Backlog(edge, "heavy", heavy_streams, words)
    try:
        wait_for(
            lambda: edge.json("GET", "/v1/queue", headers={"authorization": "Bearer sk-heavy"})[1]["queued"][
                heavy_streams - 4 :
            ],
            timeout=60,
            what="the heavy backlog",
        )
        pace = random.Random(seed)
        waits = []
        for _ in range(light_requests):
            time.sleep(pace.uniform(0, service))  # the light caller's own pace
            waits.append(request(edge, "light", words)[0])
    finally:
        heavy.end()
    waits.sort()
    return {
        "service_sec": service,
        "light_wait_p50_sec": statistics.median(waits),
        "light_wait_p99_sec": waits[min(len(waits) - 1, int(len(waits) * 0.99))],
        "light_requests": len(waits),
    }


def shares(edge, seconds, streams, words):
    before = tokens_by_key(edge)
    backlogs = [Backlog(edge, "big", streams, words), Backlog(edge, "small", streams, words * 2)]
    try:
        time.sleep(seconds)  # the measurement window, not synchronization
        after = tokens_by_key(edge)
    finally:
        for backlog in backlogs:
            backlog.end()
    served = {key: after.get(key, 0) - before.get(key, 0) for key in ("big", "small")}
    total = sum(served.values()) or 1
    weights = sum(KEYS[key] for key in served)
    ratios = [(served[key] / total) / (KEYS[key] / weights) for key in served]
    jain = sum(ratios) ** 2 / (len(ratios) * sum(r * r for r in ratios))
    return {
        "tokens": served,
        "share": {key: served[key] / total for key in served},
        "fair_share": {key: KEYS[key] / weights for key in served},
        "jain_index": jain,
    }


def run(tiny=False, word_ms=50, words=10):
    sizes = {"heavy_streams": 30, "light_requests": 8 if tiny else 40}
    with tempfile.TemporaryDirectory(prefix="iop-bench-tenants-") as workdir:
        launcher, edge = start(workdir, word_ms)
        try:
            figures = light_wait(edge, sizes["heavy_streams"], sizes["light_requests"], words)
            figures.update(shares(edge, 4 if tiny else 30, 6, words))
        finally:
            launcher.stop_all()
    return figures


def summary(figures):
    """
    Rows for a report: figure, measured, target.
    """
    service = figures["service_sec"]
    share = figures["share"]
    fair = figures["fair_share"]
    return [
        (
            "light tenant wait beside 30 queued heavy streams, p50 / p99 (x one service time)",
            f"{figures['light_wait_p50_sec'] / service:.2f} / {figures['light_wait_p99_sec'] / service:.2f}",
            "p50 <= 1",
        ),
        (
            "token shares, weights 3:1 (long requests on the 1)",
            f"{share['big']:.2f} : {share['small']:.2f} (fair {fair['big']:.2f} : {fair['small']:.2f})",
            "within 10% of the weights",
        ),
        ("Jain's fairness index of share / fair share", f"{figures['jain_index']:.3f}", "1.0 is fair"),
    ]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="the smallest sizes: only that it runs")
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args(argv)
    figures = run(tiny=args.tiny)
    for row in summary(figures):
        print(" | ".join(row))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
