"""
The whole gateway in memory: a real L{EdgeService} and real Node sessions
(L{NodeSession} with real adapter hosting), joined by L{twisted.test.iosim}
on one L{Clock}, with callers going through C{treq.testing.StubTreq} to the
Edge's real HTTP resource. Placement, leases, runs, tunnels, cancels,
disconnects and drains run end to end in milliseconds, with no process,
thread or socket.

Adapters on the Nodes are built by L{GATEWAY_TYPES}: C{echo} is the real
echo adapter (its C{delay_ms} on the shared clock), and C{openai_compat} is
a L{ManualAdapter}, so a test plays the provider of a tunnel by hand.
"""

from collections.abc import Callable, Generator
from typing import Any

from treq.testing import StubTreq
from twisted.internet import defer
from twisted.internet.defer import Deferred
from twisted.internet.error import ConnectionDone
from twisted.internet.interfaces import IReactorTime
from twisted.python.failure import Failure
from twisted.web.http_headers import Headers
from twisted.web.server import Request

from iop.adapters.echo import EchoAdapter
from iop.adapters.interface import IAdapter
from iop.node.host import AdapterHost
from iop.node.session import NodeSession
from iop.testing.edge import EdgeHarness
from iop.testing.node import ManualAdapter, RecordingStore, make_context

BASE = "http://edge.invalid"

#: Adapter types the in-memory Nodes build.
GATEWAY_TYPES: dict[str, Callable[..., IAdapter]] = {"echo": EchoAdapter, "openai_compat": ManualAdapter}

GATEWAY_YAML: dict[str, Any] = {
    "listen": {"nodes": "tcp:0", "http": "tcp:0"},
    "admin_keys": ["admin"],
    "shutdown_grace_sec": 10,
    "nodes": [
        {
            "id": "n1",
            "token": "tok-1",
            "adapters": [
                {"name": "echo", "type": "echo", "max_concurrency": 2, "delay_ms": 100},
                {
                    "name": "llm",
                    "type": "openai_compat",
                    "max_concurrency": 2,
                    "base_url": "http://provider.invalid/v1",
                },
            ],
            "providers": [
                {"id": "echo", "adapter": "echo", "capacity": {"normal": 2, "long": 0}},
                {"id": "llm", "adapter": "llm", "capacity": {"normal": 2, "long": 0}},
            ],
        }
    ],
    "model_groups": [
        {"name": "talk", "providers": [{"node": "n1", "provider": "echo"}], "queue_timeout_sec": 5},
        {"name": "big", "providers": [{"node": "n1", "provider": "llm", "target": "big-v2"}]},
    ],
}


def build(name: str, type: str, max_concurrency: int, options: dict[str, Any], reactor: IReactorTime) -> IAdapter:
    return GATEWAY_TYPES[type](name, max_concurrency, options, reactor)


class GatewayNode:
    """
    One in-memory Node: its session, store and adapter host.
    """

    def __init__(self, gateway: "Gateway", token: str) -> None:
        self.store = RecordingStore(now=gateway.clock.seconds)
        self.host = AdapterHost(gateway.clock, build)
        self.context = make_context(gateway.clock, host=self.host, store=self.store)
        self.context.token = token
        self._dial(gateway)

    def _dial(self, gateway: "Gateway") -> None:
        self.session = NodeSession(self.context)
        _, self.pump, _ = gateway.edge.connect(self.session)

    def adapter(self, name: str) -> Any:
        """
        The adapter C{name} as the test built it (a L{ManualAdapter} or an
        C{EchoAdapter}).
        """
        hosted = self.host.get(name)
        assert hosted is not None, f"no adapter {name} on this node"
        return hosted.adapter

    def reconnect(self, gateway: "Gateway") -> None:
        """
        The same Node process dials C{gateway}'s Edge again (after its
        link was lost): a new session on the same context — adapters,
        store and the background runs it kept.
        """
        self._dial(gateway)
        gateway.flush()


class Gateway:
    """
    @ivar edge: the L{EdgeHarness} (C{edge.service} is the real Edge).
    @ivar http: a C{StubTreq} in front of the Edge's HTTP resource.
    """

    def __init__(self, config: dict[str, Any] = GATEWAY_YAML) -> None:
        self.edge = EdgeHarness(config)
        self.clock = self.edge.clock
        self.service = self.edge.service
        site = self.edge.site
        # StubTreq makes its request functions (get, post, ...) at run time.
        self.http: Any = StubTreq(site.resource)
        #: The Edge's side of every HTTP request made, in order.
        self.requests: list[Request] = []
        router = site.resource
        router.observers = (lambda route, request: self.requests.append(request), *router.observers)

    def node(self, token: str = "tok-1") -> GatewayNode:
        """
        Connect a Node with C{token} and let it register and become ready.
        """
        node = GatewayNode(self, token)
        self.flush()
        return node

    def flush(self) -> None:
        """
        Deliver everything in flight: wire frames both ways, and HTTP
        requests and responses (a few rounds, since each may cause more).
        """
        for _ in range(10):
            self.edge.flush()
            self.http.flush()

    def advance(self, seconds: float, step: float = 0.05) -> None:
        """
        Let time pass in small steps, delivering everything at each.
        """
        while seconds > 0:
            self.clock.advance(min(step, seconds))
            seconds -= step
            self.flush()

    def hang_up(self, request: Request | None = None) -> None:
        """
        The caller of C{request} (the latest one by default) goes away: its
        connection is lost, as when a client disconnects mid-stream.
        """
        request = request if request is not None else self.requests[-1]
        producer = request.producer
        request.connectionLost(Failure(ConnectionDone("the caller hung up")))
        if producer is not None:
            # What the transport does with the producer of a closed connection.
            producer.stopProducing()
        self.flush()

    def post(self, path: str, body: Any) -> Deferred[Any]:
        d: Deferred[Any] = self.http.post(BASE + path, json=body)
        self.flush()
        return d

    def get(self, path: str, headers: dict[str, Any] | Headers | None = None) -> Deferred[Any]:
        d: Deferred[Any] = self.http.get(BASE + path, headers=headers)
        self.flush()
        return d

    @defer.inlineCallbacks
    def read(self, response_deferred: Deferred[Any]) -> Generator[Deferred[Any], Any, tuple[int, Headers, bytes]]:
        """
        @return: a Deferred firing with C{(status, headers, body bytes)}.
        """
        response = yield response_deferred
        body = yield response.content()
        return response.code, response.headers, body
