"""
edge.yaml: a model group's C{fallbacks} and C{context_fallbacks}, its
providers' C{priority}, and C{health.probe_interval_sec}, each refused with
its key named when wrong.
"""

import copy
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from iop.config import ConfigError, Section
from iop.edge.config import parse
from iop.testing.edge import EDGE_YAML


def parsed(mutate):
    data: dict[str, Any] = copy.deepcopy(EDGE_YAML)
    group = data["model_groups"][0]
    data["model_groups"] += [
        dict(copy.deepcopy(group), name="small"),
        dict(copy.deepcopy(group), name="long"),
    ]
    mutate(data)
    return parse(Section(data, "", "edge.yaml"))


def groups(data):
    return {g["name"]: g for g in data["model_groups"]}


class FallbackConfigTests(SynchronousTestCase):
    def assert_refused(self, mutate, *fragments):
        error = self.assertRaises(ConfigError, parsed, mutate)
        for fragment in fragments:
            self.assertIn(fragment, str(error))

    def test_valid(self):
        """
        Fallbacks keep their order; priority defaults to 0; probes every
        5 s unless told.
        """

        def mutate(data):
            groups(data)["grp"].update(fallbacks=["small", "long"], context_fallbacks=["long"])
            groups(data)["grp"]["providers"][1]["priority"] = 2
            groups(data)["small"]["fallbacks"] = ["long"]
            data["health"] = {"probe_interval_sec": 0}

        config = parsed(mutate)
        group = config.model_groups[0]
        self.assertEqual((group.fallbacks, group.context_fallbacks), (("small", "long"), ("long",)))
        self.assertEqual([m.priority for m in group.members], [0, 2])
        self.assertEqual(config.health.probe_interval_sec, 0)
        self.assertEqual(parsed(lambda d: None).health.probe_interval_sec, 5.0)

    def test_unknown_group(self):
        """
        A fallback must name a configured model group.
        """
        self.assert_refused(
            lambda d: groups(d)["grp"].update(fallbacks=["nope"]),
            "model_groups[0].fallbacks[0]",
            "names no configured model group",
        )

    def test_self_reference(self):
        """
        A group cannot fall back to itself.
        """
        self.assert_refused(
            lambda d: groups(d)["grp"].update(context_fallbacks=["grp"]),
            "model_groups[0].context_fallbacks[0]",
            "itself",
        )

    def test_circle(self):
        """
        Fallbacks that lead back to their group are refused, naming the
        circle.
        """

        def mutate(data):
            groups(data)["grp"]["fallbacks"] = ["small"]
            groups(data)["small"]["fallbacks"] = ["long"]
            groups(data)["long"]["fallbacks"] = ["grp"]

        self.assert_refused(mutate, "model_groups[0].fallbacks", "grp -> small -> long -> grp")

    def test_repeat_and_type(self):
        """
        A list of distinct group names, nothing else.
        """
        self.assert_refused(lambda d: groups(d)["grp"].update(fallbacks=["small", "small"]), "duplicate model group")
        self.assert_refused(lambda d: groups(d)["grp"].update(fallbacks="small"), "model_groups[0].fallbacks")
        self.assert_refused(lambda d: groups(d)["grp"].update(fallbacks=[3]), "model_groups[0].fallbacks[0]")

    def test_priority(self):
        """
        A provider's priority is a non-negative integer.
        """
        self.assert_refused(
            lambda d: groups(d)["grp"]["providers"][0].update(priority=-1), "providers[0].priority", "negative"
        )
        self.assert_refused(lambda d: groups(d)["grp"]["providers"][0].update(priority="high"), "priority")

    def test_probe_interval(self):
        """
        health.probe_interval_sec is a number of at least 0.
        """
        self.assert_refused(lambda d: d.update(health={"probe_interval_sec": -1}), "health.probe_interval_sec")
