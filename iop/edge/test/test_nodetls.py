"""
Mutual TLS bound to node identity (issue 12, finding 10), in memory: the
identity a certificate carries, the registration refused when it does not
name the token's node, and C{node_tls} validated at start. Certificates
come from C{scripts/make_test_certs.py}.
"""

import copy
import importlib.util
import os
import tempfile
from typing import Any

from cryptography import x509
from OpenSSL import crypto
from twisted.trial.unittest import SynchronousTestCase

from iop.config import ConfigError
from iop.edge.nodetls import identities, mismatch
from iop.edge.test.test_config import parsed
from iop.protocols import messages
from iop.protocols.wire import WIRE_VERSION
from iop.testing.edge import EDGE_YAML, EdgeHarness

_SCRIPT = os.path.join(os.path.dirname(__file__), *[os.pardir] * 3, "scripts", "make_test_certs.py")


def certs_module():
    spec = importlib.util.spec_from_file_location("make_test_certs", _SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fleet():
    out = tempfile.mkdtemp()
    certs_module().make_fleet(out, nodes=["n1", "n2"])
    return out


def load(path):
    with open(path, "rb") as f:
        return x509.load_pem_x509_certificate(f.read())


class FakeTLS:
    def __init__(self, certificate=None):
        self.certificate = certificate

    def getPeerCertificate(self):
        return None if self.certificate is None else crypto.X509.from_cryptography(self.certificate)


class IdentityTests(SynchronousTestCase):
    def test_san_then_cn(self):
        """
        A certificate's identity is its SAN DNS names; without any, its
        Common Name.
        """
        tools = certs_module()
        ca_key, ca_cert = tools.make_ca()
        _, both = tools.issue(ca_key, ca_cert, "cn-name", ["n1", "n1.example.org"])
        _, cn_only = tools.issue(ca_key, ca_cert, "n2")
        self.assertEqual(identities(both), ["n1", "n1.example.org"])
        self.assertEqual(identities(cn_only), ["n2"])

    def test_mismatch(self):
        """
        A certificate naming the node matches; another node's certificate
        or none at all does not, with a reason.
        """
        out = fleet()
        n1 = load(os.path.join(out, "n1.pem"))
        self.assertIsNone(mismatch(FakeTLS(n1), "n1"))
        self.assertIn("not node 'n2'", mismatch(FakeTLS(n1), "n2"))
        self.assertIn("no client certificate", mismatch(FakeTLS(), "n1"))
        self.assertIn("no client certificate", mismatch(object(), "n1"))


class RegistrationTests(SynchronousTestCase):
    def setUp(self):
        self.out = fleet()
        data = copy.deepcopy(EDGE_YAML)
        data["node_tls"] = {
            "certificate": os.path.join(self.out, "edge.pem"),
            "private_key": os.path.join(self.out, "edge.key"),
            "client_ca": os.path.join(self.out, "ca.pem"),
        }
        self.edge = EdgeHarness(data)

    def register(self, token, certificate):
        node, pump, edge_protocol = self.edge.connect()
        # In-memory, given the method a TLS transport has.
        transport: Any = edge_protocol.transport
        transport.getPeerCertificate = FakeTLS(certificate).getPeerCertificate
        node.wire.send(messages.register_request(token=token, wire_version=WIRE_VERSION))
        pump.flush()
        return node.of("register_response")[0]

    def test_own_certificate(self):
        """
        The token of n1 with n1's certificate registers.
        """
        response = self.register("tok-1", load(os.path.join(self.out, "n1.pem")))
        self.assertTrue(response.accepted)

    def test_other_certificate(self):
        """
        The token of n1 with n2's certificate is refused as
        C{UNKNOWN_TOKEN} (fatal), with a reason naming the mismatch.
        """
        response = self.register("tok-1", load(os.path.join(self.out, "n2.pem")))
        self.assertFalse(response.accepted)
        self.assertEqual(response.code, messages.UNKNOWN_TOKEN)
        self.assertIn("names 'n2', not node 'n1'", response.reason)
        self.assertIsNone(self.edge.service.registry.owner("n1"))

    def test_unknown_token_stays_unknown(self):
        """
        An unknown token is refused as before, whatever the certificate.
        """
        response = self.register("nope", load(os.path.join(self.out, "n1.pem")))
        self.assertEqual((response.accepted, response.reason), (False, "unknown token"))


class ConfigTests(SynchronousTestCase):
    def setUp(self):
        self.out = fleet()
        self.tls = {
            "certificate": os.path.join(self.out, "edge.pem"),
            "private_key": os.path.join(self.out, "edge.key"),
            "client_ca": os.path.join(self.out, "ca.pem"),
        }

    def refused(self, mutate, *fragments):
        error = self.assertRaises(ConfigError, parsed, mutate)
        for fragment in fragments:
            self.assertIn(fragment, str(error))

    def test_valid(self):
        """
        A complete C{node_tls} parses into its paths.
        """
        config = parsed(lambda d: d.update(node_tls=dict(self.tls)))
        self.assertEqual(config.node_tls.client_ca, self.tls["client_ca"])

    def test_bad(self):
        """
        Missing files, a key that is not the certificate's, a missing key
        and an C{ssl:} listener are refused naming the key.
        """
        self.refused(lambda d: d.update(node_tls=dict(self.tls, client_ca="/nonexistent")), "node_tls.client_ca")
        self.refused(
            lambda d: d.update(node_tls=dict(self.tls, private_key=os.path.join(self.out, "n1.key"))),
            "node_tls.private_key",
        )
        self.refused(
            lambda d: d.update(node_tls=dict(self.tls, certificate=self.tls["private_key"])), "node_tls.certificate"
        )
        self.refused(lambda d: d.update(node_tls={"certificate": self.tls["certificate"]}), "node_tls.private_key")

        def ssl_listener(d):
            d["node_tls"] = dict(self.tls)
            d["listen"]["nodes"] = "ssl:7100:privateKey=x.pem"

        self.refused(ssl_listener, "listen.nodes", "tcp:")
