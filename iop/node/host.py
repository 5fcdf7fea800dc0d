"""
The adapters a Node runs, kept across reconnects.

The Edge sends the Node's adapter list on every registration and on a
config refresh. Rebuilding everything each time would drop warm back-end
state (CLI sessions, HTTP pools) on every network blip, so the host keeps
one instance per adapter name and rebuilds only an adapter whose type,
concurrency or options changed. It is process-wide: sessions come and go,
the host stays.
"""

import json
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from twisted.internet import defer
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from iop.adapters.interface import IAdapter
from iop.adapters.registry import build_adapter
from iop.node.gate import CapacityGate
from iop.turns import EndOfTurn

if TYPE_CHECKING:
    from iop.node.metrics import NodeMetrics

#: Builds an adapter: C{(name, type, max_concurrency, options, reactor)}.
BuildAdapter = Callable[[str, str, int, dict[str, Any], IReactorTime], IAdapter]


class AdapterSetupError(Exception):
    """
    An adapter from the Edge's configuration could not be built or
    started. Retrying with the same configuration would fail the same way.
    """


@dataclass
class Hosted:
    """
    One running adapter instance and the capacity gate in front of it.
    """

    name: str
    adapter: IAdapter
    gate: CapacityGate
    spec: tuple[str, int, str]


def _spec(config: Any) -> tuple[str, int, str]:
    """
    What identifies an adapter's configuration (an C{AdapterConfig}
    message): equal specs mean the running instance can be kept.
    """
    options = json.loads(config.options_json) if config.options_json else {}
    if not isinstance(options, dict):
        raise ValueError("options_json must be a JSON object")
    return (config.type, int(config.max_concurrency), json.dumps(options, sort_keys=True))


class AdapterHost:
    """
    Builds, starts, keeps and retires adapter instances.

    @param reactor: the clock adapters time out with; they may use more of
        the reactor (TCP for HTTP back ends, processes for command lines).

    @param build: C{build_adapter}-compatible factory (tests inject fakes).
    @param metrics: a L{iop.node.metrics.NodeMetrics}, or C{None}.
    """

    log = Logger()

    def __init__(
        self, reactor: IReactorTime, build: BuildAdapter = build_adapter, metrics: "NodeMetrics | None" = None
    ) -> None:
        self.reactor = reactor
        #: The end of the reactor's turns, for work gathered per turn
        #: (L{iop.node.joined}).
        self.turns = EndOfTurn(reactor)
        self.build = build
        self.metrics = metrics
        self._hosted: dict[str, Hosted] = {}
        #: Retired instances still finishing their work, by name (their
        #: work counts in the name's in-flight gauge with the current one's).
        self._retiring: dict[str, list[Hosted]] = {}
        self._lock = defer.DeferredLock()
        #: The adapters of the apply under way whose start has not ended,
        #: the one starting first.
        self._unstarted: list[str] = []

    @property
    def starting(self) -> tuple[str, ...]:
        """
        The names of the adapters an apply under way is still to start,
        the one whose C{start} is pending first: what a caller that gives
        up on the apply can tell its operator.
        """
        return tuple(self._unstarted)

    def get(self, name: str) -> Hosted | None:
        """
        @return: the L{Hosted} adapter called C{name}, or C{None}.
        """
        return self._hosted.get(name)

    def all(self) -> list[Hosted]:
        return list(self._hosted.values())

    def apply(self, adapters: Iterable[Any]) -> Deferred[None]:
        """
        Make the running set match C{adapters} (C{AdapterConfig} messages).

        All or nothing: if any new or changed adapter cannot be built or
        started, the running set is left as it was.

        @return: a Deferred firing when the new set is running, or failing
            with L{AdapterSetupError} naming the adapter. Cancelling it
            (a session's C{configure_timeout_sec}) abandons the pending
            C{start}, stops the adapters this apply built and leaves the
            running set as it was, so that the next apply starts afresh.
        """
        return self._lock.run(self._apply, list(adapters))

    @defer.inlineCallbacks
    def _apply(self, adapters: list[Any]) -> Generator[Deferred[Any], Any, None]:
        wanted: dict[str, Hosted] = {}
        fresh: list[Hosted] = []
        for config in adapters:
            try:
                spec = _spec(config)
            except ValueError as e:
                raise AdapterSetupError(f"adapter {config.name}: options_json: {e}") from None
            current = self._hosted.get(config.name)
            if current is not None and current.spec == spec:
                wanted[config.name] = current
                continue
            try:
                adapter = self.build(config.name, spec[0], spec[1], json.loads(spec[2]), self.reactor)
            except Exception as e:
                raise AdapterSetupError(f"adapter {config.name}: {e}") from None
            hosted = Hosted(config.name, adapter, self._gate(config.name, adapter), spec)
            wanted[config.name] = hosted
            fresh.append(hosted)

        started: list[Hosted] = []
        self._unstarted = [h.name for h in fresh]
        try:
            for hosted in fresh:
                try:
                    yield defer.maybeDeferred(hosted.adapter.start)
                except defer.CancelledError:
                    # The caller gave up on this apply. The abandoned adapter
                    # may hold half of what its start acquired: it is stopped
                    # too. Not waited for: a stop that hangs as well must not
                    # keep the lock from the next apply.
                    self._stop_all([h.adapter for h in [*started, hosted]])
                    raise
                except Exception as e:
                    yield self._stop_all([h.adapter for h in started])
                    raise AdapterSetupError(f"adapter {hosted.name}: start failed: {e}") from None
                started.append(hosted)
                self._unstarted.remove(hosted.name)
                self.log.info("adapter {name} ({type}) started", name=hosted.name, type=hosted.spec[0])
        finally:
            self._unstarted = []

        retired = [h for name, h in self._hosted.items() if wanted.get(name) is not h]
        self._hosted = wanted
        for hosted in retired:
            self._retire(hosted)

    def _gate(self, name: str, adapter: IAdapter) -> CapacityGate:
        limit = adapter.capabilities().max_concurrency
        if self.metrics is None:
            return CapacityGate(limit)
        return CapacityGate(limit, lambda _: self._report_in_flight(name))

    def _report_in_flight(self, name: str) -> None:
        """
        The in-flight gauge of adapter C{name}: the work of its current
        instance and of those retired but not yet idle (a rebuild's old and
        new instances share the name).
        """
        assert self.metrics is not None  # (only gates with metrics report)
        current = self._hosted.get(name)
        hosted = [*self._retiring.get(name, []), *([current] if current is not None else [])]
        self.metrics.in_flight(name, sum(h.gate.in_use for h in hosted))

    def _retire(self, hosted: Hosted) -> Deferred[None]:
        """
        Stop an adapter that left the configuration once its in-flight
        work is over; new work already goes to its replacement.
        """
        self.log.info("adapter {name} retired; stopping once idle", name=hosted.name)
        retiring = self._retiring.setdefault(hosted.name, [])
        retiring.append(hosted)

        def idle(_: object) -> object:
            retiring.remove(hosted)
            if not retiring:
                self._retiring.pop(hosted.name, None)
            return hosted.adapter.stop()

        d = hosted.gate.when_idle()
        d.addCallback(idle)
        d.addErrback(lambda f: self.log.failure("stopping adapter {name} failed", f, name=hosted.name))
        return d

    def _stop_all(self, adapters: list[IAdapter]) -> Deferred[list[Any]]:
        ds = [defer.maybeDeferred(a.stop) for a in adapters]
        for d in ds:
            d.addErrback(lambda f: self.log.failure("stopping an adapter failed", f))
        return defer.gatherResults(ds)

    def stop(self) -> Deferred[list[Any]]:
        """
        Stop every adapter (the Node is shutting down; in-flight work has
        been cancelled already).
        """
        hosted, self._hosted = list(self._hosted.values()), {}
        return self._stop_all([h.adapter for h in hosted])
