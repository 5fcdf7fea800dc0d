"""
The process harness for the multi-process tests, the benchmark and the
demo: real C{iop-edge} / C{iop-node} daemons on free loopback ports
(L{support.daemons}), a loopback proxy that can freeze a link
(L{support.proxy}), fake provider servers (C{fake_providers.py}) and a fake
CLI agent (C{fake_cli.py}), the last two run as scripts.

Not installed: C{tests/} must be on C{sys.path} (C{tests/conftest.py} puts
it there for pytest; C{bench/relay.py} and C{scripts/demo.py} do the same
in two lines). In-memory fakes belong in C{iop.testing} instead.
"""
