"""
TLS is a configuration change: the same daemons, with an `ssl:` listener
on the Edge and a `tls:` client endpoint on the Node.
"""

import os

from cryptography.hazmat.primitives import serialization
from support.daemons import echo_node

from iop.testing.tls import self_signed


def certificate_files(directory):
    """
    A self-signed certificate for localhost / 127.0.0.1; returns the key
    and certificate paths and a trust-root directory holding the cert.
    """
    key, cert = self_signed()
    trust = os.path.join(directory, "trust")
    os.makedirs(trust, exist_ok=True)
    key_path, cert_path = os.path.join(directory, "edge.key"), os.path.join(directory, "edge.crt")
    with open(key_path, "wb") as f:
        f.write(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
    pem = cert.public_bytes(serialization.Encoding.PEM)
    for path in (cert_path, os.path.join(trust, "edge.pem")):
        with open(path, "wb") as f:
            f.write(pem)
    return key_path, cert_path, trust


def test_node_over_tls(launch, tmp_path):
    """
    A Node dials the Edge over TLS (certificate verified against a trust
    root), registers and serves a completion; a Node that does not trust
    the certificate never becomes connected.
    """
    key_path, cert_path, trust = certificate_files(str(tmp_path))
    edge = launch.edge({"nodes": [echo_node("node-1", "tok-1")]}, start=False)
    edge.rewrite_listen(nodes=f"ssl:{edge.node_port}:interface=127.0.0.1:privateKey={key_path}:certKey={cert_path}")
    edge.start()
    untrusting = launch.node(
        edge.node_port,
        "tok-1",
        extra={"edge": f"tls:localhost:{edge.node_port}"},
        reconnect={"max_attempts": 2, "interval_sec": 0.2},
    )
    assert untrusting.wait(timeout=20) != 0
    assert edge.node_connected("node-1") is False
    launch.node(edge.node_port, "tok-1", extra={"edge": f"tls:localhost:{edge.node_port}:trustRoots={trust}"})
    edge.wait_connected("node-1")
    status, body = edge.json(
        "POST", "/v1/chat/completions", {"model": "echo", "messages": [{"role": "user", "content": "over tls"}]}
    )
    assert status == 200 and body["choices"][0]["message"]["content"] == "over tls"
