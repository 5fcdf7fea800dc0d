"""
The fake providers of the multi-process tests (C{tests/support/fake_providers.py}),
listening with a backlog of 1024 instead of Twisted's 50.

Why: at 1,000 concurrent callers the direct baseline must not lose
connections to its own listen queue, or the ratios against it would flatter
the relay. Same arguments as the original.
"""

import os
import sys

from twisted.internet import reactor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "support"))
import fake_providers  # noqa: E402

BACKLOG = 1024
_listen = reactor.listenTCP


def _listen_deep(port, factory, backlog=50, interface=""):
    return _listen(port, factory, backlog=max(backlog, BACKLOG), interface=interface)


reactor.listenTCP = _listen_deep  # type: ignore[method-assign]

if __name__ == "__main__":
    fake_providers.main()
