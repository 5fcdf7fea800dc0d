"""
The Edge's limits on what strangers can make it spend: C{edge.yaml}'s
C{limits:} section (README, "Security"; docs/wire.md, "Before
registration").

Every value has a default, so an C{edge.yaml} without the section gets
the documented limits.
"""

from dataclasses import dataclass

from iop.config import Section
from iop.edge.tenants import TOKEN_ESTIMATE
from iop.protocols.wire import MAX_FRAME_BYTES

#: Defaults, also documented in the README.
PREAUTH_FRAME_BYTES = 64 * 1024
MAX_UNREGISTERED_CONNECTIONS = 256
HEADER_TIMEOUT_SEC = 10.0
BODY_TIMEOUT_SEC = 60.0
MAX_HTTP_CONNECTIONS = 10000
MAX_BODY_BYTES = 8 * 1024 * 1024
MAX_WAITING = 10000
MAX_HTTP_CONNECTIONS_PER_ADDRESS = 256
MAX_UNREGISTERED_PER_ADDRESS = 32


@dataclass(frozen=True)
class Limits:
    """
    @ivar preauth_frame_bytes: the largest frame a Node connection may
        send before its registration is accepted; a larger length prefix
        closes the connection before its body is read.
    @ivar max_unregistered_connections: how many Node connections may be
        open at once without an accepted registration (being read, or
        waiting in an address's line); beyond it a new one waits unread in
        the hall (at most four times as many; beyond that it is closed at
        once) until a place is free or its registration deadline passes
        (L{iop.edge.nodeport}).
    @ivar max_unregistered_per_address: unregistered Node connections one
        source address may have being read at once; its others wait
        unread in its line without taking places from other addresses.
        0 turns it off (Nodes dialling through one proxy or NAT address).
    @ivar header_timeout_sec: an HTTP request's headers must be complete
        this long after the connection opened or its previous response
        ended, however slowly bytes trickle in.
    @ivar body_timeout_sec: an HTTP request's body must be complete this
        long after its headers.
    @ivar max_http_connections: open HTTP connections at once; beyond it a
        new one is closed at once.
    @ivar max_body_bytes: the largest request body; a larger
        C{Content-Length} is answered 413 before the body is read.
    @ivar max_waiting: requests waiting for capacity at once (in all
        queues together); beyond it a new one is answered 503
        C{overloaded} at once, so a flood costs the Edge a bounded amount.
    @ivar token_estimate: the answer tokens a request that names no
        C{max_tokens} is expected to cost (fair share and token budgets;
        docs/edge.md, "Tenants").
    @ivar max_http_connections_per_address: HTTP connections one source
        address may have being read at once; its others wait unread in
        its line (as many again at most) until their header deadline,
        without taking places from other addresses (L{iop.edge.doors}).
        0 turns it off (every caller behind one load balancer).
    """

    preauth_frame_bytes: int = PREAUTH_FRAME_BYTES
    max_unregistered_connections: int = MAX_UNREGISTERED_CONNECTIONS
    max_unregistered_per_address: int = MAX_UNREGISTERED_PER_ADDRESS
    header_timeout_sec: float = HEADER_TIMEOUT_SEC
    body_timeout_sec: float = BODY_TIMEOUT_SEC
    max_http_connections: int = MAX_HTTP_CONNECTIONS
    max_body_bytes: int = MAX_BODY_BYTES
    max_waiting: int = MAX_WAITING
    token_estimate: int = TOKEN_ESTIMATE
    max_http_connections_per_address: int = MAX_HTTP_CONNECTIONS_PER_ADDRESS


def parse_limits(section: Section) -> Limits:
    """
    Read C{limits:} (a L{iop.config.Section}; empty when absent).

    @raise ConfigError: naming the key of a bad value.
    """
    section.unknown(
        {
            "preauth_frame_bytes",
            "max_unregistered_connections",
            "max_unregistered_per_address",
            "header_timeout_sec",
            "body_timeout_sec",
            "max_http_connections",
            "max_body_bytes",
            "max_waiting",
            "token_estimate",
            "max_http_connections_per_address",
        }
    )
    preauth = _count(section, "preauth_frame_bytes", PREAUTH_FRAME_BYTES, minimum=1024, maximum=MAX_FRAME_BYTES)
    return Limits(
        preauth_frame_bytes=preauth,
        max_unregistered_connections=_count(section, "max_unregistered_connections", MAX_UNREGISTERED_CONNECTIONS),
        max_unregistered_per_address=_count(
            section, "max_unregistered_per_address", MAX_UNREGISTERED_PER_ADDRESS, minimum=0
        ),
        header_timeout_sec=section.number("header_timeout_sec", HEADER_TIMEOUT_SEC, positive=True),
        body_timeout_sec=section.number("body_timeout_sec", BODY_TIMEOUT_SEC, positive=True),
        max_http_connections=_count(section, "max_http_connections", MAX_HTTP_CONNECTIONS),
        # A body must fit in one frame to the Node, with room for the rest.
        max_body_bytes=_count(section, "max_body_bytes", MAX_BODY_BYTES, minimum=1024, maximum=MAX_FRAME_BYTES // 2),
        max_waiting=_count(section, "max_waiting", MAX_WAITING),
        token_estimate=_count(section, "token_estimate", TOKEN_ESTIMATE, minimum=0),
        max_http_connections_per_address=_count(
            section, "max_http_connections_per_address", MAX_HTTP_CONNECTIONS_PER_ADDRESS, minimum=0
        ),
    )


def _count(section: Section, name: str, default: int, minimum: int = 1, maximum: int | None = None) -> int:
    value = section.get(name, int, default)
    if value < minimum:
        raise section.error(name, f"must be at least {minimum}, got {value!r}")
    if maximum is not None and value > maximum:
        raise section.error(name, f"must be at most {maximum}, got {value!r}")
    return value
