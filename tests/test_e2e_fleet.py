"""
A fleet on loopback: 100 simulated Nodes (bench/fleetsim.py, the
project's own wire code in one process) registered with a real Edge, and
200 concurrent streamed chat completions placed over them. Every stream
must come back whole and no Node may be dropped.

Bounded: the simulator stops itself after two minutes whatever happens,
every wait has a deadline, each stream has 30 s, and the simulator and
the Edge are stopped in C{finally} / by the C{launch} fixture.
"""

import os
import sys

from support.daemons import wait_for

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import fleet  # noqa: E402
import fleetsim  # noqa: E402

NODES = 100
STREAMS = 200
WORDS = 20


def test_200_streams_over_100_simulated_nodes(launch, tmp_path):
    """
    200 streams (two per Node, each of 20 words paced 5 ms apart) all end
    with HTTP 200, exactly their own text, finish_reason stop and
    C{data: [DONE]}; the Edge and the simulator both still count 100
    Nodes connected, the simulator ran and completed 200 runs, and every
    lease is back afterwards.
    """
    edge = launch.edge(fleetsim.edge_config(NODES, capacity=STREAMS // NODES, queue_timeout_sec=30))
    sim = fleetsim.FleetProcess(str(tmp_path), edge.node_port, NODES, pace_ms=5, deadline=120)
    try:
        sim.wait_ready(timeout=30)
        wait_for(lambda: fleet.connected(edge) == NODES, what="the Edge to show every Node connected")

        results, _, problems = fleet.streams(edge, STREAMS, WORDS, timeout=30)

        assert problems == {}, problems
        assert len(results) == STREAMS
        assert fleet.connected(edge) == NODES
        stats = sim.fresh_stats()
        assert stats["lost"] == 0, stats["reasons"]
        assert stats["ready"] == NODES
        assert stats["runs_started"] == stats["runs_completed"] == STREAMS

        def at_rest():
            status = edge.status()
            in_use = [p["in_use"] for n in status["nodes"] for p in n["providers"]]
            return all(u == {"normal": 0, "long": 0} for u in in_use) and status["model_groups"][0]["queued"] == 0

        wait_for(at_rest, timeout=10, what="every lease back")
    finally:
        sim.stop()


HERD = 300


def test_herd_of_300_with_default_limits(launch, tmp_path):
    """
    300 simulated Nodes dialling in the same second against the default
    limits (256 unregistered connections, 32 per address: the whole herd
    comes from 127.0.0.1, and the simulator never redials) all register
    and are ready: the connections beyond the limits wait unread in their
    address's line and the hall instead of being reset.
    """
    config = fleetsim.edge_config(HERD, capacity=1)
    del config["limits"]
    edge = launch.edge(config)
    sim = fleetsim.FleetProcess(str(tmp_path), edge.node_port, HERD, deadline=120)
    try:
        stats = sim.wait_ready(timeout=30)
        assert stats["lost"] == stats["refused"] == 0, stats["reasons"]
        wait_for(lambda: fleet.connected(edge) == HERD, what="the Edge to show every Node connected")
        _, _, body = edge.request("GET", "/metrics")
        waits = [line for line in body.decode().splitlines() if line.startswith("iop_edge_node_port_waits_total ")]
        assert waits and float(waits[0].split()[1]) >= HERD - 32, waits
        print(f"herd of {HERD}: all ready {stats['registration_sec']:.2f}s after the first dial")
    finally:
        sim.stop()
