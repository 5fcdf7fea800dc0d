"""
Log formats for both daemons: C{log_format: text} (twistd's own lines, the
default) or C{log_format: json}, one JSON object per line for log
shippers.

A JSON line carries C{time} (UTC, ISO 8601), C{level}, C{logger} (the
module), C{message} (the same sentence the text format prints) and every
keyword field of the log call — C{node}, C{run_id}, C{id}, C{reason},
C{code}, ... — so a shipper can index the ids an operator searches for
without parsing sentences; a failure adds C{traceback}.

twistd picks the observer after the tap's C{makeService} returns: it uses
an C{ILogObserver} component of its application when there is one. The
tap wraps its service in L{LogFormatted}, which offers that component when
twistd adds it to the application.
"""

import json
import sys
from datetime import UTC, datetime
from typing import IO, Any

from twisted.application.service import IService, IServiceCollection, MultiService
from twisted.logger import ILogObserver, LogEvent, formatEvent
from twisted.python.components import Componentized
from zope.interface import implementer

from iop.config import Section

TEXT = "text"
JSON = "json"
LOG_FORMATS = (TEXT, JSON)

#: Keys of twisted.python.log events that repeat the message in other forms.
_LEGACY_KEYS = frozenset({"message", "format", "isError", "system", "failure", "time", "printed"})


def parse_log_format(section: Section) -> str:
    """
    The C{log_format} key of a configuration section: C{text} or C{json}.

    @raise iop.config.ConfigError: naming the key, for anything else.
    """
    value = section.get("log_format", str, TEXT)
    if value not in LOG_FORMATS:
        raise section.error("log_format", f"must be one of {', '.join(LOG_FORMATS)}, not {value!r}")
    return value


def _field(value: object) -> bool | int | float | str | None:
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)


def json_line(event: LogEvent, daemon: str = "") -> str:
    """
    One log event as one line of JSON (no newline inside: messages and
    tracebacks are escaped).
    """
    level = event.get("log_level")
    record: dict[str, Any] = {
        "daemon": daemon,
        "time": datetime.fromtimestamp(event.get("log_time", 0), UTC).isoformat(timespec="milliseconds"),
        "level": level.name if level is not None else "info",
        "logger": event.get("log_namespace", ""),
        "message": formatEvent(event),
    }
    for key, value in event.items():
        if key.startswith("log_") or key in _LEGACY_KEYS or key in record:
            continue
        record[key] = _field(value)
    failure = event.get("log_failure")
    if failure is not None:
        record["traceback"] = failure.getTraceback()
    return json.dumps(record, ensure_ascii=False)


@implementer(ILogObserver)
class JSONLineObserver:
    """
    Writes each event as a JSON line to C{out}, flushed at once, with
    C{daemon} (C{iop-edge} or C{iop-node}) on every line so that lines of
    both daemons can share one index.
    """

    def __init__(self, out: IO[str], daemon: str = "") -> None:
        self.out = out
        self.daemon = daemon

    def __call__(self, event: LogEvent) -> None:
        self.out.write(json_line(event, daemon=self.daemon) + "\n")
        self.out.flush()


class LogFormatted(MultiService):
    """
    A daemon's service with its own log observer: when twistd makes it a
    child of its application, the observer becomes the application's
    C{ILogObserver}, which twistd then logs to instead of its text lines.
    Starting and stopping (the drain) go straight to the wrapped service.
    """

    def __init__(self, service: IService, observer: ILogObserver) -> None:
        super().__init__()
        self.service = service
        self.observer = observer
        service.setServiceParent(self)

    def setServiceParent(self, parent: IServiceCollection) -> None:
        if isinstance(parent, Componentized):
            parent.setComponent(ILogObserver, self.observer)
        super().setServiceParent(parent)


def with_log_format(service: IService, log_format: str, daemon: str, out: IO[str] | None = None) -> IService:
    """
    C{service} as the tap returns it for C{log_format}: itself for text,
    wrapped in L{LogFormatted} for JSON lines on C{out} (the process's
    stdout as it is now, before twistd redirects it into the log).
    """
    if log_format != JSON:
        return service
    return LogFormatted(service, JSONLineObserver(sys.stdout if out is None else out, daemon))
