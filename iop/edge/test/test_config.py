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
    def assert_refused(self, mutate, *fragments):
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

    def test_missing_listen(self):
        """
        listen.http is required.
        """
        self.assert_refused(lambda d: d["listen"].pop("http"), "edge.yaml", "listen.http", "required")

    def test_missing_token(self):
        """
        A node needs a token or its SHA-256.
        """
        self.assert_refused(lambda d: d["nodes"][1].pop("token"), "nodes[1].token")

    def test_bad_sha(self):
        """
        token_sha256 must be 64 hex digits.
        """

        def mutate(d):
            d["nodes"][0].pop("token")
            d["nodes"][0]["token_sha256"] = "abc"

        self.assert_refused(mutate, "nodes[0].token_sha256")

    def test_unknown_adapter_type(self):
        """
        An adapter type that does not exist is named.
        """
        self.assert_refused(
            lambda d: d["nodes"][0]["adapters"][0].update(type="gpt"), "nodes[0].adapters[0].type", "gpt"
        )

    def test_unknown_key(self):
        """
        A misspelt key is refused rather than ignored.
        """
        self.assert_refused(lambda d: d.update(model_group=[]), "model_group", "unknown key")

    def test_group_unknown_provider(self):
        """
        A model group naming a provider its node lacks is refused.
        """
        self.assert_refused(
            lambda d: d["model_groups"][0]["providers"][0].update(provider="zz"),
            "model_groups[0].providers[0].provider",
        )

    def test_duplicate_node(self):
        """
        Node ids are unique.
        """
        self.assert_refused(lambda d: d["nodes"][1].update(id="n1"), "duplicate id n1")

    def test_duplicate_token_hidden(self):
        """
        Two nodes with one token are refused without printing the token.
        """
        error = self.assertRaises(ConfigError, parsed, lambda d: d["nodes"][1].update(token="tok-1"))
        self.assertNotIn("tok-1", str(error))

    def test_heartbeat_order(self):
        """
        The heartbeat timeout must exceed the interval.
        """
        self.assert_refused(
            lambda d: d.update(heartbeat={"interval_sec": 5, "timeout_sec": 2}), "heartbeat.timeout_sec"
        )

    def test_manhole_loopback_with_users(self):
        """
        The console must be on loopback and have users.
        """
        self.assert_refused(lambda d: d.update(manhole={"listen": "tcp:7122", "users": {"a": "b"}}), "manhole.listen")
        self.assert_refused(lambda d: d.update(manhole={"users": {}}), "manhole.users")
