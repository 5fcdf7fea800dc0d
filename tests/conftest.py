"""
Fixtures for multi-process tests: every daemon a test starts is stopped
at teardown, whatever happened.
"""

import os
import sys

import pytest


from iop.testing.daemons import Edge, Node  # noqa: E402


class Launcher:
    def __init__(self, root):
        self.root = root
        self.daemons = []
        self.count = 0

    def _dir(self, name):
        self.count += 1
        path = os.path.join(self.root, f"{self.count:02d}-{name}")
        os.makedirs(path, exist_ok=True)
        return path

    def edge(self, config, start=True):
        edge = Edge(self._dir("edge"), config)
        self.daemons.append(edge)
        return edge.start() if start else edge

    def node(self, edge_port, token, start=True, **kwargs):
        node = Node(self._dir("node"), edge_port, token, **kwargs)
        self.daemons.append(node)
        return node.start() if start else node

    def stop_all(self):
        for daemon in reversed(self.daemons):
            try:
                daemon.stop()
            except Exception:
                if daemon.process is not None:
                    daemon.process.kill()


@pytest.fixture
def launch(tmp_path, request):
    launcher = Launcher(str(tmp_path))
    try:
        yield launcher
    finally:
        launcher.stop_all()
        if request.node.rep_call.failed if hasattr(request.node, "rep_call") else False:
            for daemon in launcher.daemons:
                sys.stderr.write(f"\n----- {daemon.tapname} ({daemon.workdir}) -----\n{daemon.output()[-4000:]}\n")


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    setattr(item, "rep_" + report.when, report)


class FakeProvider:
    """
    tests/fake_providers.py running as a subprocess.
    """

    def __init__(self, workdir, kind, delay_ms):
        import subprocess

        from iop.testing.daemons import wait_for

        self.port_file = os.path.join(workdir, f"{kind}.port")
        self.process = subprocess.Popen(
            [sys.executable, os.path.join(HERE, "fake_providers.py"), kind, "--port-file", self.port_file, "--delay-ms", str(delay_ms)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_for(lambda: os.path.exists(self.port_file) and open(self.port_file).read().strip(), what=f"fake {kind} provider")
        self.port = int(open(self.port_file).read().strip())

    def url(self, path=""):
        return f"http://127.0.0.1:{self.port}{path}"

    def stats(self):
        import json
        import urllib.request

        with urllib.request.urlopen(self.url("/_stats"), timeout=5) as response:
            return json.loads(response.read())

    def stop(self):
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except Exception:
            self.process.kill()
            self.process.wait(timeout=10)


HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture
def fake_provider(tmp_path):
    started = []

    def start(kind, delay_ms=50):
        provider = FakeProvider(str(tmp_path), kind, delay_ms)
        started.append(provider)
        return provider

    try:
        yield start
    finally:
        for provider in started:
            provider.stop()
