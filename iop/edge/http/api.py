"""
What the HTTP surfaces ask of the Edge: the caller API of
L{iop.edge.service.EdgeService} and the parts of its state they read,
described here so that the surfaces are typed without importing the
service (they are handed it; docs/architecture.md).
"""

from collections.abc import Callable
from typing import Any, Protocol

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime

from iop.edge.bus import EventBus
from iop.edge.config import EdgeConfig
from iop.edge.dispatch import IRunListener, ITunnelListener
from iop.edge.inflight import Inflight
from iop.edge.registry import NodeRegistry
from iop.edge.runs import Follower, RunBook
from iop.edge.seam import ICluster
from iop.edge.spec import RunSpec
from iop.edge.tenants import TokenBudgets

#: C{listener_for(kind, work_id)}: the listener for the kind of work the
#: service chose (L{iop.edge.runs.RUN} or L{iop.edge.runs.TUNNEL}).
ListenerFor = Callable[[str, str], IRunListener | ITunnelListener]

#: C{on_queued(position, eta_ms)}: where waiting work stands.
OnQueued = Callable[[int, int], None]


class EdgeAPI(Protocol):
    """
    The Edge as its HTTP surfaces see it (L{iop.edge.service.EdgeService}).
    """

    @property
    def config(self) -> EdgeConfig: ...

    @property
    def clock(self) -> IReactorTime: ...

    @property
    def bus(self) -> EventBus: ...

    @property
    def registry(self) -> NodeRegistry: ...

    @property
    def runs(self) -> RunBook: ...

    @property
    def inflight(self) -> Inflight: ...

    @property
    def budgets(self) -> TokenBudgets: ...

    @property
    def cluster(self) -> ICluster: ...

    def submit(
        self,
        spec: RunSpec,
        listener_for: ListenerFor,
        may_forward: bool = True,
        on_queued: OnQueued | None = None,
    ) -> Deferred[str]: ...

    def cancel(self, work_id: str, owner: str | None = None) -> bool: ...

    def command(
        self,
        node_id: str,
        command: str,
        adapter: str = "",
        args: dict[str, Any] | None = None,
        progress: Callable[[dict[str, Any]], object] | None = None,
    ) -> Deferred[Any]: ...

    def terminate_session(
        self, node_id: str | None, adapter: str, target: str, session_id: str, caller: str
    ) -> Deferred[tuple[bool, str, str]]: ...

    def get_run(self, run_id: str, owner: str | None = None, may_forward: bool = True) -> Deferred[dict[str, Any]]: ...

    def list_runs(
        self, node_id: str | None = None, status: str | None = None, limit: int = 50, owner: str | None = None
    ) -> Deferred[dict[str, Any]]: ...

    def follow(
        self,
        run_id: str,
        after: int,
        write: Callable[[int, dict[str, Any]], None],
        end: Callable[[], None],
        owner: str | None = None,
        may_forward: bool = True,
    ) -> Deferred[Follower]: ...

    def status(self) -> dict[str, Any]: ...

    def queue(self, tenant: str | None = None) -> list[dict[str, Any]]: ...

    def models(self) -> list[str]: ...
