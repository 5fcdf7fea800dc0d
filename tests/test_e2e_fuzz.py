"""
The wire fuzzer against a real Edge (issue 12, "Fuzzing"): a few thousand
random, mutated and lying frames on real sockets, from strangers and from
a connection registered as a node, while a real Node serves. The Edge
keeps serving, logs no traceback, and every lease is back at rest. The
in-memory fuzz tests (iop/test/test_fuzz_wire.py) go further; this one
checks the same on the real reactor and sockets, bounded in frames and
time.
"""

import socket
import time

from support.daemons import echo_node, wait_for
from support.probes import frame, still_serving

from iop.protocols import messages
from iop.protocols.wire import WIRE_VERSION
from iop.test.fuzz import RESULTS, RandomMessages, framed, random_chunk

SEED = 20261212


def drain(sock):
    try:
        sock.setblocking(False)
        while sock.recv(65536):
            pass
    except (BlockingIOError, OSError):
        pass
    finally:
        sock.setblocking(True)


def test_wire_fuzz_on_real_sockets(launch):
    """
    40 stranger connections and 20 registered ones sending random frames
    (about 2,000 in all): afterwards node-1 is connected and serves, no
    provider has a lease in use, and the Edge's log holds no traceback.
    """
    edge = launch.edge({"nodes": [echo_node("node-1", "tok-1"), echo_node("node-2", "tok-2")]})
    launch.node(edge.node_port, "tok-1")
    edge.wait_connected("node-1")
    generator = RandomMessages(SEED, ("run-x", "tun-x"))
    rng = generator.rng
    started = time.monotonic()
    for i in range(60):
        registered = i % 3 == 0
        with socket.create_connection(("127.0.0.1", edge.node_port), timeout=5) as sock:
            try:
                if registered:
                    sock.sendall(frame(messages.register_request(token="tok-2", wire_version=WIRE_VERSION)))
                    sock.sendall(frame(messages.ready_request(node_id="node-2")))
                    chunks = [framed(generator.envelope(RESULTS).SerializeToString()) for _ in range(80)]
                    chunks += [random_chunk(generator) for _ in range(rng.randrange(0, 3))]
                else:
                    chunks = [random_chunk(generator) for _ in range(rng.randrange(1, 7))]
                for chunk in chunks:
                    sock.sendall(chunk)
                drain(sock)
            except OSError:
                pass  # the Edge closed it: that is allowed
        assert time.monotonic() - started < 60, "fuzzing took too long"
    wait_for(lambda: not edge.node_connected("node-2"), what="node-2 gone")
    assert edge.node_connected("node-1")
    assert still_serving(edge)
    in_use = [p["in_use"] for n in edge.status()["nodes"] for p in n["providers"]]
    assert all(u == {"normal": 0, "long": 0} for u in in_use), in_use
    output = edge.output()
    assert "Traceback" not in output and "Unhandled" not in output, output[-3000:]
