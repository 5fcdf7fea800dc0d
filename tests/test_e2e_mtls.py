"""
Mutual TLS bound to node identity, on real processes (issue 12, finding
10): with C{node_tls}, a Node presenting its own certificate registers and
serves; the right token with another node's certificate is refused with a
clear reason (fatal for the Node: exit 2); a Node without a client
certificate, and a plain TCP stranger, never get past the handshake. The
certificates come from C{scripts/make_test_certs.py}.
"""

import os
import socket
import subprocess
import sys

import pytest
from support.daemons import echo_node
from support.probes import closed_by_peer, frame, refused_at_once

from iop.protocols import messages
from iop.protocols.wire import WIRE_VERSION

SCRIPT = os.path.join(os.path.dirname(__file__), os.pardir, "scripts", "make_test_certs.py")


@pytest.fixture
def fleet(tmp_path):
    out = str(tmp_path / "fleet")
    subprocess.run([sys.executable, SCRIPT, out, "--node", "node-1", "--node", "node-2"], check=True)
    return out


def tls_edge(launch, fleet, **extra):
    config = {
        "nodes": [echo_node("node-1", "tok-1"), echo_node("node-2", "tok-2")],
        "node_tls": {
            "certificate": os.path.join(fleet, "edge.pem"),
            "private_key": os.path.join(fleet, "edge.key"),
            "client_ca": os.path.join(fleet, "ca.pem"),
        },
        **extra,
    }
    return launch.edge(config)


def node_endpoint(edge, fleet, cert=None):
    endpoint = f"tls:localhost:{edge.node_port}:trustRoots={os.path.join(fleet, 'trust')}"
    if cert is not None:
        endpoint += f":certificate={os.path.join(fleet, cert + '.pem')}:privateKey={os.path.join(fleet, cert + '.key')}"
    return endpoint


def test_own_certificate_registers(launch, fleet):
    """
    A Node whose certificate names its node registers over mutual TLS and
    serves a completion.
    """
    edge = tls_edge(launch, fleet)
    launch.node(edge.node_port, "tok-1", extra={"edge": node_endpoint(edge, fleet, "node-1")})
    edge.wait_connected("node-1")
    status, body = edge.json(
        "POST", "/v1/chat/completions", {"model": "echo", "messages": [{"role": "user", "content": "over mtls"}]}
    )
    assert status == 200 and body["choices"][0]["message"]["content"] == "over mtls"


def test_other_nodes_certificate_refused(launch, fleet):
    """
    node-1's token with node-2's certificate is refused, naming the
    mismatch; the Node exits 2 (fatal credentials) and node-1 stays
    disconnected.
    """
    edge = tls_edge(launch, fleet)
    node = launch.node(
        edge.node_port,
        "tok-1",
        extra={"edge": node_endpoint(edge, fleet, "node-2")},
        reconnect={"max_attempts": 2, "interval_sec": 0.2},
    )
    assert node.wait(timeout=20) == 2
    assert "not node 'node-1'" in node.output()
    assert "not node 'node-1'" in edge.output()
    assert edge.node_connected("node-1") is False


def test_no_client_certificate(launch, fleet):
    """
    A Node with the right token but no client certificate, and a plain
    TCP stranger sending a RegisterRequest, never register.
    """
    edge = tls_edge(launch, fleet)
    node = launch.node(
        edge.node_port,
        "tok-1",
        extra={"edge": node_endpoint(edge, fleet)},
        reconnect={"max_attempts": 2, "interval_sec": 0.2},
    )
    assert node.wait(timeout=20) == 3
    with socket.create_connection(("127.0.0.1", edge.node_port), timeout=5) as sock:
        sock.sendall(frame(messages.register_request("tok-1", WIRE_VERSION)))
        assert closed_by_peer(sock)
    assert edge.node_connected("node-1") is False


def test_refused_at_the_doors_closed_at_once(launch, fleet):
    """
    With TLS on the Node port, a connection the limits refuse (every
    place and the hall taken) is closed at once, as without TLS: Twisted's
    TLS wrapper used to keep it open, for ever, a descriptor each.
    """
    edge = tls_edge(launch, fleet, limits={"max_unregistered_connections": 1, "max_unregistered_per_address": 1})
    held = [socket.create_connection(("127.0.0.1", edge.node_port), timeout=5) for _ in range(6)]
    try:
        assert all(refused_at_once(edge.node_port, timeout=2.0) for _ in range(5))
    finally:
        for sock in held:
            sock.close()
