"""
The operator console on real processes (issue 12, finding 5): an
endpoint that would bind beyond loopback stops the Edge at start naming
C{manhole.listen}; on loopback, only an authorized SSH key gets in, and
the host key file is private.
"""

import os
import shutil
import stat
import subprocess
import time

import pytest
from support.daemons import echo_node, free_port

needs_ssh = pytest.mark.skipif(not (shutil.which("ssh") and shutil.which("ssh-keygen")), reason="needs OpenSSH")


def keypair(directory, name):
    path = os.path.join(directory, name)
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", path], check=True)
    with open(path + ".pub") as f:
        return path, f.read().strip()


def ssh_login(port, identity, timeout=20.0):
    """
    Try to log in as C{ops}; @return: C{"ok"} once authenticated,
    C{"denied"} if refused. The session is not used (it is closed).
    """
    process = subprocess.Popen(
        [
            "ssh", "-v", "-N", "-p", str(port), "-i", identity,
            "-o", "BatchMode=yes", "-o", "IdentitiesOnly=yes",
            "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
            "ops@127.0.0.1",
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = process.stderr.readline().decode("utf-8", "replace")
            if "Authenticated to" in line:
                return "ok"
            if "Permission denied" in line or (not line and process.poll() is not None):
                return "denied"
        return "timeout"
    finally:
        process.kill()
        process.wait(timeout=10)


def test_non_loopback_listen_refused(launch):
    """
    C{interface=127.0.0.1:interface=0.0.0.0} (which Twisted reads as
    0.0.0.0) stops the Edge at start, naming C{manhole.listen}.
    """
    manhole = {
        "listen": f"tcp:{free_port()}:interface=127.0.0.1:interface=0.0.0.0",
        "users": {
            "ops": {
                "authorized_keys": ["ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl"]
            }
        },
    }
    edge = launch.edge({"nodes": [echo_node("node-1", "tok-1")], "manhole": manhole}, start=False)
    edge.start_process()
    assert edge.wait(timeout=20) == 1
    assert "manhole.listen" in edge.output()
    assert "loopback" in edge.output()


@needs_ssh
def test_only_authorized_keys_get_in(launch, tmp_path):
    """
    The authorized key logs in, another key is refused, and the host key
    the Edge generated is mode 0600.
    """
    identity, public = keypair(str(tmp_path), "ops")
    stranger, _ = keypair(str(tmp_path), "stranger")
    port = free_port()
    manhole = {"listen": f"tcp:{port}:interface=127.0.0.1", "users": {"ops": {"authorized_keys": [public]}}}
    edge = launch.edge({"nodes": [echo_node("node-1", "tok-1")], "manhole": manhole})
    assert ssh_login(port, identity) == "ok"
    assert ssh_login(port, stranger) == "denied"
    host_key = os.path.join(edge.workdir, ".iop-manhole", "host_key")
    assert stat.S_IMODE(os.stat(host_key).st_mode) == 0o600
