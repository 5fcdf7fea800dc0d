#!/usr/bin/env python3
"""
Make a small certificate authority and certificates for a test fleet with
mutual TLS on the Node port (README, "Security"):

  scripts/make_test_certs.py OUT --edge-host edge.example.org --node gpu-1 --node gpu-2

writes into OUT:

  ca.pem, ca.key            the CA (keep ca.key offline in real use)
  trust/ca.pem              a trust-root directory for the Nodes' tls: endpoint
  edge.pem, edge.key        the Edge's server certificate (SAN: localhost,
                            127.0.0.1 and every --edge-host)
  <node>.pem, <node>.key    one client certificate per --node, whose
                            identity (SAN DNS name and CN) is the node id

Keys are ECDSA P-256, written with mode 0600; certificates are valid for
--days days (default 30). For a test fleet only: a real deployment keeps
its CA key off the Edge and issues certificates through its own process.
"""

import argparse
import datetime
import ipaddress
import os
import sys

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


def _write(path, data, private=False):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _key():
    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key):
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _cert_pem(cert):
    return cert.public_bytes(serialization.Encoding.PEM)


def _builder(subject, issuer, public_key, days):
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
    )


def _name(common_name):
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def make_ca(days=30, name="iop test CA"):
    key = _key()
    cert = (
        _builder(_name(name), _name(name), key.public_key(), days)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(True, False, False, False, False, True, True, False, False), critical=True)
        .sign(key, hashes.SHA256())
    )
    return key, cert


def issue(ca_key, ca_cert, common_name, dns_names=(), ip_addresses=(), server=False, days=30):
    """
    A certificate for C{common_name} signed by the CA, with the given SAN
    entries; a server (Edge) or client (Node) certificate.
    """
    key = _key()
    alt = [x509.DNSName(n) for n in dns_names] + [x509.IPAddress(ipaddress.ip_address(a)) for a in ip_addresses]
    usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
    builder = (
        _builder(_name(common_name), ca_cert.subject, key.public_key(), days)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    )
    if alt:
        builder = builder.add_extension(x509.SubjectAlternativeName(alt), critical=False)
    return key, builder.sign(ca_key, hashes.SHA256())


def make_fleet(out, edge_hosts=(), nodes=(), days=30):
    """
    Write the CA, the Edge's and every node's certificate into C{out}.
    """
    os.makedirs(os.path.join(out, "trust"), exist_ok=True)
    ca_key, ca_cert = make_ca(days)
    _write(os.path.join(out, "ca.key"), _key_pem(ca_key), private=True)
    _write(os.path.join(out, "ca.pem"), _cert_pem(ca_cert))
    _write(os.path.join(out, "trust", "ca.pem"), _cert_pem(ca_cert))
    hosts = ["localhost", *edge_hosts]
    key, cert = issue(ca_key, ca_cert, hosts[-1], hosts, ["127.0.0.1", "::1"], server=True, days=days)
    _write(os.path.join(out, "edge.key"), _key_pem(key), private=True)
    _write(os.path.join(out, "edge.pem"), _cert_pem(cert))
    for node in nodes:
        key, cert = issue(ca_key, ca_cert, node, [node], days=days)
        _write(os.path.join(out, f"{node}.key"), _key_pem(key), private=True)
        _write(os.path.join(out, f"{node}.pem"), _cert_pem(cert))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="directory to write into")
    parser.add_argument("--edge-host", action="append", default=[], help="a name the Nodes dial the Edge by")
    parser.add_argument("--node", action="append", default=[], help="a node id (one client certificate each)")
    parser.add_argument("--days", type=int, default=30)
    args = parser.parse_args(argv)
    make_fleet(args.out, args.edge_host, args.node, args.days)
    print(f"wrote the CA, the Edge's certificate and {len(args.node)} node certificate(s) to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
