"""
What a caller sent, checked before anything is placed.

A request body is parsed as JSON and the whole tree is checked once
(L{parse_body}): nesting at most L{MAX_DEPTH} levels, every string and key
encodable as UTF-8 (no lone surrogates such as C{"\\ud800"}: the wire's
protobuf strings refuse them, and so do most providers), no C{NaN} or
C{Infinity} (neither spelled out nor as a number too large for a float,
C{1e400}), no object naming a key twice (the Edge would check one value
while a tunnel forwards the caller's bytes), no integer outside 64 bits
(C{json} reads any length, and the Edge's accounting turns a token cap
into a float). Then each surface reads the fields it uses through the
typed getters below, which refuse a wrong type or an oversize name with an
L{HTTPError} naming the field (400 C{invalid_request_error}, with
C{param}).

So a request that reaches L{iop.edge.service.EdgeService.submit} can be
encoded on the wire as it is, and a malformed one never takes a lease:
docs/edge.md, "Surfaces".
"""

import json
import math
import re
from typing import Any, NoReturn

from iop.edge.errors import ServiceError

#: The deepest nesting a request body may have (the top-level object is
#: level 1). Deeper JSON is refused before anything else looks at it.
MAX_DEPTH = 64

#: The longest name a caller may send: model, adapter, node, target,
#: session id, command, role.
MAX_NAME_CHARS = 512

_SURROGATE = re.compile("[\ud800-\udfff]")

#: The widest integer a request body may hold: signed or unsigned 64 bits
#: (a C{seed} may be a uint64), what providers' JSON readers take.
INTEGER_RANGE = range(-(2**63), 2**64)

#: A place in a request body: C{(parent place, key or index)}, C{None} at
#: the top.
Place = tuple["Place", str | int] | None


class HTTPError(ServiceError):
    """
    A request the surface itself refuses (bad JSON, bad field, bad key, ...).

    @ivar param: the offending field (C{messages[0].content}), if any.
    """

    def __init__(
        self, kind: str, message: str, code: str | None = None, status: int | None = None, param: str | None = None
    ) -> None:
        super().__init__(kind, message, code=code, status=status)
        self.param = param


def invalid(param: str, message: str, code: str | None = None) -> HTTPError:
    """
    A 400 for one field.
    """
    return HTTPError(
        "invalid", f"{param}: {message}" if param else message, code=code or "invalid_request", param=param
    )


def _no_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not a JSON number")


def _unique_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """
    A JSON object whose keys are all different: a body naming one twice
    would be checked and accounted by one value (C{json} keeps the last)
    while a tunnel forwards the caller's bytes, in which a provider may
    read the other.

    @raise ValueError: naming the first key given twice.
    """
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise ValueError(f"duplicate key {key[:100]!r}")
            seen.add(key)
    return obj


def parse_body(data: bytes) -> dict[str, Any]:
    """
    A request body as a checked JSON object.

    @param data: the body bytes (UTF-8, -16 or -32, as C{json.loads} takes).
    @raise HTTPError: C{invalid_json} for anything that is not one JSON
        object, C{invalid_request} for nesting or strings L{check_tree}
        refuses.
    """
    try:
        body = json.loads(data or b"{}", parse_constant=_no_constant, object_pairs_hook=_unique_object)
    except RecursionError:
        raise HTTPError(
            "invalid", f"request body is nested more than {MAX_DEPTH} levels deep", code="invalid_json"
        ) from None
    except ValueError as e:
        raise HTTPError("invalid", f"request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise HTTPError("invalid", "request body must be a JSON object", code="invalid_json")
    check_tree(body)
    return body


def _path(node: Place) -> str:
    parts = []
    while node is not None:
        node, key = node
        parts.append(f"[{key}]" if isinstance(key, int) else f".{key}")
    return "".join(reversed(parts)).lstrip(".")


def check_tree(value: object, max_depth: int = MAX_DEPTH) -> None:
    """
    Walk a parsed JSON value without recursion: refuse nesting deeper than
    C{max_depth}, any string or key that is not encodable as UTF-8, any
    float that is not finite and any integer outside L{INTEGER_RANGE}.

    @raise HTTPError: naming the first offending place.
    """
    # (value, depth, path) where path is a (parent path, key) chain, turned
    # into text only for an error.
    stack: list[tuple[object, int, Place]] = [(value, 1, None)]
    while stack:
        item, depth, path = stack.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item):
                raise invalid(_path(path), "contains a lone surrogate (not encodable as UTF-8)", "invalid_string")
        elif isinstance(item, float):
            if not math.isfinite(item):
                raise invalid(_path(path), "is too large for a JSON number", "invalid_number")
        elif isinstance(item, int):
            if item not in INTEGER_RANGE:
                raise invalid(_path(path), "is an integer outside 64 bits", "invalid_number")
        elif isinstance(item, dict | list):
            if depth > max_depth:
                raise HTTPError(
                    "invalid",
                    f"request body is nested more than {max_depth} levels deep",
                    code="invalid_json",
                    param=_path(path),
                )
            if isinstance(item, dict):
                for key, child in item.items():
                    if _SURROGATE.search(key):
                        raise invalid(_path(path), "a key contains a lone surrogate", "invalid_string")
                    stack.append((child, depth + 1, (path, key)))
            else:
                stack.extend((child, depth + 1, (path, i)) for i, child in enumerate(item))


def string(
    body: dict[str, Any],
    key: str,
    default: str = "",
    required: bool = False,
    max_chars: int | None = MAX_NAME_CHARS,
    param: str | None = None,
) -> str:
    """
    C{body[key]} as a string (C{null} or absent is C{default}).

    @param required: refuse an absent, null or empty value.
    @param max_chars: the longest accepted value (C{None}: no limit).
    """
    param = param or key
    value = body.get(key)
    if value is None or value == "":
        if required:
            raise invalid(param, "is required", "missing_" + key)
        return default
    if not isinstance(value, str):
        raise invalid(param, f"must be a string, not {_json_type(value)}", "invalid_" + key)
    if max_chars is not None and len(value) > max_chars:
        raise invalid(param, f"must be at most {max_chars} characters", "invalid_" + key)
    return value


def boolean(body: dict[str, Any], key: str, default: bool = False, param: str | None = None) -> bool:
    """
    C{body[key]} as C{true}/C{false} (C{null} or absent is C{default}).
    """
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid(param or key, f"must be true or false, not {_json_type(value)}", "invalid_" + key)
    return value


def integer(
    body: dict[str, Any], key: str, default: int | None = None, minimum: int = 0, param: str | None = None
) -> int | None:
    """
    C{body[key]} as an integer of at least C{minimum} (C{null} or absent is
    C{default}). A boolean is not one, though Python counts it an C{int}.
    """
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(param or key, f"must be an integer, not {_json_type(value)}", "invalid_" + key)
    if value < minimum:
        raise invalid(param or key, f"must be at least {minimum}", "invalid_" + key)
    return value


def number(body: dict[str, Any], key: str, low: float, high: float, param: str | None = None) -> float | None:
    """
    C{body[key]} as a number from C{low} to C{high} (C{null} or absent is
    C{None}).
    """
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise invalid(param or key, f"must be a number, not {_json_type(value)}", "invalid_" + key)
    if not low <= value <= high:
        raise invalid(param or key, f"must be from {low:g} to {high:g}", "invalid_" + key)
    return value


def mapping(body: dict[str, Any], key: str, param: str | None = None) -> dict[str, Any]:
    """
    C{body[key]} as an object (C{null} or absent is C{{}}).
    """
    value = body.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise invalid(param or key, f"must be an object, not {_json_type(value)}", "invalid_" + key)
    return value


def _json_type(value: object) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return "null"
