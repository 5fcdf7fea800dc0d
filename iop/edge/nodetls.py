"""
Mutual TLS on the Node port, bound to node identity (C{node_tls:} in
C{edge.yaml}; README, "Security").

With C{node_tls}, the Node port speaks TLS over the C{listen.nodes}
endpoint with the Edge's certificate, and requires every Node to present a
client certificate signed by C{client_ca}: a peer without one never
completes the handshake. A Node's certificate names the node it belongs
to: its identity is the set of its subjectAltName DNS names, or its
subject Common Name when it has no DNS name. A registration whose token
belongs to a node the certificate does not name is refused (as
C{UNKNOWN_TOKEN}, with a reason saying so): a stolen token is useless
without that node's key, and one node's certificate cannot register as
another.

Everything here uses public APIs of C{twisted.internet.ssl} and
C{cryptography}.
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING

from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding
from cryptography.x509.oid import NameOID

from iop.config import Section

if TYPE_CHECKING:
    from twisted.internet.ssl import CertificateOptions


@dataclass(frozen=True)
class NodeTLSSpec:
    """
    Paths of the Edge's certificate (PEM, optionally followed by its
    chain), its private key, and the CA certificate(s) Node certificates
    must be signed by.
    """

    certificate: str
    private_key: str
    client_ca: str


class TLSConfigError(ValueError):
    """
    A certificate or key file that cannot be used; the message says why.
    """


def parse_node_tls(section: Section, listen: Section) -> NodeTLSSpec:
    """
    Read C{node_tls:} (every file is loaded now, so a bad one stops the
    Edge naming its key); C{listen.nodes} must then be a plain stream
    endpoint (C{tcp:}, C{tcp6:}, C{unix:}) that TLS is added to.

    @raise ConfigError: naming the key.
    """
    from iop.edge.endpoints import split_endpoint

    section.unknown({"certificate", "private_key", "client_ca"})
    spec = NodeTLSSpec(
        certificate=section.get("certificate", str),
        private_key=section.get("private_key", str),
        client_ca=section.get("client_ca", str),
    )
    kind = (split_endpoint(listen.get("nodes", str))[0] or [""])[0]
    if kind not in ("tcp", "tcp6", "unix"):
        raise listen.error(
            "nodes", f"with node_tls, must be a tcp:, tcp6: or unix: endpoint (TLS is added), not {kind}:"
        )
    for key in ("certificate", "client_ca"):
        try:
            _certificates(getattr(spec, key))
        except TLSConfigError as e:
            raise section.error(key, str(e)) from None
    try:
        context_factory(spec)
    except TLSConfigError as e:
        raise section.error("private_key", str(e)) from None
    return spec


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise TLSConfigError(f"cannot read {path}: {e.strerror}") from None


def _certificates(path: str) -> list[x509.Certificate]:
    try:
        certificates = x509.load_pem_x509_certificates(_read(path))
    except ValueError as e:
        raise TLSConfigError(f"{path} holds no PEM certificate: {e}") from None
    return certificates


def context_factory(spec: NodeTLSSpec) -> "CertificateOptions":
    """
    The server TLS options of the Node port: the Edge's certificate and
    key, client certificates required and verified against C{client_ca}.

    @raise TLSConfigError: naming the file that cannot be used.
    """
    from OpenSSL import crypto
    from twisted.internet import ssl

    chain = _certificates(spec.certificate)
    try:
        key = ssl.KeyPair.load(_read(spec.private_key), crypto.FILETYPE_PEM)
    except Exception as e:
        raise TLSConfigError(f"{spec.private_key} holds no PEM private key: {e}") from None
    pem = [c.public_bytes(Encoding.PEM) for c in chain]
    authorities = [ssl.Certificate.loadPEM(c.public_bytes(Encoding.PEM)) for c in _certificates(spec.client_ca)]
    try:
        options = ssl.CertificateOptions(
            privateKey=key.original,
            certificate=ssl.Certificate.loadPEM(pem[0]).original,
            extraCertChain=[ssl.Certificate.loadPEM(p).original for p in pem[1:]],
            trustRoot=ssl.trustRootFromCertificates(authorities),
        )
        options.getContext()  # checks that the key belongs to the certificate
    except Exception as e:
        raise TLSConfigError(f"{spec.certificate} and {spec.private_key} cannot be used together: {e}") from None
    return options


def identities(certificate: x509.Certificate) -> list[str]:
    """
    The node names a certificate carries: its subjectAltName DNS names,
    or, without any, its subject Common Name(s).

    @param certificate: a C{cryptography} certificate.
    @return: a list of names (possibly empty).
    """
    try:
        san = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        names = san.get_values_for_type(x509.DNSName)
    except x509.ExtensionNotFound:
        names = []
    if names:
        return names
    return [str(a.value) for a in certificate.subject.get_attributes_for_oid(NameOID.COMMON_NAME)]


def peer_identities(transport: object) -> list[str] | None:
    """
    The identities of the client certificate on a TLS C{transport}, or
    C{None} when there is none (or the transport is not TLS).
    """
    get = getattr(transport, "getPeerCertificate", None)
    peer = get() if get is not None else None
    if peer is None:
        return None
    return identities(peer.to_cryptography())


def mismatch(transport: object, node_id: str) -> str | None:
    """
    Why the client certificate on C{transport} does not belong to
    C{node_id}, or C{None} when it does.
    """
    names = peer_identities(transport)
    if names is None:
        return "no client certificate was presented"
    if node_id in names:
        return None
    shown = ", ".join(repr(n[:64]) for n in names[:5]) or "no name"
    return f"the client certificate names {shown}, not node {node_id!r} (node_tls: its identity must match the token)"
