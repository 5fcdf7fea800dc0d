"""
Process-level behaviour shared by both daemons.

twistd re-raises SIGTERM/SIGINT after a clean shutdown, so the process
ends "killed by signal" (status 143/130) even though nothing went wrong.
For an operator's process manager a requested stop is a success: once the
reactor runs (its own handlers are installed at startup and would replace
ours), the daemons take those two signals over and stop cleanly with
status 0.
"""

import gc
import signal
from collections.abc import Callable, Iterable
from types import FrameType
from typing import Any, Protocol

from twisted.internet.error import ReactorNotRunning
from twisted.internet.interfaces import IReactorFromThreads


class SignalReactor(Protocol):
    """
    What signal handling needs of a reactor: the global one (whose static
    type does not declare L{IReactorFromThreads}, though it provides it,
    so that part is reached by adaptation) or a test's stand-in.
    """

    running: Any

    def callWhenRunning(self, callable: Callable[..., Any], *args: object, **kwargs: object) -> Any: ...

    def stop(self) -> None: ...


def on_signals(reactor: SignalReactor, signums: Iterable[int], callback: Callable[[str], object]) -> None:
    """
    Once C{reactor} runs, each of C{signums} calls C{callback(message)} in
    the reactor thread.
    """
    threads = IReactorFromThreads(reactor)

    def handler(signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        threads.callFromThread(callback, f"received {name}")

    def install() -> None:
        for signum in signums:
            signal.signal(signum, handler)

    reactor.callWhenRunning(install)


def on_stop_signals(reactor: SignalReactor, stop: Callable[[str], object]) -> None:
    """
    Once C{reactor} runs, SIGTERM and SIGINT call C{stop(message)} in the
    reactor thread instead of twistd's handlers.
    """
    on_signals(reactor, (signal.SIGTERM, signal.SIGINT), lambda message: stop(f"{message}, shutting down"))


def stop_then_hurry(reactor: SignalReactor, hurry: Callable[[], object]) -> None:
    """
    The first SIGTERM/SIGINT stops the reactor (services drain in their
    C{stopService}) and the process exits 0; any later one calls
    C{hurry()} to end the drain at once.
    """
    signals: list[str] = []

    def stop(message: str) -> None:
        signals.append(message)
        if len(signals) > 1:
            hurry()
        elif reactor.running:
            try:
                reactor.stop()
            except ReactorNotRunning:
                pass  # already stopping (a fatal exit): nothing to add

    on_stop_signals(reactor, stop)


def freeze_startup_heap(reactor: SignalReactor) -> None:
    """
    Once the reactor runs, move everything built at start-up (modules,
    configuration, adapters) out of the garbage collector's sight: those
    objects live as long as the process, and a full collection under load
    would otherwise scan them again and again (measured: a fifth of the
    Edge's CPU during a 5,000-stream burst went to full collections).
    """

    def freeze() -> None:
        gc.collect()
        gc.freeze()

    reactor.callWhenRunning(freeze)
