"""
The Node port against strangers, on real sockets (issue 12, findings 2
and 4): oversize frames before registration cost the Edge neither memory
nor CPU, a connection that only pings is closed at the registration
deadline, strangers beyond the cap wait unread in the hall, and a stranger
holding 300 connections from one address does not keep a Node out. The registered
Node keeps serving throughout. Every loop is bounded.
"""

import os
import socket
import struct
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.daemons import Launcher, echo_node, wait_for
from support.probes import closed_by_peer, frame, refused_at_once, rss_bytes, still_serving

from iop.protocols import messages
from iop.protocols.wire import WIRE_VERSION

REGISTER_TIMEOUT = 1.5
PING_INTERVAL = 0.1
CAP = 4
STRANGER = "127.0.0.2"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    launcher = Launcher(str(tmp_path_factory.mktemp("node-port")))
    try:
        edge = launcher.edge(
            {
                "nodes": [echo_node("node-1", "tok-1")],
                "register_timeout_sec": REGISTER_TIMEOUT,
                "heartbeat": {"interval_sec": PING_INTERVAL, "timeout_sec": 5},
                "limits": {"max_unregistered_connections": CAP},
            }
        )
        launcher.node(edge.node_port, "tok-1")
        edge.wait_connected("node-1")
        yield edge
    finally:
        launcher.stop_all()


def cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def send_oversize(port, size):
    """
    A stranger announcing a C{size}-byte frame and pushing its body until
    the Edge closes the connection. @return: how many body bytes went out.
    """
    sent = 0
    chunk = b"\x00" * 65536
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        try:
            sock.sendall(struct.pack("!I", size))
            while sent < size:
                sock.sendall(chunk)
                sent += len(chunk)
        except OSError:
            pass
        assert closed_by_peer(sock)
    return sent


def is_pinged(sock, timeout=5.0):
    """
    Whether the Edge sends a frame on C{sock} within C{timeout}: it pings
    every connection it reads (every L{PING_INTERVAL} here), and answers
    none of a stranger's pings, so a frame says the connection was let in.
    """
    sock.settimeout(timeout)
    try:
        return bool(sock.recv(65536))
    except (TimeoutError, ConnectionResetError):
        return False


def read_frame(sock, timeout):
    """
    The first frame the Edge sends on C{sock} that is not a Ping, within
    C{timeout}. @return: the Envelope.
    """
    deadline = time.monotonic() + timeout
    data = b""
    while time.monotonic() < deadline:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        received = sock.recv(65536)
        assert received, "the Edge closed the connection"
        data += received
        while len(data) >= 4:
            (length,) = struct.unpack("!I", data[:4])
            if len(data) < 4 + length:
                break
            envelope = messages.Envelope.FromString(data[4 : 4 + length])
            data = data[4 + length :]
            if envelope.WhichOneof("body") != "ping":
                return envelope
    raise AssertionError(f"no frame within {timeout}s")


def scrape_value(edge, name, **labels):
    _, _, body = edge.request("GET", "/metrics")
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return sample.value
    return 0


def node_port_waiting(edge):
    return scrape_value(edge, "iop_edge_node_port_waiting_connections")


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs /proc")
def test_oversize_frames_before_registration_cost_nothing(served):
    """
    Twelve strangers each announcing a 15 MiB frame are closed on the
    length prefix: the Edge's RSS grows by less than 16 MiB and it spends
    less than a second of CPU on all of them (before the limit: +230 MiB
    and seconds of blocked reactor).
    """
    pid = served.pid
    rss_before, cpu_before = rss_bytes(pid), cpu_seconds(pid)
    for _ in range(12):
        sent = send_oversize(served.node_port, 15 * 1024 * 1024)
        assert sent < 15 * 1024 * 1024
    rss_after, cpu_after = rss_bytes(pid), cpu_seconds(pid)
    assert rss_after - rss_before < 16 * 1024 * 1024, (rss_before, rss_after)
    assert cpu_after - cpu_before < 1.0, (cpu_before, cpu_after)
    assert "exceeds the 65536-byte limit" in served.output()
    assert served.node_connected("node-1")
    assert still_serving(served)


def test_pinging_stranger_closed_at_deadline(served):
    """
    A connection that sends a Ping every 0.5 s (within its frame budget)
    but never registers is closed at C{register_timeout_sec}.
    """
    with socket.create_connection(("127.0.0.1", served.node_port), timeout=5) as sock:
        started = time.monotonic()
        closed = False
        for _ in range(int(REGISTER_TIMEOUT * 2) + 4):
            try:
                sock.sendall(frame(messages.ping(1)))
            except OSError:
                closed = True
                break
            if closed_by_peer(sock, timeout=0.5):
                closed = True
                break
        elapsed = time.monotonic() - started
    assert closed, "the Edge kept a pinging, unregistered connection open"
    assert REGISTER_TIMEOUT - 0.3 < elapsed < REGISTER_TIMEOUT + 2, elapsed
    assert "register_timeout_sec" in served.output()
    assert still_serving(served)


def test_strangers_beyond_the_cap_wait_in_the_hall(served):
    """
    With C{limits.max_unregistered_connections} strangers open, the next
    four times as many wait unread in the hall (not pinged, not closed), and
    one more beyond is closed at once; the registered Node is not
    disturbed; as the first strangers go away, the waiting ones are read.
    """
    idle = [socket.create_connection(("127.0.0.1", served.node_port), timeout=5) for _ in range(CAP)]
    hall = []
    try:
        # The Edge's ping on each proves it took it.
        for sock in idle:
            assert is_pinged(sock), "the Edge did not take a stranger's connection"
        hall = [socket.create_connection(("127.0.0.1", served.node_port), timeout=5) for _ in range(4 * CAP)]
        assert not is_pinged(hall[0], timeout=0.3), "a connection beyond the cap was read"
        assert not closed_by_peer(hall[-1], timeout=0.1)
        assert refused_at_once(served.node_port, timeout=1.0)
        assert served.node_connected("node-1")
        assert still_serving(served)
        for sock in idle:
            sock.close()
        # Read now, it is pinged.
        assert is_pinged(hall[0], timeout=REGISTER_TIMEOUT)
    finally:
        for sock in idle + hall:
            sock.close()
    wait_for(lambda: "max_unregistered_connections" in served.output(), what="the refusal logged")


NODE_PORT_STRANGERS = 300


def test_idle_stranger_does_not_keep_a_node_out(launch):
    """
    A stranger holding 300 idle Node-port connections from 127.0.0.2
    (default limits: 32 read, the rest in its line and the hall) does not
    keep a Node from 127.0.0.1 out: a registration from 127.0.0.1 is
    accepted within 2 s, taking the place of one of the stranger's waiting
    connections, and a real Node daemon registers too.
    """
    edge = launch.edge({"nodes": [echo_node("node-1", "tok-1"), echo_node("node-2", "tok-2")]})
    stranger = []
    try:
        for _ in range(NODE_PORT_STRANGERS):
            sock = socket.socket()
            sock.bind((STRANGER, 0))
            sock.connect(("127.0.0.1", edge.node_port))
            stranger.append(sock)
        wait_for(
            lambda: node_port_waiting(edge) >= NODE_PORT_STRANGERS - 32,
            what="the stranger's connections to wait",
        )
        started = time.monotonic()
        with socket.create_connection(("127.0.0.1", edge.node_port), timeout=5) as sock:
            sock.sendall(frame(messages.register_request("tok-2", WIRE_VERSION)))
            response = read_frame(sock, timeout=2.0)
            elapsed = time.monotonic() - started
            assert response.WhichOneof("body") == "register_response"
            assert response.register_response.accepted
        assert elapsed < 2.0, elapsed
        launch.node(edge.node_port, "tok-1")
        edge.wait_connected("node-1")
        assert scrape_value(edge, "iop_edge_refusals_total", reason="node_port_line_evicted") >= 1
    finally:
        for sock in stranger:
            sock.close()
