"""
edge.yaml validation: every mistake is refused with the key named.
"""

import copy

from twisted.trial.unittest import SynchronousTestCase

from iop.config import ConfigError, Section
from iop.edge.config import parse, token_digest
from iop.testing.edge import EDGE_YAML


def parsed(mutate):
    data = copy.deepcopy(EDGE_YAML)
    mutate(data)
    return parse(Section(data, "", "edge.yaml"))


class EdgeConfigTests(SynchronousTestCase):
    def assertRefused(self, mutate, *fragments):
        error = self.assertRaises(ConfigError, parsed, mutate)
        for fragment in fragments:
            self.assertIn(fragment, str(error))

    def test_valid(self):
        """
        The reference config parses: nodes, adapters with options, providers
        and model groups.
        """
        config = parsed(lambda d: d["nodes"][0]["adapters"][0].update(delay_ms=5))
        self.assertEqual([n.id for n in config.nodes], ["n1", "n2"])
        self.assertEqual(config.nodes[0].adapters[0].options, {"delay_ms": 5})
        self.assertEqual(config.nodes[0].token_digest, token_digest("tok-1"))
        self.assertEqual(config.model_groups[0].members[1].target, "t2")

    def test_missingListen(self):
        """
        listen.http is required.
        """
        self.assertRefused(lambda d: d["listen"].pop("http"), "edge.yaml", "listen.http", "required")

    def test_missingToken(self):
        """
        A node needs a token or its SHA-256.
        """
        self.assertRefused(lambda d: d["nodes"][1].pop("token"), "nodes[1].token")

    def test_badSha(self):
        """
        token_sha256 must be 64 hex digits.
        """

        def mutate(d):
            d["nodes"][0].pop("token")
            d["nodes"][0]["token_sha256"] = "abc"

        self.assertRefused(mutate, "nodes[0].token_sha256")

    def test_unknownAdapterType(self):
        """
        An adapter type that does not exist is named.
        """
        self.assertRefused(
            lambda d: d["nodes"][0]["adapters"][0].update(type="gpt"), "nodes[0].adapters[0].type", "gpt"
        )

    def test_unknownKey(self):
        """
        A misspelt key is refused rather than ignored.
        """
        self.assertRefused(lambda d: d.update(model_group=[]), "model_group", "unknown key")

    def test_groupUnknownProvider(self):
        """
        A model group naming a provider its node lacks is refused.
        """
        self.assertRefused(
            lambda d: d["model_groups"][0]["providers"][0].update(provider="zz"),
            "model_groups[0].providers[0].provider",
        )

    def test_duplicateNode(self):
        """
        Node ids are unique.
        """
        self.assertRefused(lambda d: d["nodes"][1].update(id="n1"), "duplicate id n1")

    def test_duplicateTokenHidden(self):
        """
        Two nodes with one token are refused without printing the token.
        """
        error = self.assertRaises(ConfigError, parsed, lambda d: d["nodes"][1].update(token="tok-1"))
        self.assertNotIn("tok-1", str(error))

    def test_heartbeatOrder(self):
        """
        The heartbeat timeout must exceed the interval.
        """
        self.assertRefused(lambda d: d.update(heartbeat={"interval_sec": 5, "timeout_sec": 2}), "heartbeat.timeout_sec")

    def test_manholeLoopbackWithUsers(self):
        """
        The console must be on loopback and have users.
        """
        self.assertRefused(lambda d: d.update(manhole={"listen": "tcp:7122", "users": {"a": "b"}}), "manhole.listen")
        self.assertRefused(lambda d: d.update(manhole={"users": {}}), "manhole.users")
