"""
Relaying HTTP headers from one hop to the next, shared by the Edge (from
its caller, and back to it) and the Node (to and from a provider).

The rule, in one place:

  - **Request** (caller → Edge → Node → provider): every end-to-end header
    the caller sent goes to the provider, except hop-by-hop headers (and
    those C{Connection} names), C{Host}, C{Content-Length} (the HTTP client
    recomputes it), the caller's C{Authorization} (it was for the Edge: the
    adapter's C{api_key}, if any, replaces it) and the adapter's
    C{drop_headers}; the adapter's C{headers} come last and replace
    same-named caller headers. See L{caller_request_headers} (the Edge's
    part) and L{provider_request_headers} (the Node's).
  - **Response** (provider → Node → Edge → caller): exactly the headers
    the provider sent, minus hop-by-hop ones; none is added (the Edge's own
    C{Server}/C{Date} are removed when the provider sent none). See
    L{relay_headers}.
"""

from collections.abc import Iterable, Sequence

from twisted.web.http_headers import Headers

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

#: Request headers the Edge keeps to itself: they describe its own hop, or
#: are the caller's credentials for the Edge.
_EDGE_REQUEST_DROP = ("host", "content-length", "authorization")

#: Headers as the functions below take them: C{(name, value)} text pairs.
HeaderPairs = list[tuple[str, str]]


def header_pairs(headers: Headers) -> HeaderPairs:
    """
    A C{twisted.web} L{Headers<twisted.web.http_headers.Headers>} as
    C{[(name, value)]} text pairs, one per value, in order: the form the
    functions below take.
    """
    return [
        (name.decode("latin-1"), value.decode("latin-1"))
        for name, values in headers.getAllRawHeaders()
        for value in values
    ]


def relay_headers(pairs: Sequence[tuple[str, str]], extra_drop: Iterable[str] = ()) -> HeaderPairs:
    """
    C{pairs} without hop-by-hop headers, including those the
    C{Connection} header names, and without C{extra_drop}.
    """
    drop = set(HOP_BY_HOP) | {name.lower() for name in extra_drop}
    for name, value in pairs:
        if name.lower() == "connection":
            drop.update(token.strip().lower() for token in value.split(","))
    return [(name, value) for name, value in pairs if name.lower() not in drop]


def caller_request_headers(pairs: Sequence[tuple[str, str]]) -> HeaderPairs:
    """
    The caller's request headers that travel on to the provider (the
    Edge's half of the request rule).
    """
    return relay_headers(pairs, _EDGE_REQUEST_DROP)


def provider_request_headers(
    pairs: Sequence[tuple[str, str]], adapter_headers: Sequence[tuple[str, str]], drop_headers: Iterable[str] = ()
) -> HeaderPairs:
    """
    The headers a provider gets (the Node's half of the request rule):
    C{pairs} from the Edge minus hop-by-hop, C{Host}, C{Content-Length},
    any C{Authorization} and C{drop_headers}, then C{adapter_headers}
    (configured headers and the C{api_key} bearer), which replace
    same-named ones.
    """
    own = {name.lower() for name, _ in adapter_headers}
    kept = relay_headers(pairs, (*_EDGE_REQUEST_DROP, *drop_headers, *own))
    return kept + list(adapter_headers)
