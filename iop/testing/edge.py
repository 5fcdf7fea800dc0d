"""
An in-memory Edge and scripted Nodes: the real L{EdgeService} (its tree
built, never started), its Node port factory and L{WireProtocol} on both
ends, wired together by L{twisted.test.iosim} on a L{Clock}. No process,
thread or socket.
"""

from twisted.internet.task import Clock
from twisted.test import iosim
from zope.interface import implementer

from iop.config import Section
from iop.edge.bus import EventBus
from iop.edge.config import parse
from iop.edge.service import EdgeService
from iop.protocols import iop_pb2
from iop.protocols.wire import WIRE_VERSION, Heartbeat, IWireReceiver, WireProtocol

EDGE_YAML = {
    "listen": {"nodes": "tcp:0", "http": "tcp:0"},
    "admin_keys": ["admin"],
    "nodes": [
        {
            "id": "n1",
            "token": "tok-1",
            "adapters": [{"name": "echo", "type": "echo", "max_concurrency": 2}],
            "providers": [{"id": "p1", "adapter": "echo", "capacity": {"normal": 1, "long": 0}}],
        },
        {
            "id": "n2",
            "token": "tok-2",
            "adapters": [{"name": "echo", "type": "echo", "max_concurrency": 2}],
            "providers": [{"id": "p2", "adapter": "echo", "capacity": {"normal": 1, "long": 0}}],
        },
    ],
    "model_groups": [
        {
            "name": "grp",
            "providers": [
                {"node": "n1", "provider": "p1", "target": "t1"},
                {"node": "n2", "provider": "p2", "target": "t2"},
            ],
            "queue_timeout_sec": 10,
        }
    ],
}


def edge_config(data=EDGE_YAML):
    return parse(Section(data, "", "edge.yaml"))


@implementer(IWireReceiver)
class ScriptedNode:
    """
    A Node stand-in that records what the Edge sends it.
    """

    def __init__(self) -> None:
        self.wire = None
        self.received = []
        self.lost = False

    def wire_connected(self, wire) -> None:
        self.wire = wire

    def message_received(self, kind, message) -> None:
        self.received.append((kind, message))

    def wire_lost(self, reason) -> None:
        self.lost = True

    def of(self, kind):
        return [m for k, m in self.received if k == kind]


class EdgeHarness:
    """
    One Edge service and any number of in-memory Node connections.
    """

    def __init__(self, data=EDGE_YAML, clock=None, etcd=None) -> None:
        self.clock = clock if clock is not None else Clock()
        self.config = edge_config(data)
        self.bus = EventBus(self.clock)
        self.node_events = []
        self.bus.subscribe(lambda topic, payload: self.node_events.append(payload), topics=["node"])
        self.service = EdgeService(self.config, self.clock, self.bus, etcd=etcd)
        self.site = self.service.site
        self.pumps = []

    def connect(self, node=None):
        """
        Open one Node connection to C{node} (an L{IWireReceiver}; a new
        L{ScriptedNode} by default). @return: C{(node, pump, edge_protocol)}.
        """
        node = node if node is not None else ScriptedNode()
        # The Edge's own factory: the same limits as on a real Node port.
        edge_protocol = self.service.node_port.buildProtocol(None)
        node_protocol = WireProtocol(node, self.clock, Heartbeat(2, 5))
        pump = iosim.connect(
            edge_protocol,
            iosim.FakeTransport(edge_protocol, isServer=True),
            node_protocol,
            iosim.FakeTransport(node_protocol, isServer=False),
            greet=False,
            clock=self.clock,
        )
        self.pumps.append(pump)
        return node, pump, edge_protocol

    def flush(self) -> None:
        for pump in self.pumps:
            pump.flush()

    def advance(self, seconds, step: float = 1.0) -> None:
        """
        Let C{seconds} pass in steps, flushing every connection at each, so
        heartbeats keep live links alive as they would on a real reactor.
        """
        while seconds > 0:
            self.clock.advance(min(step, seconds))
            seconds -= step
            self.flush()

    def register(self, token: str = "tok-1", ready: bool = True, wire_version=WIRE_VERSION):
        node, pump, edge_protocol = self.connect()
        node.wire.send(iop_pb2.RegisterRequest(token=token, wire_version=wire_version))
        pump.flush()
        if ready:
            node.wire.send(iop_pb2.NodeReadyRequest(node_id=node.of("register_response")[0].config.node_id))
            pump.flush()
        return node, pump, edge_protocol


class Recorder:
    """
    A run listener that keeps every event; C{for_run} is a surface's
    C{listener_for} that hands it out and notes the work's id.
    """

    def __init__(self) -> None:
        self.events = []
        self.work_id = None

    def for_run(self, kind, work_id):
        self.work_id = work_id
        return self

    def event(self, event) -> None:
        self.events.append(event)

    def types(self):
        return [e.type for e in self.events]
