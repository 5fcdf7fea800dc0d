"""
Relaying HTTP headers from one hop to the next, shared by the Node (to and
from a provider) and the Edge (to its caller).
"""

#: Headers that describe one hop, not the message (RFC 9110 section 7.6.1);
#: a relay must not forward them.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
    }
)


def relay_headers(pairs, extra_drop=()):
    """
    C{pairs} without hop-by-hop headers, including those the
    C{Connection} header names.
    """
    drop = set(HOP_BY_HOP) | {name.lower() for name in extra_drop}
    for name, value in pairs:
        if name.lower() == "connection":
            drop.update(token.strip().lower() for token in value.split(","))
    return [(name, value) for name, value in pairs if name.lower() not in drop]
