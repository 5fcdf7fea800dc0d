"""
How long a provider may keep a request waiting, and the one timer that
watches it.

Three deadlines, each an adapter option (seconds; 0 disables it):

  - C{first_byte_timeout_sec}: from the request to the first byte of the
    answer (headers alone do not count, nor keep-alive comments or a role
    chunk: a server that sends them at once and then thinks for minutes
    has not answered). Only for answers that stream; a non-streamed
    answer's first byte is its last.
  - C{stall_timeout_sec}: silence between body bytes once the answer began.
  - C{idle_timeout_sec}: silence at any point (the bound that was there
    first, and still the only one of a non-streamed answer before its body).

Silence while the caller is not taking the stream (flow control paused the
read) is ours, not the provider's: no deadline runs then.
"""

from collections.abc import Callable
from dataclasses import dataclass, replace

from twisted.internet.interfaces import IDelayedCall, IReactorTime

from iop.adapters.interface import AdapterConfigError
from iop.run import FIRST_BYTE, IDLE, STALL

#: The defaults of the three deadline options (seconds).
DEFAULT_IDLE_TIMEOUT_SEC = 300
DEFAULT_FIRST_BYTE_TIMEOUT_SEC = 120
DEFAULT_STALL_TIMEOUT_SEC = 60

#: How long a stream that said it finished (a finish reason) may go on
#: without its end marker (C{[DONE]}) or its end before it is ended as
#: complete, its connection closed.
FINISH_GRACE_SEC = 2.0

#: The option name of each deadline kind.
OPTION_NAMES = {
    IDLE: "idle_timeout_sec",
    FIRST_BYTE: "first_byte_timeout_sec",
    STALL: "stall_timeout_sec",
}


@dataclass(frozen=True)
class Deadlines:
    """
    An adapter's deadlines in seconds; C{None} is no deadline.
    """

    idle: float | None = DEFAULT_IDLE_TIMEOUT_SEC
    first_byte: float | None = DEFAULT_FIRST_BYTE_TIMEOUT_SEC
    stall: float | None = DEFAULT_STALL_TIMEOUT_SEC

    def not_streamed(self) -> "Deadlines":
        """
        These deadlines for an answer that does not stream: no first-byte
        deadline (its first byte comes when the whole answer is made).
        """
        return replace(self, first_byte=None)

    def idle_only(self) -> "Deadlines":
        """
        Only the idle deadline: for work that is no answer (a model pull).
        """
        return replace(self, first_byte=None, stall=None)


class Watch:
    """
    The deadlines of one request, on one timer. C{expired(kind, seconds)}
    is called once when a deadline passes (C{kind} one of
    L{iop.run.DEADLINES}); the owner closes the connection.

    The timer is not moved on every chunk: it is set for the earliest
    deadline, and when it fires early (data came since) it is set again.
    """

    def __init__(self, deadlines: Deadlines, clock: IReactorTime, expired: Callable[[str, float], None]) -> None:
        self.deadlines = deadlines
        self.clock = clock
        self.expired = expired
        self.started = clock.seconds()
        self.heard = self.started
        self.body_began = False
        self.paused = False
        self.done = False
        self._timer: IDelayedCall | None = None
        self._arm()

    def touch(self) -> None:
        """
        The provider said something: headers or body bytes.
        """
        if self.done or self.paused:
            return
        self.heard = self.clock.seconds()
        if self._timer is None:
            self._arm()

    def began(self) -> None:
        """
        The answer began: from the first-byte deadline to the stall one,
        which may be due sooner (the timer is set again).
        """
        if self.body_began or self.done:
            return
        self.body_began = True
        self._cancel()
        if not self.paused:
            self._arm()

    def pause(self) -> None:
        """
        The caller is not taking the stream: no deadline runs.
        """
        self.paused = True
        self._cancel()

    def resume(self) -> None:
        if self.paused:
            self.paused = False
            self.touch()

    def stop(self) -> None:
        """
        The request is over.
        """
        self.done = True
        self._cancel()

    def _due(self) -> tuple[float, str, float] | None:
        """
        The earliest deadline: C{(when, kind, seconds)}, or C{None}.
        """
        candidates = []
        idle, first_byte, stall = self.deadlines.idle, self.deadlines.first_byte, self.deadlines.stall
        if idle is not None:
            candidates.append((self.heard + idle, IDLE, idle))
        if self.body_began:
            if stall is not None:
                candidates.append((self.heard + stall, STALL, stall))
        elif first_byte is not None:
            candidates.append((self.started + first_byte, FIRST_BYTE, first_byte))
        return min(candidates) if candidates else None

    def _arm(self) -> None:
        due = self._due()
        if due is not None:
            self._timer = self.clock.callLater(max(0.0, due[0] - self.clock.seconds()), self._fire)

    def _fire(self) -> None:
        self._timer = None
        if self.done or self.paused:
            return
        due = self._due()
        if due is None:
            return
        when, kind, seconds = due
        if when > self.clock.seconds():
            self._arm()
            return
        self.stop()
        self.expired(kind, seconds)

    def _cancel(self) -> None:
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None


def deadline_options(option: Callable[..., object], name: str) -> Deadlines:
    """
    The deadlines an adapter's options set, checked: each a number of
    seconds, 0 to disable it.

    @param option: the adapter's L{iop.adapters.base.AdapterBase.option}.
    @raise iop.adapters.interface.AdapterConfigError: naming the key.
    """
    values = {}
    defaults = Deadlines()
    for kind, key in OPTION_NAMES.items():
        default = getattr(defaults, kind)
        value = option(key, default, (int, float))
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            raise AdapterConfigError(name, key, "must be a number of seconds, 0 or more (0 = none)")
        values[kind] = value or None
    return Deadlines(**values)
