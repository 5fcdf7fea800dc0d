"""
What every session of one Node process shares.

Sessions are per connection and short-lived; the adapters, the run store,
the metrics, the usage totals and the transport status outlive them. They
are gathered here so that a session is built from one object, and tests
build a context with fakes for just the parts they care about.
"""

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from twisted.internet.interfaces import IReactorTime

from iop.node.detached import DetachedRuns
from iop.node.host import AdapterHost
from iop.node.metrics import NodeMetrics
from iop.node.owners import SessionOwners
from iop.node.stats import UsageBook
from iop.node.store import NullStore, Store
from iop.protocols.wire import Heartbeat


@dataclass
class TransportState:
    """
    The Node's view of its link to the Edge, for C{transport_status}.
    Written by the supervisor and the session; read by commands.

    @ivar failures: consecutive failed attempts since the last ready session.
    @ivar attempts: connect attempts made since the process started.
    @ivar sessions: how many sessions became ready since the process started.
    @ivar connected_since: wall-clock time the current session became ready.
    @ivar store: the run store, whose health is reported too.
    """

    edge: str = ""
    node_id: str | None = None
    connected: bool = False
    connected_since: float | None = None
    failures: int = 0
    attempts: int = 0
    sessions: int = 0
    heartbeat: Heartbeat = field(default_factory=Heartbeat)
    store: Store | None = None

    def snapshot(self) -> dict[str, Any]:
        return {
            "store": self.store.health() if self.store is not None else {"status": "none"},
            "node_id": self.node_id,
            "edge": self.edge,
            "connected": self.connected,
            "connected_since": self.connected_since,
            "consecutive_failures": self.failures,
            "attempts": self.attempts,
            "sessions": self.sessions,
            "heartbeat": {"interval_sec": self.heartbeat.interval, "timeout_sec": self.heartbeat.timeout},
        }


@dataclass
class NodeContext:
    """
    @ivar token: the Node's credential; never logged (kept out of repr).
    @ivar clock: an C{IReactorTime} for timeouts.
    @ivar host: the L{iop.node.host.AdapterHost}.
    @ivar register_timeout: seconds to wait for each register/ready answer.
    @ivar configure_timeout: seconds an accepted registration may take to
        start its adapters (C{configure_timeout_sec}).
    """

    token: str = field(repr=False)
    clock: IReactorTime
    host: AdapterHost
    store: Store = field(default_factory=NullStore)
    metrics: NodeMetrics = field(default_factory=NodeMetrics)
    usage: UsageBook = field(default_factory=UsageBook)
    transport: TransportState = field(default_factory=TransportState)
    register_timeout: float = 10.0
    configure_timeout: float = 60.0
    now: Callable[[], float] = time.time
    #: Whose each logical session is (L{iop.node.owners}); the run store
    #: fills it at start.
    owners: SessionOwners = field(default_factory=SessionOwners)

    node_version: str = ""
    #: Background runs kept across a lost link (L{iop.node.detached}).
    detached: DetachedRuns = field(init=False)

    def __post_init__(self) -> None:
        self.detached = DetachedRuns(self.clock)
