"""
Caller, admin and metrics keys (C{api_keys}, C{admin_keys}, C{metrics_key}
in C{edge.yaml}), and what each caller key may spend.

A key is configured as itself (C{"sk-..."}) or as its SHA-256 (C{{sha256:
<64 hex digits>}}, e.g. C{printf %s "$KEY" | sha256sum}), like node tokens,
so C{edge.yaml} need not hold it. Presented keys are hashed and compared
in constant time against every configured digest; keys are never logged
(a key is named by its C{name}, or by the first 8 hex digits of its
digest).

A key entry may carry its own limits: C{max_concurrent} requests that
run work (chat completions, completions, embeddings, responses, runs,
node commands) in progress at once — a background run counts until it
ends, not only until its 202, and reading or cancelling runs is never
held up by it — and C{requests_per_minute} (a token bucket: that many at once,
refilled evenly over a minute). Over either, a request is refused
with 429 and C{Retry-After} (L{RateLimited}). README, "Security".

A key is also a tenant (L{iop.edge.tenants}): its C{weight} and
C{priority} order its waiting work against other keys', and
C{tokens_per_minute} / C{tokens_per_day} budget its tokens
(docs/edge.md, "Tenants").
"""

import hashlib
import hmac
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from twisted.python.runtime import seconds as wall_seconds

from iop.config import Section
from iop.edge.errors import ServiceError
from iop.edge.tenants import ANONYMOUS, Tenant


@dataclass(frozen=True)
class KeySpec:
    """
    One configured key: its SHA-256 digest, a name to show for it, and its
    limits (C{None}: unlimited).
    """

    digest: bytes
    name: str
    max_concurrent: int | None = None
    requests_per_minute: int | None = None
    #: Its share of a busy queue, relative to other keys' (default 1).
    weight: float = 1.0
    #: The class its waiting work is served in (higher first; default 0).
    priority: int = 0
    tokens_per_minute: int | None = None
    tokens_per_day: int | None = None

    def tenant(self) -> Tenant:
        """
        This key as the queues and token budgets see it.
        """
        return Tenant(self.name, self.weight, self.priority, self.tokens_per_minute, self.tokens_per_day)

    @classmethod
    def plain(cls, key: str) -> "KeySpec":
        digest = key_digest(key)
        return cls(digest=digest, name=_default_name(digest))


def key_digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def _default_name(digest: bytes) -> str:
    return "key-" + digest.hex()[:8]


def find(specs: Iterable[KeySpec], presented: str | None) -> KeySpec | None:
    """
    The spec among C{specs} whose digest matches the presented key,
    compared in constant time against every one.
    """
    if presented is None:
        return None
    digest = key_digest(presented)
    found = None
    for spec in specs:
        if hmac.compare_digest(digest, spec.digest):
            found = spec
    return found


# -- edge.yaml


def _entry(section: Section, where: str, value: object) -> KeySpec:
    if isinstance(value, str):
        if not value:
            raise section.error(where, "must be a non-empty string")
        return KeySpec.plain(value)
    if not isinstance(value, dict):
        raise section.error(where, "must be a key string or a mapping with key or sha256")
    entry = Section(value, section.key(where), section.source)
    entry.unknown(
        {
            "key",
            "sha256",
            "name",
            "max_concurrent",
            "requests_per_minute",
            "weight",
            "priority",
            "tokens_per_minute",
            "tokens_per_day",
        }
    )
    has_plain, has_hash = "key" in value, "sha256" in value
    if has_plain == has_hash:
        raise entry.error("key", "exactly one of key or sha256 is required")
    if has_plain:
        plain = entry.get("key", str)
        if not plain:
            raise entry.error("key", "must be a non-empty string")
        digest = key_digest(plain)
    else:
        try:
            digest = bytes.fromhex(entry.get("sha256", str))
        except ValueError:
            digest = b""
        if len(digest) != 32:
            raise entry.error("sha256", "must be 64 hexadecimal digits")
    limits: dict[str, int | None] = {}
    for name in ("max_concurrent", "requests_per_minute", "tokens_per_minute", "tokens_per_day"):
        limit = entry.get(name, int, None)
        if limit is not None and limit < 1:
            raise entry.error(name, f"must be at least 1, got {limit!r}")
        limits[name] = limit
    weight = entry.number("weight", 1.0, positive=True)
    priority = entry.get("priority", int, 0)
    owner = entry.get("name", str, _default_name(digest))
    if not owner or owner == ANONYMOUS:
        # The name owns runs and sessions: "anonymous" is the owner of
        # work done without a key, which no key may see as its own.
        raise entry.error("name", f"must be a non-empty name other than {ANONYMOUS!r}")
    return KeySpec(
        digest=digest,
        name=owner,
        weight=weight,
        priority=priority,
        **limits,
    )


def parse_keys(section: Section, name: str) -> tuple[KeySpec, ...]:
    """
    A list of keys (C{api_keys}, C{admin_keys}); absent is empty.

    @return: a tuple of L{KeySpec}.
    @raise ConfigError: naming the entry of a bad or duplicate key.
    """
    values = section.get(name, list, [])
    specs = tuple(_entry(section, f"{name}[{i}]", value) for i, value in enumerate(values))
    seen: set[bytes] = set()
    owners: dict[str, tuple[int, Tenant]] = {}
    for i, spec in enumerate(specs):
        if spec.digest in seen:
            raise section.error(f"{name}[{i}]", "duplicate key (not shown)")
        seen.add(spec.digest)
        # Entries of one name are one owner (a key and its replacement):
        # one share of the queues and one set of budgets, which two
        # different settings would reset each time the other key is used.
        first, tenant = owners.setdefault(spec.name, (i, spec.tenant()))
        if tenant != spec.tenant():
            field = next(f for f in _OWNER_FIELDS if getattr(tenant, f) != getattr(spec.tenant(), f))
            raise section.error(
                f"{name}[{i}].{field}",
                f"differs from {name}[{first}], which has the same name {spec.name!r}: "
                "entries with one name are one owner and must agree on " + ", ".join(_OWNER_FIELDS),
            )
    return specs


#: What entries of one name must agree on (what their owner shares).
_OWNER_FIELDS = ("weight", "priority", "tokens_per_minute", "tokens_per_day")


def parse_key(section: Section, name: str) -> KeySpec | None:
    """
    One optional key (C{metrics_key}). @return: a L{KeySpec} or C{None}.
    """
    value = section.data.get(name)
    return None if value is None else _entry(section, name, value)


# -- limits


class RateLimited(ServiceError):
    """
    A key over one of its limits: HTTP 429 with C{Retry-After}.

    @ivar retry_after: seconds until a retry may succeed.
    """

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__("busy", message, code="key_rate_limited")
        self.retry_after = retry_after


class Release(Protocol):
    """
    Ends what L{KeyLimiter.admit} counted: called with no argument, or
    with a Deferred's result (which it ignores).
    """

    def __call__(self, _: object = None, /) -> None: ...


def _nothing(_: object = None) -> None:
    return None


class KeyLimiter:
    """
    What each key is spending: requests in progress and a per-minute token
    bucket, by digest.

    @param seconds: a clock, C{seconds() -> float}.
    """

    def __init__(self, seconds: Callable[[], float] = wall_seconds) -> None:
        self.seconds = seconds
        self.in_progress: dict[bytes, int] = {}
        self._buckets: dict[bytes, tuple[float, float]] = {}

    def admit(self, spec: KeySpec, concurrent: bool = True, per_minute: bool = True) -> Release:
        """
        Count one request of C{spec}: against C{requests_per_minute} unless
        C{per_minute} is false (another Edge counted it so), and unless
        C{concurrent} is false (a request that runs no work) against
        C{max_concurrent} until it ends.

        @return: a callable that ends it (idempotent). It takes any one
            argument and returns C{None}, so it can end a Deferred's chain
            (a request's C{notifyFinish}, which fails when the caller
            disconnects) without passing a failure on to be logged as
            unhandled.
        @raise RateLimited: if the key is over a limit (nothing counted).
        """
        busy = self.in_progress.get(spec.digest, 0)
        if concurrent and spec.max_concurrent is not None and busy >= spec.max_concurrent:
            raise RateLimited(
                f"API key {spec.name} already has {busy} requests in progress (max_concurrent {spec.max_concurrent})",
                retry_after=1,
            )
        if per_minute and spec.requests_per_minute is not None:
            self._take_token(spec)
        if not concurrent:
            return _nothing
        self.in_progress[spec.digest] = busy + 1
        done: list[bool] = []

        def release(_: object = None) -> None:
            if not done:
                done.append(True)
                left = self.in_progress[spec.digest] - 1
                if left:
                    self.in_progress[spec.digest] = left
                else:
                    del self.in_progress[spec.digest]

        return release

    def _take_token(self, spec: KeySpec) -> None:
        assert spec.requests_per_minute is not None
        rate = spec.requests_per_minute / 60.0
        now = self.seconds()
        tokens, last = self._buckets.get(spec.digest, (float(spec.requests_per_minute), now))
        # (A wall clock set back refills nothing, and takes nothing.)
        tokens = min(float(spec.requests_per_minute), tokens + max(0.0, now - last) * rate)
        if tokens < 1:
            self._buckets[spec.digest] = (tokens, now)
            raise RateLimited(
                f"API key {spec.name} is over {spec.requests_per_minute} requests per minute",
                retry_after=max(1, math.ceil((1 - tokens) / rate)),
            )
        self._buckets[spec.digest] = (tokens - 1, now)
