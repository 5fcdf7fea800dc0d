"""
A server-sent events reader for the command line: the C{text/event-stream}
framing of the HTML standard (C{data:}, C{id:}, C{event:} fields, comments,
blank line ends an event), over any iterable of byte lines.
"""

from collections.abc import Iterable, Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class Event:
    """
    One dispatched event: its C{data} (several C{data:} lines joined by
    newlines), and the C{id} and C{event} name when the stream gave them.
    """

    data: str
    id: str | None = None
    event: str | None = None


def parse(lines: Iterable[bytes]) -> Iterator[Event]:
    """
    Yield each L{Event} as soon as its closing blank line arrives; an
    unfinished event at the end of the stream is dropped, as a browser's
    C{EventSource} does.

    @param lines: an iterable of C{bytes} lines (with or without their
        line endings), for example an C{http.client.HTTPResponse}.
    """
    data: list[str] = []
    event_id: str | None = None
    name: str | None = None
    for raw in lines:
        line = raw.decode("utf-8", "replace").rstrip("\r\n")
        if not line:
            if data:
                yield Event("\n".join(data), event_id, name)
            data, name = [], None
            continue
        if line.startswith(":"):
            continue
        field, _, value = line.partition(":")
        if value.startswith(" "):
            value = value[1:]
        if field == "data":
            data.append(value)
        elif field == "id":
            event_id = value
        elif field == "event":
            name = value
