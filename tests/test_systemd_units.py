"""
conf/systemd/iop-edge.service and iop-node.service: they start the daemons
the way the README says (`twistd -n`), restart only on the exit statuses
where a restart can help, reload the Edge with SIGHUP, and give a drain
more time than shutdown_grace_sec; `systemd-analyze verify` accepts them
where it is installed; and their ExecStart line, run as written, starts
an Edge that reloads on SIGHUP and drains to exit 0 on SIGTERM.
"""

import configparser
import os
import shlex
import shutil
import signal
import subprocess
import sys

import pytest
import yaml
from support.daemons import echo_node, wait_for

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
UNITS = os.path.join(ROOT, "conf", "systemd")
TWISTD = os.path.join(os.path.dirname(sys.executable), "twistd")
INSTALLED_TWISTD = "/opt/iop/bin/twistd"


def unit(name):
    parser = configparser.ConfigParser(interpolation=None, strict=True)
    parser.optionxform = str
    parser.read(os.path.join(UNITS, name))
    return parser


def seconds(value):
    assert value.isdigit(), f"TimeoutStopSec={value}: write whole seconds"
    return int(value)


def grace(config_name):
    with open(os.path.join(ROOT, "conf", config_name)) as f:
        return yaml.safe_load(f).get("shutdown_grace_sec", 30)


def test_edge_unit():
    """
    The Edge runs in the foreground under twistd, reloads on SIGHUP, is
    not restarted after a bad configuration (exit 1), and its stop timeout
    covers the drain grace plus the 5 s given to closing connections.
    """
    service = unit("iop-edge.service")["Service"]
    argv = shlex.split(service["ExecStart"])
    assert argv[:2] == [INSTALLED_TWISTD, "-n"] and "iop-edge" in argv
    assert service["ExecReload"] == "/bin/kill -HUP $MAINPID"
    assert service["Restart"] == "on-failure"
    assert service["RestartPreventExitStatus"].split() == ["1"]
    assert service["KillSignal"] == "SIGTERM"
    assert seconds(service["TimeoutStopSec"]) > max(30, grace("edge.yaml")) + 5
    # Room for every connection limits: lets the Edge hold, not 1,024.
    assert int(service["LimitNOFILE"]) == 65536


def test_node_unit():
    """
    The Node is restarted only where it helps: not after a bad node.yaml
    (1), a fatal refusal (2) or an incompatible wire version (4); after
    its retries ran out (3), after a delay, without a start limit; and its
    stop timeout covers the drain grace.
    """
    parsed = unit("iop-node.service")
    service = parsed["Service"]
    argv = shlex.split(service["ExecStart"])
    assert argv[:2] == [INSTALLED_TWISTD, "-n"] and "iop-node" in argv
    assert service["Restart"] == "on-failure"
    assert sorted(service["RestartPreventExitStatus"].split()) == ["1", "2", "4"]
    assert int(service["RestartSec"]) >= 10
    assert parsed["Unit"]["StartLimitIntervalSec"] == "0"
    assert seconds(service["TimeoutStopSec"]) > max(30, grace("node.yaml"))
    assert int(service["LimitNOFILE"]) == 65536


@pytest.mark.parametrize("name", ["iop-edge.service", "iop-node.service"])
def test_systemd_analyze_verify(name, tmp_path):
    """
    `systemd-analyze verify` accepts the unit without a warning (with
    ExecStart pointing at this checkout's twistd, since /opt/iop is not
    installed here).
    """
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed on this machine: the unit files were not verified by systemd")
    with open(os.path.join(UNITS, name)) as f:
        text = f.read().replace(INSTALLED_TWISTD, TWISTD)
    path = tmp_path / name
    path.write_text(text)
    result = subprocess.run([analyze, "verify", str(path)], capture_output=True, text=True, timeout=60)
    ours = [line for line in (result.stdout + result.stderr).splitlines() if name in line]
    assert result.returncode == 0 and not ours, result.stdout + result.stderr


def test_exec_start_reload_and_stop(launch, tmp_path):
    """
    The Edge unit's ExecStart, run as written (but for the paths), serves;
    ExecReload's SIGHUP re-reads edge.yaml without stopping it; SIGTERM
    drains and exits 0 well within TimeoutStopSec.
    """
    edge = launch.edge({"nodes": [echo_node("node-1", "tok-1")]}, start=False)
    service = unit("iop-edge.service")["Service"]
    argv = [TWISTD if a == INSTALLED_TWISTD else a for a in shlex.split(service["ExecStart"])]
    argv = [edge.config_path if a == "/etc/iop/edge.yaml" else a for a in argv]
    log = open(tmp_path / "unit.log", "wb")
    process = subprocess.Popen(argv, cwd=edge.workdir, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: edge.status()["nodes"], what="the Edge started by ExecStart")
        process.send_signal(signal.SIGHUP)
        wait_for(lambda: b"reloading" in (tmp_path / "unit.log").read_bytes(), what="the reload log line")
        assert process.poll() is None
        assert edge.status()["nodes"][0]["id"] == "node-1"
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=seconds(service["TimeoutStopSec"])) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        log.close()
