"""
An in-memory Edge and scripted Nodes: the real L{EdgeService} (its tree
built, never started), its Node port factory and L{WireProtocol} on both
ends, wired together by L{twisted.test.iosim} on a L{Clock}. No process,
thread or socket.
"""

from typing import Any

from twisted.internet.interfaces import ITransport
from twisted.internet.task import Clock
from twisted.python.failure import Failure
from twisted.test import iosim
from zope.interface import implementer

from iop.config import Section
from iop.edge.bus import EventBus
from iop.edge.config import EdgeConfig, parse
from iop.edge.service import EdgeService
from iop.node.flow import Message
from iop.protocols import messages
from iop.protocols.wire import WIRE_VERSION, Heartbeat, IWireReceiver, WireProtocol
from iop.run import RunEventData

EDGE_YAML: dict[str, Any] = {
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


def edge_config(data: dict[str, Any] = EDGE_YAML) -> EdgeConfig:
    return parse(Section(data, "", "edge.yaml"))


@implementer(IWireReceiver)
class ScriptedNode:
    """
    A Node stand-in that records what the Edge sends it.
    """

    def __init__(self) -> None:
        self.wire: WireProtocol | None = None
        self.received: list[tuple[str, Message]] = []
        self.lost = False

    @property
    def connection(self) -> WireProtocol:
        """
        The wire of this connection (once it is made).
        """
        assert self.wire is not None, "the Edge has not connected"
        return self.wire

    @property
    def transport(self) -> ITransport:
        """
        The transport of this connection (once it is made).
        """
        transport = self.connection.transport
        assert transport is not None, "the Edge has not connected"
        return transport

    def wire_connected(self, wire: WireProtocol) -> None:
        self.wire = wire

    def message_received(self, kind: str, message: Message) -> None:
        self.received.append((kind, message))

    def wire_lost(self, reason: Failure) -> None:
        self.lost = True

    def of(self, kind: str) -> list[Message]:
        return [m for k, m in self.received if k == kind]


class EdgeHarness:
    """
    One Edge service and any number of in-memory Node connections.
    """

    def __init__(self, data: dict[str, Any] = EDGE_YAML, clock: Clock | None = None, etcd: Any = None) -> None:
        self.clock = clock if clock is not None else Clock()
        self.config = edge_config(data)
        self.bus = EventBus(self.clock)
        self.node_events: list[Any] = []
        self.bus.subscribe(lambda topic, payload: self.node_events.append(payload), topics=["node"])
        self.service = EdgeService(self.config, self.clock, self.bus, etcd=etcd)
        site = self.service.site
        assert site is not None, "the Edge's tree is built"
        self.site = site
        self.pumps: list[iosim.IOPump] = []

    def connect(self, node: Any = None) -> tuple[Any, iosim.IOPump, WireProtocol]:
        """
        Open one Node connection to C{node} (an L{IWireReceiver}; a new
        L{ScriptedNode} by default). @return: C{(node, pump, edge_protocol)}.
        """
        node = node if node is not None else ScriptedNode()
        # The Edge's own factory: the same limits as on a real Node port.
        node_port = self.service.node_port
        assert node_port is not None, "the Edge's tree is built"
        edge_protocol = node_port.buildProtocol(None)
        assert isinstance(edge_protocol, WireProtocol)
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

    def advance(self, seconds: float, step: float = 1.0) -> None:
        """
        Let C{seconds} pass in steps, flushing every connection at each, so
        heartbeats keep live links alive as they would on a real reactor.
        """
        while seconds > 0:
            self.clock.advance(min(step, seconds))
            seconds -= step
            self.flush()

    def register(
        self, token: str = "tok-1", ready: bool = True, wire_version: int = WIRE_VERSION
    ) -> tuple[ScriptedNode, iosim.IOPump, WireProtocol]:
        node, pump, edge_protocol = self.connect(ScriptedNode())
        node.connection.send(messages.register_request(token, wire_version))
        pump.flush()
        if ready:
            node.connection.send(messages.ready_request(node.of("register_response")[0].config.node_id))
            pump.flush()
        return node, pump, edge_protocol


class Recorder:
    """
    A run listener that keeps every event; C{for_run} is a surface's
    C{listener_for} that hands it out and notes the work's id.
    """

    def __init__(self) -> None:
        self.events: list[RunEventData] = []
        self.work_id: str | None = None

    def for_run(self, kind: str, work_id: str) -> "Recorder":
        self.work_id = work_id
        return self

    def event(self, event: RunEventData) -> None:
        self.events.append(event)

    def types(self) -> list[str]:

        return [e.type for e in self.events]
