"""
A TLS failure in words, for the Edge's and the Node's logs: OpenSSL
reports a handshake that failed as a list of C{(library, function,
reason)} tuples (C{[('SSL routines', '', 'tlsv1 alert unknown ca')]}),
which read as noise; the reasons alone say what went wrong.
"""

from OpenSSL import SSL
from twisted.python.failure import Failure


def tls_failure(failure: Failure) -> str | None:
    """
    The reasons of C{failure}'s TLS error (C{"tlsv1 alert unknown ca"}),
    or C{None} when it is no TLS error.
    """
    error = failure.value
    if not isinstance(error, SSL.Error):
        return None
    entries = error.args[0] if error.args and isinstance(error.args[0], list) else []
    reasons = [str(entry[-1]) for entry in entries if isinstance(entry, tuple) and entry and entry[-1]]
    return "; ".join(reasons) or str(error) or type(error).__name__
