"""
Reading C{node.yaml}.

Everything is validated before the Node dials, so a mistake stops the
daemon at start with a message naming the key (C{node.yaml:
reconnect.interval_sec: ...}) instead of surfacing as odd retry behaviour.
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from iop.config import ConfigError, Section, load_yaml
from iop.logs import parse_log_format
from iop.node.store import Retention

DEFAULT_STORE = "file:iop.db?cache=shared&mode=rwc"
DEFAULT_MAX_ATTEMPTS = 10
DEFAULT_INTERVAL_SEC = 10.0
DEFAULT_JITTER = 0.5
DEFAULT_REGISTER_TIMEOUT_SEC = 10.0
#: Generous: starting an adapter may probe its back end over the network.
DEFAULT_CONFIGURE_TIMEOUT_SEC = 60.0
DEFAULT_SHUTDOWN_GRACE_SEC = 30.0

_TOP_KEYS = {
    "edge",
    "token",
    "store",
    "reconnect",
    "register_timeout_sec",
    "configure_timeout_sec",
    "shutdown_grace_sec",
    "metrics",
    "log_format",
}
_RECONNECT_KEYS = {"max_attempts", "interval_sec", "jitter"}
_STORE_KEYS = {"path", "retention"}
_RETENTION_KEYS = {"max_age_days", "max_rows"}


@dataclass(frozen=True)
class ReconnectPolicy:
    """
    How the supervisor retries the Edge.

    @ivar max_attempts: consecutive failed attempts before giving up;
        C{0} means never give up.
    @ivar interval_sec: the pause between attempts, on average.
    @ivar jitter: how far each pause may be from C{interval_sec}, as a
        fraction of it (the pause is drawn uniformly from
        C{interval_sec * (1 - jitter)} to C{interval_sec * (1 + jitter)}),
        so Nodes that lost the same Edge at the same moment do not all
        dial again in the same instant; 0 for a fixed interval.
    """

    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    interval_sec: float = DEFAULT_INTERVAL_SEC
    jitter: float = DEFAULT_JITTER

    def delay(self, draw: Callable[[float, float], float]) -> float:
        """
        The pause before the next attempt, drawn with C{draw(low, high)}
        (C{random.Random.uniform}, or a fixed draw in tests).
        """
        if not self.jitter:
            return self.interval_sec
        return draw(self.interval_sec * (1 - self.jitter), self.interval_sec * (1 + self.jitter))

    @property
    def unlimited(self) -> bool:
        return self.max_attempts == 0

    def exhausted(self, failures: int) -> bool:
        """
        Whether C{failures} consecutive failed attempts end the process.
        """
        return not self.unlimited and failures >= self.max_attempts


@dataclass(frozen=True)
class NodeConfig:
    """
    A validated C{node.yaml}.

    @ivar edge: a Twisted client endpoint string for the Edge (the first,
        when C{node.yaml} lists several).
    @ivar token: the Node's credential. Never logged.
    @ivar store: the run store's SQLite path or C{file:} URI.
    @ivar retention: how long the run store keeps finished work.
    @ivar configure_timeout_sec: how long an accepted registration may
        take to start its adapters before the attempt is given up (and
        retried).
    @ivar shutdown_grace_sec: how long a local shutdown lets work in flight
        finish before cancelling it (0: cancel at once).
    @ivar metrics: a Twisted server endpoint string for C{/metrics}, or
        C{None} when metrics are not served.
    @ivar log_format: C{text} (twistd's lines) or C{json} (one JSON object
        per line).
    """

    edge: str
    token: str = field(repr=False)
    #: Every Edge endpoint, in the order they are tried (an Edge cluster);
    #: C{edge} is the first.
    edges: tuple[str, ...] = ()
    store: str = DEFAULT_STORE
    retention: Retention = Retention()
    reconnect: ReconnectPolicy = ReconnectPolicy()
    register_timeout_sec: float = DEFAULT_REGISTER_TIMEOUT_SEC
    configure_timeout_sec: float = DEFAULT_CONFIGURE_TIMEOUT_SEC
    shutdown_grace_sec: float = DEFAULT_SHUTDOWN_GRACE_SEC
    metrics: str | None = None
    log_format: str = "text"


def parse_reconnect(section: Section) -> ReconnectPolicy:
    """
    Read the C{reconnect} section.

    Omitted C{max_attempts} is 10, C{0} is unlimited, a positive number is
    that many consecutive failures. Unlimited retrying with a non-positive
    interval would spin, so it is refused.
    """
    section.unknown(_RECONNECT_KEYS)
    max_attempts = section.get("max_attempts", int, DEFAULT_MAX_ATTEMPTS)
    if max_attempts < 0:
        raise section.error("max_attempts", f"must be 0 (unlimited) or a positive integer, got {max_attempts!r}")
    interval = section.number("interval_sec", DEFAULT_INTERVAL_SEC)
    if max_attempts == 0 and interval <= 0:
        raise section.error("interval_sec", f"must be positive when max_attempts is 0 (unlimited), got {interval!r}")
    if interval < 0:
        raise section.error("interval_sec", f"must not be negative, got {interval!r}")
    return ReconnectPolicy(max_attempts=max_attempts, interval_sec=float(interval), jitter=_jitter(section))


def _jitter(section: Section) -> float:
    """
    C{reconnect.jitter}: C{true} (the default, L{DEFAULT_JITTER}), C{false}
    (a fixed interval), or the fraction itself, from 0 to 1.
    """
    value = section.get("jitter", (bool, int, float), True)
    if isinstance(value, bool):
        return DEFAULT_JITTER if value else 0.0
    if 0 <= value <= 1:
        return float(value)
    raise section.error("jitter", f"must be true, false or a fraction from 0 to 1, got {value!r}")


def parse_store(top: Section) -> tuple[str, Retention]:
    """
    Read C{store}: a path (or C{file:} URI), or a mapping with C{path} and
    C{retention} (C{max_age_days}, C{max_rows}; C{null} lifts a limit).

    @return: C{(path, Retention)}.
    """
    if not isinstance(top.data.get("store"), dict):
        return _nonempty(top, "store", DEFAULT_STORE), Retention()
    section = top.section("store")
    section.unknown(_STORE_KEYS)
    path = _nonempty(section, "path", DEFAULT_STORE)
    retention = section.section("retention", None)
    retention.unknown(_RETENTION_KEYS)
    default = Retention()
    limits: dict[str, Any] = {}
    for name in ("max_age_days", "max_rows"):
        if name in retention.data and retention.data[name] is None:
            limits[name] = None
            continue
        if name == "max_age_days":
            # A number of days (a float's range: it becomes a time cutoff).
            value = retention.number(name, default.max_age_days)
        else:
            value = retention.get(name, int, default.max_rows)
        if value is not None and value <= 0:
            raise retention.error(name, f"must be positive (or null for no limit), got {value!r}")
        limits[name] = value
    return path, Retention(**limits)


def parse_config(top: Section) -> NodeConfig:
    """
    Validate a top-level L{Section} into a L{NodeConfig}.

    @raise ConfigError: naming the offending key.
    """
    top.unknown(_TOP_KEYS)
    edges = _edges(top)
    token = _secret(top, "token")
    store, retention = parse_store(top)
    reconnect = parse_reconnect(top.section("reconnect", None))
    register_timeout = top.number("register_timeout_sec", DEFAULT_REGISTER_TIMEOUT_SEC, positive=True)
    configure_timeout = top.number("configure_timeout_sec", DEFAULT_CONFIGURE_TIMEOUT_SEC, positive=True)
    shutdown_grace = top.number("shutdown_grace_sec", DEFAULT_SHUTDOWN_GRACE_SEC, minimum=0)
    metrics = top.get("metrics", str, None)
    if metrics is not None and not metrics.strip():
        raise top.error("metrics", "must be a server endpoint string (or null to disable)")
    return NodeConfig(
        edge=edges[0],
        edges=edges,
        token=token,
        store=store,
        retention=retention,
        reconnect=reconnect,
        register_timeout_sec=float(register_timeout),
        configure_timeout_sec=float(configure_timeout),
        shutdown_grace_sec=float(shutdown_grace),
        metrics=metrics,
        log_format=parse_log_format(top),
    )


def load_config(path: str) -> NodeConfig:
    """
    Read and validate C{node.yaml} at C{path}.

    @raise ConfigError: if the file is unreadable or any key is wrong.
    """
    return parse_config(load_yaml(path))


def _edges(section: Section) -> tuple[str, ...]:
    """
    C{edge}: one endpoint string, or a list of them (the Edges of a
    cluster, tried in turn).
    """
    value = section.get("edge", (str, list))
    if isinstance(value, str):
        return (_nonempty(section, "edge"),)
    if not value:
        raise section.error("edge", "must list at least one Edge endpoint")
    for i, item in enumerate(value):
        if not isinstance(item, str) or not item.strip():
            raise section.error(f"edge[{i}]", "must be a non-empty client endpoint string")
    if len(set(value)) != len(value):
        raise section.error("edge", "lists the same endpoint twice")
    return tuple(value)


def _nonempty(section: Section, name: str, default: str | None = None) -> str:
    if default is None:
        value = section.get(name, str)
    else:
        value = section.get(name, str, default)
    if not value.strip():
        raise section.error(name, "must not be empty")
    return value


def _secret(section: Section, name: str) -> str:

    # Like _nonempty, but an error never echoes the value.
    value = section.data.get(name)
    if value is None:
        raise section.error(name, "required")
    if not isinstance(value, str) or not value.strip():
        raise section.error(name, "must be a non-empty string")
    return value


__all__ = ["ConfigError", "NodeConfig", "ReconnectPolicy", "Section", "load_config", "parse_config"]
