"""
SSH keys of the operator console: the users' authorized public keys (read
when C{edge.yaml} is loaded, so a bad key stops the Edge naming it) and
the console's host key, generated on first start with mode 0600 in a
0700 directory, through public APIs only (C{cryptography} and
C{twisted.conch.ssh.keys}).
"""

import os
import stat
from typing import TYPE_CHECKING

from twisted.logger import Logger

if TYPE_CHECKING:
    from twisted.conch.ssh import keys

log = Logger()


class BadKey(ValueError):
    """
    A key that cannot be used; the message says why.
    """


def parse_public_key(line: str) -> bytes:
    """
    One OpenSSH public key line (C{ssh-ed25519 AAAA... comment}).

    @return: the key as C{bytes} in OpenSSH form, without the comment.
    @raise BadKey: if it is not a public key.
    """
    from twisted.conch.ssh import keys

    try:
        key = keys.Key.fromString(line.strip().encode("utf-8"))
    except Exception as e:
        raise BadKey(f"not an SSH public key ({e.__class__.__name__})") from None
    if not key.isPublic():
        raise BadKey("is a private key: give the public key (the .pub file)")
    return key.toString("openssh")


def read_authorized_keys(path: str) -> tuple[bytes, ...]:
    """
    The keys of an OpenSSH C{authorized_keys} file (blank lines and C{#}
    comments skipped; key options are not supported).

    @return: a tuple of keys as in L{parse_public_key}.
    @raise BadKey: naming the file and line of the first bad key, or if
        the file cannot be read or holds no key.
    """
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise BadKey(f"cannot read {path}: {getattr(e, 'strerror', None) or e}") from None
    found: list[bytes] = []
    for number, line in enumerate(lines, 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            found.append(parse_public_key(line))
        except BadKey as e:
            raise BadKey(f"{path} line {number}: {e}") from None
    if not found:
        raise BadKey(f"{path} holds no key")
    return tuple(found)


def host_key(path: str) -> "keys.Key":
    """
    The console's SSH host key at C{path}: generated (Ed25519) on first
    use with mode 0600 in a directory created 0700; an existing key file
    that others could read is made 0600, with a warning.

    @return: a private C{twisted.conch.ssh.keys.Key}.
    """
    from cryptography.hazmat.primitives.asymmetric import ed25519
    from twisted.conch.ssh import keys

    directory = os.path.dirname(path)
    if directory:
        os.makedirs(directory, mode=0o700, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        mode = stat.S_IMODE(os.stat(path).st_mode)
        if mode & 0o077:
            os.chmod(path, 0o600)
            log.warn(
                "the console's host key {path} was readable by others (mode {mode:o}); it is now 0600:"
                " consider replacing it",
                path=path,
                mode=mode,
            )
        return keys.Key.fromFile(path)
    key = keys.Key(ed25519.Ed25519PrivateKey.generate())
    with os.fdopen(fd, "wb") as f:
        f.write(key.toString("openssh"))
    return key
