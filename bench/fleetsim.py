"""
Many simulated Nodes in one process, built on the project's own wire code
(L{iop.protocols.wire.WireProtocol}), against a real Edge.

Each simulated Node dials the Edge's Node port, registers with its token
(C{RegisterRequest} with this code's C{WIRE_VERSION}), adopts the Edge's
heartbeat timings, says it is ready, answers pings (L{WireProtocol} does)
and pings in turn, and answers every C{RunRequest} like the echo adapter:
C{start}, one C{delta} per word of the last user message, C{complete} —
one event every C{pace_ms} (all at once with 0). No adapter, no store, no
HTTP client: a simulated Node costs a connection and a few timers, so a
thousand fit in one process and the Edge is what is measured.

A dropped Node is not redialed: the bench counts drops.

Run as a process (the bench and the fleet test do, so the simulator's
reactor is not the callers'):

    python bench/fleetsim.py --port EDGE_NODE_PORT --nodes N --stats PATH [--pace-ms 5]

It writes its counters to C{PATH} (JSON, replaced atomically) every 0.25 s
and once more when it stops (SIGTERM, or C{--deadline} seconds).
L{FleetProcess} runs it from Python; L{edge_config} builds the matching
C{edge.yaml}.
"""

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time

from twisted.internet.endpoints import TCP4ClientEndpoint
from twisted.internet.task import LoopingCall
from zope.interface import implementer

from iop.protocols import messages
from iop.protocols.wire import WIRE_VERSION, Heartbeat, IWireReceiver, WireFactory

HERE = os.path.dirname(os.path.abspath(__file__))

_WORD = re.compile(r"\S+\s*|\s+")


def node_id(i):
    return f"sim-{i:04d}"


def token(i):
    return f"sim-token-{i:04d}"


def edge_config(nodes, capacity, queue_timeout_sec=120, **extra):
    """
    An C{edge.yaml} (as a dict, without C{listen}) for C{nodes} simulated
    Nodes, each with one echo adapter and provider of C{capacity}, and one
    model group C{fleet} over all of them.

    Registration of the whole fleet at once is allowed
    (C{limits.max_unregistered_connections} above C{nodes}): a real fleet
    redials in waves, the bench dials every Node in the same second.
    """
    config = {
        "nodes": [
            {
                "id": node_id(i),
                "token": token(i),
                "adapters": [{"name": "echo", "type": "echo", "max_concurrency": capacity}],
                "providers": [{"id": "echo", "adapter": "echo", "capacity": {"normal": capacity, "long": 0}}],
            }
            for i in range(nodes)
        ],
        "model_groups": [
            {
                "name": "fleet",
                "providers": [{"node": node_id(i), "provider": "echo", "target": "sim"} for i in range(nodes)],
                "queue_timeout_sec": queue_timeout_sec,
            }
        ],
        # The callers are one process on 127.0.0.1 (as behind a load
        # balancer): no HTTP doors per source address.
        "limits": {
            "max_unregistered_connections": max(256, nodes + 16),
            "max_waiting": 100000,
            "max_http_connections_per_address": 0,
        },
    }
    config.update(extra)
    return config


class Counters:
    """
    What the fleet has done; written out as JSON.
    """

    def __init__(self, nodes):
        self.nodes = nodes
        self.connected = 0
        self.ready = 0
        self.refused = 0
        self.lost = 0
        self.reasons = {}  # why connections were refused, failed or lost
        self.runs_started = 0
        self.runs_completed = 0
        self.runs_cancelled = 0
        self.dial_started = None
        self.registration_sec = None

    def json(self):
        data = dict(vars(self))
        data["cpu_sec"] = os.times().user + os.times().system
        data["written_at"] = time.time()
        return data


class SimulatedRun:
    """
    One run: the echo adapter's events, paced.
    """

    def __init__(self, node, request):
        self.node = node
        self.run_id = request.run_id
        text = ""
        for message in reversed(request.messages):
            if message.role == "user":
                text = message.content
                break
        self.words = _WORD.findall(text)
        self.seq = 0
        self.next = 0
        self.call = None

    def event(self, type, **fields):
        self.seq += 1
        self.node.wire.send(messages.run_event(run_id=self.run_id, type=type, seq=self.seq, **fields))

    def start(self):
        self.event("start")
        self.step()

    def step(self):
        self.call = None
        pace = self.node.fleet.pace
        while self.next < len(self.words):
            self.event("delta", text=self.words[self.next])
            self.next += 1
            if pace:
                self.call = self.node.fleet.reactor.callLater(pace, self.step)
                return
        usage = messages.usage(input_tokens=len(self.words), output_tokens=len(self.words))
        self.event("complete", usage=usage, finish_reason="stop")
        self.node.finished(self, cancelled=False)

    def cancel(self):
        if self.call is not None and self.call.active():
            self.call.cancel()
        self.event("cancelled", error=messages.run_error(code="cancelled", message="cancelled by the Edge"))
        self.node.finished(self, cancelled=True)


@implementer(IWireReceiver)
class SimulatedNode:
    """
    One Node's side of the wire (an C{IWireReceiver}).
    """

    def __init__(self, fleet, token):
        self.fleet = fleet
        self.token = token
        self.wire = None
        self.node_id = None
        self.runs = {}
        self.ready = False

    def wire_connected(self, wire):
        self.wire = wire
        self.fleet.counters.connected += 1
        wire.send(messages.register_request(token=self.token, node_version="fleetsim", wire_version=WIRE_VERSION))

    def message_received(self, kind, message):
        if kind == "run_request":
            run = SimulatedRun(self, message)
            self.runs[run.run_id] = run
            self.fleet.counters.runs_started += 1
            run.start()
        elif kind == "cancel_request":
            run = self.runs.get(message.run_id)
            if message.kind == messages.CANCEL_RUN and run is not None:
                run.cancel()
        elif kind == "register_response":
            if not message.accepted:
                self.fleet.counters.refused += 1
                self.fleet.note_reason(f"refused: {message.reason}")
                return
            self.node_id = message.config.node_id
            config = message.config
            # The Edge's timings, as a Node adopts them (zero: keep the default).
            default = self.wire.heartbeat
            self.wire.set_heartbeat(
                Heartbeat(
                    config.heartbeat_interval_sec or default.interval,
                    config.heartbeat_timeout_sec or default.timeout,
                )
            )
            self.wire.send(messages.ready_request(node_id=self.node_id))
        elif kind == "node_ready_response":
            if message.ready and not self.ready:
                self.ready = True
                self.fleet.node_ready()
        # window_update: a run's deltas are a few bytes, far under the
        # 512 KiB window, so credit never runs out; config_refresh,
        # edge_draining, commands: not simulated.

    def finished(self, run, cancelled):
        self.runs.pop(run.run_id, None)
        if cancelled:
            self.fleet.counters.runs_cancelled += 1
        else:
            self.fleet.counters.runs_completed += 1

    def wire_lost(self, reason):
        for run in list(self.runs.values()):
            if run.call is not None and run.call.active():
                run.call.cancel()
        self.runs.clear()
        self.fleet.counters.lost += 1
        self.fleet.counters.connected -= 1
        if self.ready:
            self.fleet.counters.ready -= 1
            self.ready = False
        self.fleet.note_reason(str(getattr(reason, "value", reason)))


class Fleet:
    """
    C{nodes} simulated Nodes dialing 127.0.0.1:C{port}.
    """

    def __init__(self, reactor, port, nodes, pace_ms, first=0):
        self.reactor = reactor
        self.port = port
        self.count = nodes
        self.first = first
        self.pace = pace_ms / 1000.0
        self.counters = Counters(nodes)
        self.nodes = []

    def dial(self):
        self.counters.dial_started = time.monotonic()
        for i in range(self.first, self.first + self.count):
            node = SimulatedNode(self, token(i))
            self.nodes.append(node)
            factory = WireFactory(lambda node=node: node, self.reactor, Heartbeat(2.0, 5.0))
            endpoint = TCP4ClientEndpoint(self.reactor, "127.0.0.1", self.port, timeout=30)
            endpoint.connect(factory).addErrback(self._dial_failed)

    def _dial_failed(self, failure):
        self.note_reason(f"dial failed: {failure.value}")
        self.counters.lost += 1

    def node_ready(self):
        self.counters.ready += 1
        if self.counters.ready == self.count and self.counters.registration_sec is None:
            self.counters.registration_sec = time.monotonic() - self.counters.dial_started

    def note_reason(self, reason):
        reasons = self.counters.reasons
        reasons[reason] = reasons.get(reason, 0) + 1


def write_json(path, data):
    partial = path + ".tmp"
    with open(partial, "w") as f:
        json.dump(data, f)
    os.replace(partial, path)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True, help="the Edge's Node port on 127.0.0.1")
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--first", type=int, default=0, help="number of the first node (default 0)")
    parser.add_argument("--pace-ms", type=float, default=5.0, help="between two events of a run (0: all at once)")
    parser.add_argument("--stats", required=True, help="write counters here (JSON)")
    parser.add_argument("--deadline", type=float, default=900.0, help="stop after this many seconds")
    args = parser.parse_args(argv)
    from twisted.internet import reactor  # only the program, never the classes, uses the global reactor

    fleet = Fleet(reactor, args.port, args.nodes, args.pace_ms, args.first)
    writer = LoopingCall(lambda: write_json(args.stats, fleet.counters.json()))
    writer.start(0.25)
    reactor.addSystemEventTrigger("before", "shutdown", lambda: write_json(args.stats, fleet.counters.json()))
    reactor.callLater(args.deadline, reactor.stop)
    reactor.callWhenRunning(fleet.dial)
    reactor.run()
    return 0


class FleetProcess:
    """
    L{main} as a subprocess, always stopped by L{stop}.
    """

    def __init__(self, workdir, port, nodes, pace_ms=5.0, deadline=600.0):
        self.nodes = nodes
        self.stats_path = os.path.join(workdir, "fleet-stats.json")
        self.log_path = os.path.join(workdir, "fleet.log")
        self._log = open(self.log_path, "ab")
        self.process = subprocess.Popen(
            [
                sys.executable,
                os.path.join(HERE, "fleetsim.py"),
                "--port",
                str(port),
                "--nodes",
                str(nodes),
                "--pace-ms",
                str(pace_ms),
                "--stats",
                self.stats_path,
                "--deadline",
                str(deadline),
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    @property
    def pid(self):
        return self.process.pid

    def stats(self):
        """
        The latest counters, or C{None} before the first write.
        """
        try:
            with open(self.stats_path) as f:
                return json.load(f)
        except (OSError, ValueError):
            return None

    def fresh_stats(self, timeout=10.0):
        """
        Counters written after this call (they are written every 0.25 s):
        what the simulator saw up to now. @raise AssertionError: none in time.
        """
        since = time.time()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            stats = self.stats()
            if stats and stats["written_at"] > since:
                return stats
            time.sleep(0.05)
        raise AssertionError(f"the fleet simulator wrote no counters for {timeout}s")

    def wait_ready(self, timeout=60.0):
        """
        Poll until every Node is ready. @return: the counters.
        @raise AssertionError: on a refusal, an exit or the deadline.
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            stats = self.stats()
            if self.process.poll() is not None:
                raise AssertionError(f"the fleet simulator exited: {self.output()[-2000:]}")
            if stats and (stats["refused"] or stats["lost"]):
                raise AssertionError(f"fleet registration failed: {stats}")
            if stats and stats["ready"] == self.nodes and stats["registration_sec"] is not None:
                return stats
            time.sleep(0.05)
        raise AssertionError(f"timed out after {timeout}s waiting for {self.nodes} nodes: {self.stats()}")

    def output(self):
        with open(self.log_path, "rb") as f:
            return f.read().decode("utf-8", "replace")

    def stop(self, timeout=15.0):
        """
        Stop the simulator (SIGTERM, then SIGKILL). @return: its last counters.
        """
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=timeout)
        self._log.close()
        return self.stats()


if __name__ == "__main__":
    sys.exit(main())
