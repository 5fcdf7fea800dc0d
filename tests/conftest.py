"""
Fixtures for multi-process tests: every daemon a test starts is stopped
at teardown, whatever happened. The harness itself is in C{support/}.
"""

import os
import sys

import pytest

# The harness is the package `support` in this directory: put the directory
# on sys.path (pytest's default import mode does too; others do not).
HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from support.daemons import FAKE_PROVIDERS, FakeProvider, Launcher  # noqa: E402


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


@pytest.fixture
def fake_provider(tmp_path):
    started = []

    def start(kind, delay_ms=50, port=0):
        provider = FakeProvider(FAKE_PROVIDERS, str(tmp_path), kind, delay_ms, port)
        started.append(provider)
        return provider

    try:
        yield start
    finally:
        for provider in started:
            provider.stop()
