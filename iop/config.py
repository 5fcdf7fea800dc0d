"""
Reading YAML configuration with errors that name the offending key.

Both daemons validate their whole configuration in C{makeService}, before
anything listens or dials, so a mistake stops the daemon at start with a
message such as C{edge.yaml: nodes[0].token: required}.
"""

import math
import sys
import urllib.parse
from collections.abc import Iterable
from typing import Any

import yaml

_MISSING = object()
#: The largest number a float holds (integers beyond it overflow).
_FLOAT_MAX = sys.float_info.max


class ConfigError(ValueError):
    """
    The configuration is invalid. The message names the file and key.
    """


class Section:
    """
    A mapping read from YAML, with the dotted path that led to it, so that
    every error can say exactly which key is wrong.
    """

    def __init__(self, data: object, path: str, source: str) -> None:
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: {path or 'top level'}: must be a mapping, got {type(data).__name__}")
        self.data = data
        self.path = path
        self.source = source

    def key(self, name: str) -> str:
        return f"{self.path}.{name}" if self.path else name

    def error(self, name: str, problem: str) -> ConfigError:
        return ConfigError(f"{self.source}: {self.key(name)}: {problem}")

    def get(self, name: str, kind: type | tuple[type, ...], default: Any = _MISSING) -> Any:
        """
        The value at C{name}, of type C{kind} (a type or tuple of types).
        Without a default the key is required. C{bool} is never taken for
        a number.

        @return: the value as YAML gave it (checked against C{kind}), or
            C{default}: typed by the caller's C{kind}, not here.
        """
        if name not in self.data or self.data[name] is None:
            if default is _MISSING:
                raise self.error(name, "required")
            return default
        value = self.data[name]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if isinstance(value, bool) and bool not in kinds:
            raise self.error(name, f"must be {_names(kinds)}, got {value!r}")
        if not isinstance(value, kinds):
            raise self.error(name, f"must be {_names(kinds)}, got {value!r}")
        return value

    def number(self, name: str, default: Any = _MISSING, minimum: float | None = None, positive: bool = False) -> Any:
        """
        The number at C{name} (an integer or a float), optionally positive
        or at least C{minimum}. An integer past a float's range is refused:
        as seconds it would raise OverflowError where it is used (a timer).
        """
        value = self.get(name, (int, float), default)
        if value is None:
            return value
        if isinstance(value, int) and not -_FLOAT_MAX <= value <= _FLOAT_MAX:
            raise self.error(name, "is too large")
        if positive and value <= 0:
            raise self.error(name, f"must be positive, got {value!r}")
        if minimum is not None and value < minimum:
            raise self.error(name, f"must be at least {minimum}, got {value!r}")
        return value

    def section(self, name: str, default: Any = _MISSING) -> "Section":
        """
        A nested mapping; an absent optional one is empty.
        """
        if default is not _MISSING and (name not in self.data or self.data[name] is None):
            return Section({} if default is None else default, self.key(name), self.source)
        return Section(self.get(name, dict), self.key(name), self.source)

    def sections(self, name: str, default: Any = _MISSING) -> list["Section"]:
        """
        A list of mappings (C{nodes[]}, C{adapters[]}, ...).
        """
        items = self.get(name, list, default)
        if items is None:
            return []
        return [Section(item, f"{self.key(name)}[{i}]", self.source) for i, item in enumerate(items)]

    def unknown(self, known: Iterable[str]) -> None:
        """
        Refuse keys this section does not define (typos must not pass
        silently).
        """
        for name in self.data:
            if name not in known:
                raise self.error(name, f"unknown key (expected one of: {', '.join(sorted(known))})")


def _names(kinds: tuple[type, ...]) -> str:
    names = {
        int: "an integer",
        float: "a number",
        str: "a string",
        bool: "true or false",
        dict: "a mapping",
        list: "a list",
    }
    return " or ".join(names.get(k, k.__name__) for k in kinds)


def load_yaml(path: str) -> Section:
    """
    Parse a YAML file into a top-level L{Section}.

    @raise ConfigError: if the file cannot be read or parsed.
    """
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    place = _non_finite(data)
    if place is not None:
        raise ConfigError(f"{path}: {place}: must be a finite number (YAML's .nan and .inf are not)")
    return Section({} if data is None else data, "", path)


def _non_finite(data: object) -> str | None:
    """
    The dotted key of the first C{.nan} or C{.inf} in a parsed YAML tree
    (anywhere: adapter options are read long after loading, and a NaN
    passes every C{<} check and makes a timer's time meaningless), or
    C{None}.
    """
    stack: list[tuple[object, str]] = [(data, "")]
    while stack:
        value, place = stack.pop()
        if isinstance(value, float) and not math.isfinite(value):
            return place or "top level"
        if isinstance(value, dict):
            stack.extend((child, f"{place}.{key}" if place else str(key)) for key, child in value.items())
        elif isinstance(value, list):
            stack.extend((child, f"{place}[{i}]") for i, child in enumerate(value))
    return None


def http_url_problem(value: object) -> str | None:
    """
    What is wrong with C{value} as the address of an HTTP back end
    (C{http://host[:port][/path]}), or C{None} when nothing is.
    """
    if not isinstance(value, str):
        return f"must be a string, got {type(value).__name__}"
    try:
        parts = urllib.parse.urlsplit(value)
        port = parts.port
    except ValueError as e:
        return f"is not a URL ({e}): {value!r}"
    if parts.scheme not in ("http", "https"):
        return f"must start with http:// or https://: {value!r}"
    if not parts.hostname or any(c.isspace() for c in value):
        return f"must name a host, as in http://127.0.0.1:8000/v1: {value!r}"
    if port == 0:
        return f"has port 0: {value!r}"
    return None
