"""
JSON text from the other side of a connection (a provider's answer, a
Node's frame), parsed with one error for every way it can be wrong.

C{json.loads} raises C{RecursionError}, not C{ValueError}, for nesting
deeper than Python's recursion limit (about a thousand levels): an answer
of C{[[[[...} would otherwise escape every C{except ValueError} that
handles a malformed answer and fail as an internal error in whichever
callback parsed it. L{loads} and L{loads_each} treat it as the malformed
JSON it is.
"""

import json
from typing import Any

import orjson

#: Every digit as C{0}, so that a run of digits that may be an integer
#: past 64 bits (which orjson turns into a float where C{json} keeps it
#: whole) is found by a plain search: a quarter of the cost of orjson's
#: parse, where a regular expression costs more than the parse itself.
_DIGITS_AS_ZERO = bytes(ord("0") if ord("0") <= byte <= ord("9") else byte for byte in range(256))
_LONG_DIGITS = b"0" * 19


def loads(text: bytes | str) -> Any:
    """
    C{json.loads(text)}.

    @raise ValueError: for anything that is not one JSON value, nesting
        too deep to parse included.
    """
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("JSON nested too deeply to parse") from None


def loads_each(texts: list[bytes]) -> list[Any] | None:
    """
    C{texts}, each one JSON value, parsed in one go (as one JSON array):
    a burst of events or lines read in one piece costs one parse. C{None}
    when one of them is not one value (or not UTF-8): then each must be
    parsed alone to find which.

    orjson parses the bytes as they are, in well under half the time of
    C{json} (the largest single cost of a Node relaying a burst). What it
    refuses and C{json} accepts (NaN, infinities, lone surrogates) is parsed
    again by C{json}, and so is a burst with a long run of digits, which
    orjson would read as a float where C{json} keeps an integer past 64
    bits whole: both give the same values.
    """
    joined = b"[" + b",".join(texts) + b"]"
    values = None if _LONG_DIGITS in joined.translate(_DIGITS_AS_ZERO) else _orjson_array(joined)
    if values is None:
        values = _json_array(joined)
    return values if isinstance(values, list) and len(values) == len(texts) else None


def _orjson_array(joined: bytes) -> Any:
    try:
        return orjson.loads(joined)
    except orjson.JSONDecodeError:
        return None


def _json_array(joined: bytes) -> Any:
    # (Decoded here: json.loads would take bytes that begin with "[" and a NUL for UTF-16.)
    try:
        return loads(joined.decode("utf-8"))
    except ValueError:
        return None
