"""
edge.yaml validation: every mistake is refused with the key named.
"""

import copy
import hashlib
import json
import os

from twisted.trial.unittest import SynchronousTestCase

from iop.config import ConfigError, Section
from iop.edge.config import load, parse, token_digest
from iop.testing.edge import EDGE_YAML, EdgeHarness


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

    def test_empty_token(self):
        """
        An empty (or blank) token, or the SHA-256 of the empty token, is
        refused: no Node can be configured with one (node.yaml refuses it),
        so it would only let a stranger who sends an empty token register
        as the node and receive its adapters.
        """
        for token in ("", "  "):
            self.assert_refused(lambda d, t=token: d["nodes"][1].update(token=t), "nodes[1].token", "empty")

        def empty_digest(d):
            d["nodes"][0].pop("token")
            d["nodes"][0]["token_sha256"] = hashlib.sha256(b"").hexdigest().upper()

        self.assert_refused(empty_digest, "nodes[0].token_sha256", "empty")

    def test_number_too_large(self):
        """
        An integer too large to be a number of seconds (past a float's
        range) is refused naming its key: read as a timeout it was an
        OverflowError traceback at load, or later from the timer.
        """
        huge = 10**400
        self.assert_refused(lambda d: d.update(reattach_timeout_sec=huge), "reattach_timeout_sec", "too large")
        self.assert_refused(lambda d: d.update(run_grace_sec=huge), "run_grace_sec", "too large")
        self.assert_refused(
            lambda d: d["model_groups"][0].update(queue_timeout_sec=huge), "model_groups[0].queue_timeout_sec"
        )

    def test_group_member_twice(self):
        """
        A model group may list a provider once: the pool keeps one member
        per provider, so a second listing (another target or priority) was
        silently dropped, the first one's target never used.
        """
        self.assert_refused(
            lambda d: d["model_groups"][0]["providers"].append({"node": "n1", "provider": "p1", "target": "t9"}),
            "model_groups[0].providers[2]",
            "n1/p1",
        )

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

    def test_bad_base_url(self):
        """
        An HTTP back end's base_url that is not an http(s) URL with a host,
        or none at all, stops the Edge at load naming the key (not every
        Node it would be sent to).
        """
        for url, fragment in (
            ("not a url", "http:// or https://"),
            ("http://", "name a host"),
            ("http://host:notaport/v1", "not a URL"),
            ("ftp://host/v1", "http:// or https://"),
        ):
            self.assert_refused(
                lambda d, url=url: d["nodes"][0]["adapters"][0].update(type="openai_compat", base_url=url),
                "nodes[0].adapters[0].base_url",
                fragment,
            )
        self.assert_refused(
            lambda d: d["nodes"][0]["adapters"][0].update(type="ollama"), "nodes[0].adapters[0].base_url", "required"
        )
        config = parsed(lambda d: d["nodes"][0]["adapters"][0].update(type="vllm", base_url="http://10.0.0.2:8000/v1"))
        self.assertEqual(config.nodes[0].adapters[0].options["base_url"], "http://10.0.0.2:8000/v1")

    def test_bad_adapter_option(self):
        """
        An adapter option the Node would refuse stops the Edge at load in
        one line naming the key where edge.yaml has it, for every type
        (checked with the Node's own build), instead of every Node it is
        sent to exiting.
        """
        for changes, key, fragment in (
            ({"delay_ms": "fast"}, "nodes[1].adapters[0].delay_ms", "has the wrong type: 'fast'"),
            ({"delay_ms": -1}, "nodes[1].adapters[0].delay_ms", "must not be negative"),
            ({"delay_ms": True}, "nodes[1].adapters[0].delay_ms", "has the wrong type: True"),
            ({"type": "cli", "command": ["agent"], "timeout_sec": 0}, "nodes[1].adapters[0].timeout_sec", "positive"),
            ({"type": "vllm", "base_url": "http://h/v1", "stall_timeout_sec": -1}, "stall_timeout_sec", "seconds"),
            ({"type": "openai_compat", "base_url": "http://h/v1", "usage": "sometimes"}, "usage", "as_asked"),
            ({"type": "ollama", "base_url": "http://h", "headers": {"X": 1}}, "headers", "strings"),
        ):
            error = self.assertRaises(ConfigError, parsed, lambda d, c=changes: d["nodes"][1]["adapters"][0].update(c))
            self.assertIn(f"{key}: ", str(error))
            self.assertIn(fragment, str(error))
            self.assertTrue(str(error).startswith("edge.yaml: nodes[1].adapters[0]."), str(error))
            self.assertNotIn("\n", str(error))

    def test_unknown_adapter_option(self):
        """
        A misspelt adapter option is refused naming it, rather than ignored
        by both daemons.
        """
        self.assert_refused(
            lambda d: d["nodes"][0]["adapters"][0].update(dleay_ms=3),
            "edge.yaml: nodes[0].adapters[0].dleay_ms: is an unknown key for type echo",
            "delay_ms",
        )
        self.assert_refused(
            lambda d: d["nodes"][0]["adapters"][0].update(type="ollama", base_url="http://h", usage="always"),
            "nodes[0].adapters[0].usage: is an unknown key for type ollama",
        )

    def test_options_as_the_node_gets_them(self):
        """
        Options are kept as the Node gets them, JSON: a header YAML reads
        with a number for its name has it as a string, and the Node's
        configuration is made of them (it failed at every registration).
        A max_concurrency the wire cannot carry is refused.
        """
        data = copy.deepcopy(EDGE_YAML)
        data["nodes"][0]["adapters"][0].update(
            type="openai_compat", base_url="http://h/v1", headers={"X-Team": "a", 123: "b"}
        )
        edge = EdgeHarness(data)
        self.assertEqual(edge.config.nodes[0].adapters[0].options["headers"], {"X-Team": "a", "123": "b"})
        node, _, _ = edge.register(token="tok-1", ready=False)
        (answer,) = node.of("register_response")
        self.assertEqual(json.loads(answer.config.adapters[0].options_json)["headers"], {"123": "b", "X-Team": "a"})
        self.assert_refused(
            lambda d: d["nodes"][0]["adapters"][0].update(max_concurrency=2**32),
            "nodes[0].adapters[0].max_concurrency: must be from 1 to 4294967295",
        )

    def test_adapter_not_started(self):
        """
        What only the Node can tell is left to it: a CLI command that is not
        installed on the Edge's host loads.
        """
        config = parsed(lambda d: d["nodes"][0]["adapters"][0].update(type="cli", command=["iop-no-such-command-xyz"]))
        self.assertEqual(config.nodes[0].adapters[0].options, {"command": ["iop-no-such-command-xyz"]})

    def test_bad_listen_endpoint(self):
        """
        A listen endpoint string Twisted cannot parse stops the Edge at load
        in one line naming the key (not a traceback when it listens).
        """
        for changes, key in (
            ({"listen": {"nodes": "tcp:0", "http": "tpc:8080"}}, "listen.http"),
            ({"listen": {"nodes": "tcp:notaport", "http": "tcp:0"}}, "listen.nodes"),
            ({"listen": {"nodes": "tcp:0", "http": "tcp:0", "metrics": "tcp:9:color=red"}}, "listen.metrics"),
        ):
            error = self.assertRaises(ConfigError, parsed, lambda d, c=changes: d.update(c))
            self.assertTrue(str(error).startswith(f"edge.yaml: {key}: not a valid server endpoint string ("))
            self.assertNotIn("\n", str(error))
        self.assert_refused(
            lambda d: d.update(manhole={"listen": "tcp:x:interface=127.0.0.1", "users": {"a": "b"}}),
            "edge.yaml: manhole.listen: not a valid server endpoint string",
        )
        config = parsed(lambda d: d["listen"].update(nodes="tcp:7100:interface=127.0.0.1", http="unix:/tmp/e.sock"))
        self.assertEqual(config.listen_http, "unix:/tmp/e.sock")

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


class CapacityTests(SynchronousTestCase):
    """
    The providers of one adapter never promise more slots than the adapter
    takes, so the Node's gate never refuses work the Edge admitted.
    """

    def node(self, max_concurrency, *providers, extra_adapters=()):
        def mutate(data):
            data["nodes"][0]["adapters"] = [
                {"name": "echo", "type": "echo", "max_concurrency": max_concurrency},
                *extra_adapters,
            ]
            data["nodes"][0]["providers"] = list(providers)
            data["model_groups"] = []

        return mutate

    def capacities(self, mutate):
        return [(p.provider_id, p.capacity_normal, p.capacity_long, p.implicit) for p in parsed(mutate).providers()[:3]]

    def test_over_declared_refused(self):
        """
        normal + long above max_concurrency (the shipped config's old
        mistake: 4 + 1 over 4) is refused, naming the provider's capacity
        key and the numbers.
        """
        mutate = self.node(4, {"id": "echo", "capacity": {"normal": 4, "long": 1}})
        error = self.assertRaises(ConfigError, parsed, mutate)
        self.assertIn("nodes[0].providers[0].capacity", str(error))
        self.assertIn("promise 5 slots", str(error))
        self.assertIn("max_concurrency of 4", str(error))

    def test_sum_over_providers_refused(self):
        """
        Two providers of one adapter are counted together.
        """
        mutate = self.node(
            4,
            {"id": "a", "adapter": "echo", "capacity": {"normal": 2}},
            {"id": "b", "adapter": "echo", "capacity": {"normal": 2, "long": 1}},
        )
        error = self.assertRaises(ConfigError, parsed, mutate)
        self.assertIn("nodes[0].providers[1].capacity", str(error))

    def test_missing_capacity_takes_what_is_left(self):
        """
        A provider without C{normal} takes the adapter's max_concurrency
        minus what its other providers (and its own C{long}) declare.
        """
        mutate = self.node(
            6,
            {"id": "a", "adapter": "echo", "capacity": {"normal": 2, "long": 1}},
            {"id": "b", "adapter": "echo", "capacity": {"long": 1}},
        )
        self.assertEqual(self.capacities(mutate)[:2], [("a", 2, 1, False), ("b", 2, 1, False)])

    def test_two_missing_capacities_refused(self):
        """
        Two providers of one adapter both leaving C{normal} out is
        ambiguous, and refused.
        """
        mutate = self.node(4, {"id": "a", "adapter": "echo"}, {"id": "b", "adapter": "echo"})
        error = self.assertRaises(ConfigError, parsed, mutate)
        self.assertIn("nodes[0].providers[0].capacity: several providers of adapter echo", str(error))

    def test_adapter_without_provider_is_a_resource(self):
        """
        An adapter that no provider names still gets a resource (its whole
        max_concurrency as normal capacity), so direct work on it holds a
        lease.
        """
        extra = ({"name": "other", "type": "echo", "max_concurrency": 3},)
        mutate = self.node(2, {"id": "echo", "capacity": {"normal": 2}}, extra_adapters=extra)
        self.assertEqual(self.capacities(mutate)[:2], [("echo", 2, 0, False), ("other", 3, 0, True)])

    def test_provider_id_of_another_adapter_refused(self):
        """
        A provider may not take the name of another adapter (that name is
        the id of the other adapter's own resource).
        """
        extra = ({"name": "other", "type": "echo", "max_concurrency": 3},)
        mutate = self.node(2, {"id": "other", "adapter": "echo"}, extra_adapters=extra)
        error = self.assertRaises(ConfigError, parsed, mutate)
        self.assertIn("nodes[0].providers[0].id", str(error))

    def test_shipped_config_is_valid(self):
        """
        conf/edge.yaml loads (it used to over-declare its echo provider).
        """
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
        config = load(os.path.join(root, "conf", "edge.yaml"))
        (echo,) = config.nodes[0].providers
        self.assertLessEqual(echo.capacity_normal + echo.capacity_long, config.nodes[0].adapters[0].max_concurrency)

    def test_non_finite_numbers_refused(self):
        """
        YAML's C{.nan} and C{.inf} pass every C{<} check a key makes, so
        the file is refused at load wherever one stands, naming the key
        (an adapter option too, which only the Node reads).
        """
        for value, place in [
            ("queue_timeout_sec: .nan", "limits.queue_timeout_sec"),
            ("delay_ms: -.inf", "nodes[0].adapters[0].delay_ms"),
        ]:
            path = self.mktemp()
            with open(path, "w") as f:
                if place.startswith("limits"):
                    f.write(f"limits:\n  {value}\n")
                else:
                    f.write(f"nodes:\n  - adapters:\n      - {value}\n")
            error = self.assertRaises(ConfigError, load, path)
            self.assertIn(f"{path}: {place}: must be a finite number", str(error))


class TimeoutKeysTests(SynchronousTestCase):
    def test_queue_and_command_timeouts(self):
        """
        direct_queue_timeout_sec and commands (a default and per-command
        timeouts) are read; a bad one is refused naming the key.
        """
        config = parsed(
            lambda d: d.update(
                direct_queue_timeout_sec=5, commands={"timeout_sec": 3, "timeouts": {"ollama_pull": 600}}
            )
        )
        self.assertEqual(config.direct_queue_timeout_sec, 5)
        self.assertEqual((config.command_timeout("capabilities"), config.command_timeout("ollama_pull")), (3, 600))
        error = self.assertRaises(ConfigError, parsed, lambda d: d.update(commands={"timeouts": {"ollama_pull": 0}}))
        self.assertIn("commands.timeouts.ollama_pull", str(error))
