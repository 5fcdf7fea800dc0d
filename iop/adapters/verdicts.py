"""
What a provider's error answer says beyond its status: how long it asks
the caller to wait (C{Retry-After}), and whether a 400 is the prompt being
longer than the model's context (which a larger model may take).

Plain functions of headers and bytes, so that runs and tunnels, OpenAI and
Ollama back ends read these the same way.
"""

import re
from email.utils import parsedate_to_datetime

from twisted.web.http_headers import Headers

from iop import jsontext

#: How a provider says a prompt is longer than its context: OpenAI's
#: error code, and the messages of vLLM ("maximum context length"),
#: llama.cpp ("exceeds the available context size"), TGI and others.
_CONTEXT_CODES = frozenset({"context_length_exceeded", "exceed_context_size_error", "context_window_exceeded"})
_CONTEXT_MESSAGE = re.compile(
    r"context[ _-]?(length|size|window)|maximum context|prompt is too long|too many (input )?tokens", re.IGNORECASE
)

#: The longest delay a Retry-After is believed for (seconds): beyond it the
#: provider is down rather than busy.
MAX_RETRY_AFTER_SEC = 3600.0


def retry_after(headers: Headers, now: float) -> float:
    """
    The delay in seconds a response's C{Retry-After} (delay-seconds or an
    HTTP date) or C{retry-after-ms} asks for; 0 when it asks for none or
    says something unreadable.

    @param now: the current time (POSIX seconds), for a date.
    """
    millis = headers.getRawHeaders(b"retry-after-ms")
    if millis:
        seconds = _number(millis[0])
        if seconds is not None:
            return _bounded(seconds / 1000)
    values = headers.getRawHeaders(b"retry-after")
    if not values:
        return 0.0
    text = values[0].decode("latin-1").strip()
    seconds = _number(values[0])
    if seconds is not None:
        return _bounded(seconds)
    try:
        when = parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError):
        return 0.0
    return _bounded(when.timestamp() - now)


def _number(raw: bytes) -> float | None:
    try:
        value = float(raw.decode("latin-1").strip())
    except ValueError:
        return None
    return value if value == value else None  # NaN says nothing


def _bounded(seconds: float) -> float:
    return min(max(seconds, 0.0), MAX_RETRY_AFTER_SEC)


def says_context_length(body: bytes) -> bool:
    """
    Whether an error body says the prompt is longer than the model's
    context: an error C{code} or C{type} that says so, or a message that
    does.
    """
    text = body.decode("utf-8", "replace")
    try:
        data = jsontext.loads(text)
    except ValueError:
        return _CONTEXT_MESSAGE.search(text) is not None
    error = data.get("error") if isinstance(data, dict) else None
    if isinstance(error, dict):
        # (Any JSON value may be there: only a string is looked up.)
        if any(isinstance(word, str) and word in _CONTEXT_CODES for word in (error.get("code"), error.get("type"))):
            return True
        text = str(error.get("message") or "")
    elif isinstance(data, dict):
        text = str(error or data.get("message") or data.get("detail") or "")
    return _CONTEXT_MESSAGE.search(text) is not None
