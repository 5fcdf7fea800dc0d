"""
Reading Twisted endpoint strings (C{tcp:7122:interface=127.0.0.1}) the way
Twisted does, to check what they would bind to before anything listens.

Twisted's own parser is private and keeps only the last of repeated
keys, so C{tcp:7999:interface=127.0.0.1:interface=0.0.0.0} binds every
interface; a substring test for "127.0.0.1" cannot see that.
L{split_endpoint} follows the same grammar (C{:} between fields, the first
unescaped C{=} of a field splits key from value, C{\\} escapes the next
character) and returns every field, repeats included.
"""

import ipaddress


class EndpointError(ValueError):
    """
    An endpoint string that cannot be used where it was given.
    """


def split_endpoint(description: str) -> tuple[list[str], list[tuple[str, str]]]:
    """
    @return: C{(positional, keywords)}: the fields without C{=} in order,
        and every C{(key, value)} pair in order (repeats kept).
    @raise EndpointError: for a trailing backslash.
    """
    fields: list[tuple[str | None, str]] = []
    current: list[str] = []
    key: str | None = None
    chars = iter(description)
    for c in chars:
        if c == "\\":
            try:
                current.append(next(chars))
            except StopIteration:
                raise EndpointError("ends with a lone backslash") from None
        elif c == ":":
            fields.append((key, "".join(current)))
            current, key = [], None
        elif c == "=" and key is None:
            key, current = "".join(current), []
        else:
            current.append(c)
    fields.append((key, "".join(current)))
    positional = [value for key, value in fields if key is None]
    keywords = [(key, value) for key, value in fields if key is not None]
    return positional, keywords


#: Server endpoint types whose interface can be checked, and how many
#: positional fields (type and port) they may have before an interface
#: would be read from a position.
_LISTENING_TYPES = {"tcp": 2, "tcp6": 2, "ssl": 2}


def loopback_interface(description: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """
    The interface a server endpoint string binds, required to be a
    loopback address literal.

    @return: the parsed L{ipaddress} address.
    @raise EndpointError: unless the string is C{tcp}, C{tcp6} or C{ssl}
        with exactly one C{interface=} that is a loopback IP address (and
        no interface given by position).
    """
    positional, keywords = split_endpoint(description)
    kind = positional[0] if positional else ""
    if kind not in _LISTENING_TYPES:
        raise EndpointError(f"must be a tcp:, tcp6: or ssl: endpoint, not {kind or description!r}")
    if len(positional) != _LISTENING_TYPES[kind]:
        raise EndpointError("give the port by position and everything else as key=value (interface=127.0.0.1)")
    interfaces = [value for key, value in keywords if key == "interface"]
    if len(interfaces) != 1:
        raise EndpointError(f"needs exactly one interface= (found {len(interfaces)})")
    try:
        address = ipaddress.ip_address(interfaces[0])
    except ValueError:
        raise EndpointError(
            f"interface {interfaces[0]!r} is not an IP address literal (use 127.0.0.1 or ::1)"
        ) from None
    if not address.is_loopback:
        raise EndpointError(f"interface {address} is not a loopback address (use 127.0.0.1 or ::1)")
    return address
