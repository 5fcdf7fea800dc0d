"""
Defaults shared by every adapter: no tunnel, no sessions, no extra
commands, and nothing to start or stop; and L{OutputGate}, flow control
for adapters that make their output themselves.
"""

import builtins
from collections.abc import Callable
from typing import Any, ClassVar

from twisted.internet import defer
from twisted.internet.interfaces import IPushProducer
from zope.interface import implementer

from iop.adapters.interface import AdapterConfigError, Capabilities, NotSupported, Progress, TunnelInput
from iop.run import ITunnelSink


def register_output(emit: Callable[..., Any], producer: IPushProducer) -> None:
    """
    Make C{producer} the source of C{emit}'s stream for flow control, when
    C{emit} takes one (the Node's does; a bare callable in a test does not).
    """
    register = getattr(emit, "register_producer", None)
    if register is not None:
        register(producer)


@implementer(IPushProducer)
class OutputGate:
    """
    The producer of an adapter whose output is made in-process (no socket
    or pipe for the Node to stop reading): registered with C{emit}, it is
    paused while the caller is not taking the stream, and the adapter
    waits on L{wait} before making more. Without it, a slow reader makes
    the Node queue the whole answer in memory.
    """

    def __init__(self) -> None:
        self.paused = False
        self._waiting: defer.Deferred[None] | None = None

    @classmethod
    def registered(cls, emit: Callable[..., Any]) -> "OutputGate":
        """
        A gate registered as C{emit}'s producer (when C{emit} takes one; a
        bare callable never pauses it).
        """
        gate = cls()
        register_output(emit, gate)
        return gate

    def wait(self) -> "defer.Deferred[None]":
        """
        A Deferred firing once output may go on: at once unless paused.
        """
        if not self.paused:
            return defer.succeed(None)
        if self._waiting is None or self._waiting.called:
            self._waiting = defer.Deferred()
        return self._waiting

    def pauseProducing(self) -> None:
        self.paused = True

    def resumeProducing(self) -> None:
        self.paused = False
        waiting, self._waiting = self._waiting, None
        if waiting is not None and not waiting.called:
            waiting.callback(None)

    def stopProducing(self) -> None:
        # The run is cancelled through its Deferred; here, only stop holding
        # anything back.
        self.resumeProducing()


class AdapterBase:
    """
    Subclasses set C{type}, declare the option keys they read in
    L{OPTIONS}, and override what they support.

    Constructing an adapter only reads and checks its options: it starts
    nothing and opens nothing (no connection, process, file or timer;
    that is L{start}'s and the work's), so that the Edge can check an
    adapter's configuration by building it on a fake reactor
    (L{iop.adapters.registry.check_adapter}).

    @ivar options: the adapter's type-specific configuration keys.
    @ivar reactor: the Node's reactor. Typed C{Any}: adapters use several
        of its interfaces at once (C{IReactorTime}, C{IReactorProcess},
        and treq's TCP and name resolution), which no one interface type
        names.
    """

    #: The adapter type name (a key of L{iop.run.ADAPTER_TYPES}).
    type: str = ""

    #: The keys of every adapter's configuration entry, which are not
    #: options: they reach the Node beside them, in its C{AdapterConfig}.
    COMMON_KEYS: ClassVar[frozenset[str]] = frozenset({"name", "type", "max_concurrency"})
    #: The option keys this type reads (a subclass adds its own to its
    #: base's); any other is refused (L{iop.adapters.registry}), so that a
    #: misspelt key is not silently ignored. None is common to every type.
    OPTIONS: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, name: str, max_concurrency: int, options: dict[str, Any] | None, reactor: Any) -> None:
        if not isinstance(max_concurrency, int) or max_concurrency < 1:
            raise AdapterConfigError(name, "max_concurrency", "must be a positive integer")
        self.name = name
        self.max_concurrency = max_concurrency
        self.options = dict(options or {})
        self.reactor = reactor

    def option(
        self,
        key: str,
        default: Any = None,
        kind: builtins.type | tuple[builtins.type, ...] | None = None,
        required: bool = False,
    ) -> Any:
        """
        One type-specific option, checked (C{bool} is never taken for a
        number); errors name the key. C{key} must be declared in
        L{OPTIONS}, which keeps the declaration what the adapter reads.
        """
        assert key in self.OPTIONS, f"{self.__class__.__name__} reads option {key!r} not declared in its OPTIONS"
        if key not in self.options:
            if required:
                raise AdapterConfigError(self.name, key, f"is required for type {self.type}")
            return default
        value = self.options[key]
        if kind is None:
            return value
        kinds = kind if isinstance(kind, tuple) else (kind,)
        # (A YAML true is a Python int: never a number here.)
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            raise AdapterConfigError(self.name, key, f"has the wrong type: {value!r}")
        return value

    def capabilities(self) -> Capabilities:
        return Capabilities(max_concurrency=self.max_concurrency)

    def start(self) -> "defer.Deferred[None]":
        return defer.succeed(None)

    def stop(self) -> "defer.Deferred[None]":
        return defer.succeed(None)

    def tunnel(self, request: TunnelInput, sink: ITunnelSink) -> "defer.Deferred[Any]":
        raise NotSupported(f"adapter {self.name} ({self.type}) has no raw provider tunnel")

    def terminate_session(self, target: str, session_id: str) -> "defer.Deferred[dict[str, bool]]":
        raise NotSupported(f"adapter {self.name} ({self.type}) does not support sessions")

    def command(self, name: str, args: dict[str, Any], progress: Progress | None = None) -> "defer.Deferred[Any]":
        raise NotSupported(f"adapter {self.name} ({self.type}) has no command {name!r}")
