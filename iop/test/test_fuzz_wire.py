"""
Hostile frames on the Node port, in memory (issue 12, "Fuzzing"): every
message type with random fields, mutated bytes, junk, oversize length
prefixes, from a stranger and from a registered, ready Node with work in
flight (run, tunnel and leased run ids mixed into the frames). Whatever
arrives, the Edge logs nothing as critical (no internal error), the other
Node stays connected, and once the fuzzing connection is gone every lease
is back at rest, nothing is left in flight and no stranger is counted.

Short here; C{make fuzz} runs up to 1,000,000 frames (L{iop.test.fuzz}).
"""

import copy
import os
import struct
import time

from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from iop.edge import commands, starter
from iop.edge.spec import RunSpec, TunnelSpec
from iop.protocols import messages
from iop.protocols.wire import MAX_FRAME_BYTES, WIRE_VERSION
from iop.test.fuzz import (
    LONG,
    LONG_FRAMES,
    LONG_SECONDS,
    RESULTS,
    RandomMessages,
    envelopes,
    framed,
    fuzz,
    mutated_bytes,
    random_chunk,
    watch_critical,
)
from iop.testing.edge import EDGE_YAML, EdgeHarness

#: n1 is the bystander; the fuzzing connection registers as n2, which has
#: an echo provider in the shared group and a tunnelling one of its own.
YAML: dict = copy.deepcopy(EDGE_YAML)
# Room for all the work it starts at once (direct work leases too).
for node in YAML["nodes"]:
    node["providers"][0]["capacity"]["normal"] = 2
YAML["nodes"][1]["adapters"].append(
    {"name": "llm", "type": "openai_compat", "max_concurrency": 2, "base_url": "http://x.invalid/v1"}
)
YAML["nodes"][1]["providers"].append({"id": "llm", "adapter": "llm", "capacity": {"normal": 2, "long": 0}})
YAML["model_groups"].append({"name": "big", "providers": [{"node": "n2", "provider": "llm"}]})

#: The ids the work started on n2 gets (the service's ids are made
#: predictable here), so that fuzzed frames can name work in flight.
IDS = ("run-f0", "run-f1", "run-f2", "tun-f3", "cmd-f4")


class Listener:
    """
    A run or tunnel listener that takes whatever it is told.
    """

    def __init__(self):
        self.work_id = None

    def for_work(self, kind, work_id):
        self.work_id = work_id
        return self

    def __getattr__(self, name):
        return lambda *args: None


def results():
    """
    Well-framed messages a ready Node may send, with random fields (ids
    mostly naming the work in flight).
    """
    return envelopes(IDS, RESULTS).map(lambda env: framed(env.SerializeToString()))


@st.composite
def anything(draw):
    """
    Any chunk of bytes for the wire: an envelope of any type (possibly
    mutated), junk, or a lying length prefix.
    """
    kind = draw(st.sampled_from(["envelope", "mutated", "junk", "oversize", "short"]))
    if kind in ("envelope", "mutated"):
        data = draw(envelopes(IDS)).SerializeToString()
        if kind == "mutated":
            data = draw(mutated_bytes(data))
        return framed(data)
    if kind == "junk":
        return draw(st.binary(min_size=1, max_size=64))
    if kind == "oversize":
        return struct.pack("!I", draw(st.sampled_from([65537, MAX_FRAME_BYTES + 1, 2**32 - 1])))
    return struct.pack("!I", draw(st.integers(5, 100))) + draw(st.binary(max_size=4))


#: How many frames one example sends at most (more in the long mode, where
#: setting up each example would otherwise dominate).
MOST = 64 if LONG else 8

#: A stranger's bytes, or a ready Node's: results first (they go deep),
#: then perhaps anything.
streams = st.one_of(
    st.tuples(st.just(False), st.lists(anything(), min_size=1, max_size=6)),
    st.tuples(
        st.just(True),
        st.builds(lambda a, b: a + b, st.lists(results(), max_size=MOST), st.lists(anything(), max_size=2)),
    ),
)


class WireFuzzTests(SynchronousTestCase):
    def setUp(self):
        self.edge = EdgeHarness(YAML)
        self.service = self.edge.service
        self.bystander, self.bystander_pump, _ = self.edge.register("tok-1")
        self.critical = watch_critical(self)
        self.counter = 0
        for module in (starter, commands):
            self.patch(module, "new_id", self.new_id)

    def new_id(self, prefix):
        work_id = f"{prefix}-f{self.counter}"
        self.counter += 1
        return work_id

    def start_work(self):
        """
        Work in flight on n2 (a direct run, a leased run, a leased tunnel)
        and on n1 (a leased run): @return: the ids on n2.
        """
        hi = [{"role": "user", "content": "hi"}]
        ids = []
        for spec in (
            RunSpec(messages=hi, adapter="echo", node="n2"),
            RunSpec(messages=hi, model="grp"),
            RunSpec(messages=hi, model="grp"),
            RunSpec(messages=hi, model="big", tunnel=TunnelSpec("POST", "/chat/completions", [], {"model": "big"})),
        ):
            listener = Listener()
            self.successResultOf(self.service.submit(spec, listener.for_work))
            ids.append(listener.work_id)
        return ids

    def settle(self):
        """
        End the bystander's work with terminals.
        """
        self.bystander_pump.flush()
        for request in self.bystander.of("run_request"):
            self.bystander.connection.send(messages.run_event(run_id=request.run_id, seq=1, type="complete"))
        self.bystander.received.clear()
        self.bystander_pump.flush()

    def test_node_port(self):
        """
        Any frames, before or after registration: no critical log, the
        bystander stays ready, and everything is at rest afterwards.
        """
        if LONG:
            self.long_run()
        else:
            fuzz(streams, self.check, short=150)

    def long_run(self):
        """
        The long mode: seeded random streams (fast) until the frame or time
        bound; the seed is printed to replay a failure
        (C{IOP_FUZZ_SEED}).
        """
        seed = int(os.environ.get("IOP_FUZZ_SEED") or time.time())
        print(f"fuzz: wire seed {seed}")
        generator = RandomMessages(seed, IDS)
        rng = generator.rng
        started, frames, examples = time.monotonic(), 0, 0
        while time.monotonic() - started < LONG_SECONDS and frames < LONG_FRAMES:
            if rng.random() < 0.7:
                chunks = [framed(generator.envelope(RESULTS).SerializeToString()) for _ in range(rng.randrange(0, 200))]
                chunks += [random_chunk(generator) for _ in range(rng.randrange(0, 3))]
                stream = (True, chunks)
            else:
                stream = (False, [random_chunk(generator) for _ in range(rng.randrange(1, 7))])
            frames += self.check(stream)
            examples += 1
        print(f"fuzz: {examples} examples, {frames} frames in {time.monotonic() - started:.0f}s")

    def check(self, stream):
        registered, chunks = stream
        if registered:
            node, pump, edge_protocol = self.edge.register("tok-2", wire_version=WIRE_VERSION)
            self.counter = 0
            self.start_work()
            self.service.command("n2", "capabilities").addErrback(lambda f: None)
            pump.flush()
        else:
            node, pump, edge_protocol = self.edge.connect()
        sent = 0
        for chunk in chunks:
            if node.lost:
                break
            node.transport.write(chunk)
            pump.flush()
            sent += 1
        node.transport.loseConnection()
        pump.flush()
        self.edge.pumps.remove(pump)
        self.settle()
        self.assertEqual(self.critical, [], chunks)
        self.assertIsNotNone(self.service.registry.ready_link("n1"))
        self.assertEqual(self.service.pool.active_leases(), [])
        self.assertEqual(len(self.service.inflight), 0)
        node_port = self.service.node_port
        assert node_port is not None
        self.assertEqual(node_port.unregistered, {})
        return sent
