"""
A stand-in for a running reactor, for code that installs signal handlers
once the reactor runs and stops it on a signal (L{iop.daemon}).
"""

import signal
from collections.abc import Callable
from typing import Any

from twisted.internet.error import ReactorNotRunning
from twisted.internet.interfaces import IReactorFromThreads
from zope.interface import implementer


@implementer(IReactorFromThreads)
class RunningReactor:
    """
    Just enough of a running reactor for L{iop.daemon} signal handling.
    """

    running = True

    def __init__(self, stopping: bool = False) -> None:
        self.stopped = 0
        #: Like a reactor already shutting down (still "running"): stop() raises.
        self.stopping = stopping

    def callFromThread(self, callable: Callable[..., Any], *args: object, **kwargs: object) -> None:
        callable(*args, **kwargs)

    def callWhenRunning(self, callable: Callable[..., Any], *args: object, **kwargs: object) -> None:
        callable(*args, **kwargs)

    def stop(self) -> None:

        if self.stopping:
            raise ReactorNotRunning("already stopping")
        self.stopped += 1


def deliver_signal(signum: int) -> None:
    """
    Call the Python handler installed for C{signum} as the interpreter
    would on delivery (without sending the process a signal).
    """
    handler = signal.getsignal(signum)
    if not callable(handler):
        raise AssertionError(f"no Python handler for signal {signum}: {handler!r}")
    handler(signum, None)
