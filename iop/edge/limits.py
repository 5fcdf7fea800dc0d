"""
The Edge's limits on what strangers can make it spend: C{edge.yaml}'s
C{limits:} section (README, "Security"; docs/wire.md, "Before
registration").

Every value has a default, so an C{edge.yaml} without the section gets
the documented limits.
"""

from dataclasses import dataclass

from iop.protocols.wire import MAX_FRAME_BYTES

#: Defaults, also documented in the README.
PREAUTH_FRAME_BYTES = 64 * 1024
MAX_UNREGISTERED_CONNECTIONS = 256


@dataclass(frozen=True)
class Limits:
    """
    @ivar preauth_frame_bytes: the largest frame a Node connection may
        send before its registration is accepted; a larger length prefix
        closes the connection before its body is read.
    @ivar max_unregistered_connections: how many Node connections may be
        open at once without an accepted registration; beyond it a new one
        is closed at once.
    """

    preauth_frame_bytes: int = PREAUTH_FRAME_BYTES
    max_unregistered_connections: int = MAX_UNREGISTERED_CONNECTIONS


def parse_limits(section):
    """
    Read C{limits:} (a L{iop.config.Section}; empty when absent).

    @raise ConfigError: naming the key of a bad value.
    """
    section.unknown({"preauth_frame_bytes", "max_unregistered_connections"})
    preauth = _count(section, "preauth_frame_bytes", PREAUTH_FRAME_BYTES, minimum=1024, maximum=MAX_FRAME_BYTES)
    return Limits(
        preauth_frame_bytes=preauth,
        max_unregistered_connections=_count(section, "max_unregistered_connections", MAX_UNREGISTERED_CONNECTIONS),
    )


def _count(section, name, default, minimum=1, maximum=None):
    value = section.get(name, int, default)
    if value < minimum:
        raise section.error(name, f"must be at least {minimum}, got {value!r}")
    if maximum is not None and value > maximum:
        raise section.error(name, f"must be at most {maximum}, got {value!r}")
    return value
