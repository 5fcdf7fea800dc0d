"""
Adapters whose C{start} hangs until the test says so: a back end that a
start probes and that does not answer.
"""

from typing import Any, cast

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime

from iop.adapters.interface import IAdapter
from iop.testing.node import ManualAdapter, build


class HeldStarts:
    """
    A C{build} for L{iop.node.host.AdapterHost} over the fake types: the
    first instance built of each adapter named in C{names} starts only when
    the test fires its Deferred in L{held}; every other starts at once.
    The Deferreds have no canceller, as most adapters' do not: a cancelled
    one fails with C{CancelledError}, and the back end's late answer is
    swallowed.

    @ivar held: the pending C{start} of each held adapter, by name.
    @ivar built: every instance built, by name, oldest first.
    """

    def __init__(self, *names: str) -> None:
        self.held: dict[str, Deferred[None]] = {name: Deferred() for name in names}
        self._handed: set[str] = set()
        self.built: dict[str, list[ManualAdapter]] = {}

    def __call__(
        self, name: str, type: str, max_concurrency: int, options: dict[str, Any], reactor: IReactorTime
    ) -> IAdapter:
        adapter = build(name, type, max_concurrency, options, reactor)
        assert isinstance(adapter, ManualAdapter), "held starts are for manual adapters"
        self.built.setdefault(name, []).append(adapter)
        if name in self.held and name not in self._handed:
            self._handed.add(name)
            pending = self.held[name]

            def start() -> Deferred[None]:
                adapter.started += 1
                return pending

            cast(Any, adapter).start = start
        return adapter

    def instance(self, name: str, index: int = 0) -> ManualAdapter:
        """
        The C{index}th instance built of adapter C{name}.
        """
        return self.built[name][index]
