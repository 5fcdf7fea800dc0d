"""
Ending the Node process with a chosen exit status.

C{twistd} exits 0 whenever the reactor stops, however it stopped. A Node
that gives up (refused credentials, retries exhausted) must tell its
process manager so with a non-zero status, so L{ProcessExit} logs the
reason, stops the reactor (services shut down as usual) and leaves an
C{atexit} hook that flushes output and calls C{os._exit(status)} once
twistd has finished.

A local shutdown (SIGTERM, SIGINT) must exit 0, but twistd, after a clean
shutdown caused by one of those signals, sends the same signal to itself
again so the process ends "killed by SIGTERM" (status 143, or 130 for
SIGINT). The tap uses L{iop.daemon.stop_then_hurry} to take the two
signals over: the first stops the reactor (the Node drains) and twistd
exits 0; a later one ends the drain at once.

Library code receives an exit callable, C{exit(status, message)}; tests pass
a recorder instead of L{ProcessExit} so nothing kills the test process.
"""

import atexit
import os
import sys
from collections.abc import Callable
from typing import Any, Protocol

from twisted.internet.error import ReactorNotRunning
from twisted.logger import Logger

#: How library code ends the process: C{exit(status, message)}.
Exit = Callable[[int, str], object]

#: A local shutdown (SIGTERM/SIGINT).

EXIT_OK = 0
#: The local configuration is invalid; reported before anything starts.
EXIT_BAD_CONFIG = 1
#: The Edge refused the Node for good (unknown token, config build failure,
#: an adapter that cannot be built).
EXIT_REFUSED = 2
#: Every allowed consecutive connect attempt failed.
EXIT_EXHAUSTED = 3
#: The Edge cannot serve this Node's wire version (C{INCOMPATIBLE_VERSION}):
#: one side must be upgraded, which an operator must see apart from a bad
#: token.
EXIT_INCOMPATIBLE = 4


class Stoppable(Protocol):
    """
    What L{ProcessExit} needs of the reactor.
    """

    def stop(self) -> None: ...


class ProcessExit:
    """
    C{exit(status, message)}: log C{message}, stop the reactor, and make
    the process end with C{status}. Only the first call counts.
    """

    log = Logger()

    def __init__(
        self,
        reactor: Stoppable,
        register: Callable[..., Any] = atexit.register,
        hard_exit: Callable[[int], object] = os._exit,
    ) -> None:
        self.reactor = reactor
        self._register = register
        self._hard_exit = hard_exit
        self.status: int | None = None

    def __call__(self, status: int, message: str) -> None:
        if self.status is not None:
            return
        self.status = status
        if status:
            self.log.critical("{message} (exit status {status})", message=message, status=status)
            self._register(self._exit_now, status)
        else:
            self.log.info("{message}", message=message)
        try:
            self.reactor.stop()
        except ReactorNotRunning:
            pass

    def _exit_now(self, status: int) -> None:

        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        self._hard_exit(status)
