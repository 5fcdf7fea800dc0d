"""
Probes the end-to-end tests share: a raw frame for the Node port, whether
a socket was closed by the Edge, whether a new connection is refused at
once, whether the Edge still serves a chat completion, and a process's
resident memory. Every wait is bounded by its C{timeout}.
"""

import socket
import struct
import time

from iop.protocols.wire import envelope


def frame(message):
    data = envelope(message).SerializeToString()
    return struct.pack("!I", len(data)) + data


def closed_by_peer(sock, timeout=5.0):
    """
    Whether the peer closed the connection (EOF or reset) within C{timeout}
    (whatever it sent before, such as a refusal or heartbeats).
    """
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            sock.settimeout(max(0.01, deadline - time.monotonic()))
            if not sock.recv(65536):
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False
    return False


def still_serving(edge):
    status, body = edge.json(
        "POST", "/v1/chat/completions", {"model": "echo", "messages": [{"role": "user", "content": "still here"}]}
    )
    return status == 200 and body["choices"][0]["message"]["content"] == "still here"


def refused_at_once(port, timeout=0.5):
    """
    Whether a new connection is closed by the Edge within C{timeout}
    without a word from us (a reset while connecting counts: the Edge
    closed it at once).
    """
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as extra:
            return closed_by_peer(extra, timeout=timeout)
    except (ConnectionResetError, BrokenPipeError):
        return True


def rss_bytes(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")
