"""
What the cluster's tests share: the C{edge.yaml} of an Edge of a cluster,
and Edges of one cluster on one in-memory etcd (L{iop.testing.etcd}) and
one clock, Nodes joined to them by iosim.
"""

import copy
import json
from typing import Any

from twisted.internet.task import Clock
from twisted.python.failure import Failure
from twisted.test.proto_helpers import StringTransport
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.client import ResponseDone
from twisted.web.http_headers import Headers
from twisted.web.iweb import IResponse
from zope.interface import implementer

from iop.edge.cluster.joined import EtcdCluster
from iop.edge.cluster.membership import Membership
from iop.edge.spec import RunSpec
from iop.testing.edge import EDGE_YAML, EdgeHarness
from iop.testing.etcd import MemoryEtcd, MemoryEtcdClient

SECRET = "a-cluster-secret-of-some-length"


def cluster_yaml(edge_id: str, ttl: int = 3) -> dict[str, Any]:
    data: dict[str, Any] = copy.deepcopy(EDGE_YAML)
    data["listen"]["peer"] = "tcp:0"
    data["cluster"] = {
        "etcd": ["http://127.0.0.1:2379"],
        "edge_id": edge_id,
        "advertise": f"http://{edge_id}.example:7180",
        "lease_ttl_sec": ttl,
        "secret": SECRET,
    }
    return data


def group_run(model: str = "grp") -> RunSpec:
    return RunSpec(messages=[{"role": "user", "content": "hello world"}], model=model)


class ClusterCase(SynchronousTestCase):
    """
    Edges C{edge-a} and C{edge-b} (C{self.a}, C{self.b}), joined.
    """

    ttl = 3

    def setUp(self) -> None:
        self.clock = Clock()
        self.etcd = MemoryEtcd(self.clock)
        self.harnesses: list[EdgeHarness] = []
        self.a = self.edge("edge-a")
        self.b = self.edge("edge-b")

    def edge(self, edge_id: str, etcd: Any = None, start: bool = True) -> EdgeHarness:
        harness = EdgeHarness(
            cluster_yaml(edge_id, self.ttl), clock=self.clock, etcd=etcd if etcd is not None else self.etcd.client()
        )
        if start:
            self.cluster(harness).startService()
        self.harnesses.append(harness)
        return harness

    def cluster(self, harness: EdgeHarness) -> EtcdCluster:
        cluster = harness.service.cluster
        assert isinstance(cluster, EtcdCluster)
        return cluster

    def membership(self, harness: EdgeHarness) -> Membership:
        return self.cluster(harness).membership

    def client(self, harness: EdgeHarness) -> MemoryEtcdClient:
        client = self.membership(harness).etcd
        assert isinstance(client, MemoryEtcdClient)
        return client

    def advance(self, seconds: float, step: float = 0.5) -> None:
        # Every Edge's Node connections keep their heartbeats going.
        while seconds > 0:
            self.clock.advance(step)
            seconds -= step
            for harness in self.harnesses:
                harness.flush()

    def state_in_etcd(self, edge_id: str) -> str | None:
        kv = self.etcd.data.get(f"/iop/edges/{edge_id}")
        return json.loads(kv.value)["state"] if kv is not None else None

    def states_seen(self, harness: EdgeHarness) -> dict[str, str]:
        return {e["id"]: e["state"] for e in harness.service.status()["cluster"]["edges"]}


@implementer(IResponse)
class Answer:
    """
    A peer's answer whose headers came: its body comes in C{chunks} (on a
    L{StringTransport}), and ends if C{ends}.
    """

    code = 200
    phrase = b"OK"
    version = (b"HTTP", 1, 1)
    length = None
    request = None
    previousResponse = None

    def __init__(self, chunks: list[bytes], ends: bool, content_type: bytes | None = None) -> None:
        self.headers = Headers({b"content-type": [content_type]} if content_type else {})
        self.chunks = chunks
        self.ends = ends
        self.transport = StringTransport()
        self.protocol: Any = None

    def deliverBody(self, protocol: Any) -> None:
        self.protocol = protocol
        protocol.makeConnection(self.transport)
        for chunk in self.chunks:
            protocol.dataReceived(chunk)
        if self.ends:
            protocol.connectionLost(Failure(ResponseDone()))

    def setPreviousResponse(self, response: IResponse) -> None:
        pass
