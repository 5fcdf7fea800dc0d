"""
In-memory test fakes that ship with iop, for its own unit tests and for
code built on it.

The rule for this package: in-memory only. Nothing here starts a process
or a thread, or opens a socket, and nothing here imports from the source
tree's C{tests/} (which is not installed). The process harness (real
daemons on loopback ports, the freezing proxy, fake provider servers and
the fake CLI) lives in C{tests/support/}.
"""
