"""
The C{cluster:} section (L{iop.edge.cluster.config}): C{relist_sec}, how
often the view is listed again.
"""

from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from iop.config import ConfigError, Section
from iop.edge.cluster.config import ClusterSpec, parse_cluster
from iop.edge.cluster.test.support import cluster_yaml


def parsed(**cluster: Any) -> ClusterSpec:
    data = cluster_yaml("edge-a")
    data["cluster"].update(cluster)
    return parse_cluster(
        Section(data["cluster"], "cluster", "edge.yaml"), Section(data["listen"], "listen", "edge.yaml")
    )


class RelistSecTests(SynchronousTestCase):
    def test_default(self) -> None:
        """
        Without the key, the view is listed again every 30 s.
        """
        self.assertEqual(parsed().relist_sec, 30.0)

    def test_given(self) -> None:
        """
        Any positive number of seconds is taken.
        """
        self.assertEqual(parsed(relist_sec=2.5).relist_sec, 2.5)
        self.assertEqual(parsed(relist_sec=600).relist_sec, 600.0)

    def test_errors_name_the_key(self) -> None:
        """
        What is not a positive, finite number is refused, naming the key.
        """
        for value in (0, -1, "30", True, [30], float("inf"), float("nan")):
            with self.assertRaisesRegex(ConfigError, r"^edge\.yaml: cluster\.relist_sec: must be"):
                parsed(relist_sec=value)
