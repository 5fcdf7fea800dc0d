"""
Log lines about what strangers do, at a bounded rate: one line per
interval with a count, never one per connection, so that opening
connections cannot flood the log.
"""

from typing import Any

from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger


class LogThrottle:
    """
    Count events; log the first one and then at most one line per
    C{interval} seconds, with the number of events so far.

    @param message: a log format with a C{{count}} field (and any fields
        passed to L{note}).
    """

    log = Logger()

    def __init__(self, clock: IReactorTime, message: str, interval: float = 10.0) -> None:
        self.clock = clock
        self.message = message
        self.interval = interval
        self.count = 0
        self._last: float | None = None

    def note(self, **fields: Any) -> None:
        self.count += 1
        now = self.clock.seconds()
        if self._last is None or now - self._last >= self.interval:
            self._last = now
            self.log.warn(self.message, count=self.count, **fields)
