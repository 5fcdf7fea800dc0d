"""
The process harness never hands one loopback port out twice.
"""

import socket

import pytest
from support import daemons


class _Socket:
    """
    A socket whose port, once bound, is the next of C{ports}.
    """

    ports = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def bind(self, address):
        self.port = self.ports.pop(0)

    def getsockname(self):
        return ("127.0.0.1", self.port)


def test_a_port_given_again_by_the_os_is_skipped(monkeypatch):
    """
    The OS gives the port it just gave (its socket is closed): the second
    call skips it for the next one.
    """
    monkeypatch.setattr(daemons, "_handed_out", set())
    monkeypatch.setattr(_Socket, "ports", [40001, 40001, 40001, 40002])
    monkeypatch.setattr(socket, "socket", _Socket)
    assert daemons.free_port() == 40001
    assert daemons.free_port() == 40002


def test_bounded(monkeypatch):
    monkeypatch.setattr(daemons, "_handed_out", {40001})
    monkeypatch.setattr(_Socket, "ports", [40001] * 3)
    monkeypatch.setattr(socket, "socket", _Socket)
    with pytest.raises(AssertionError, match="in 3 tries"):
        daemons.free_port(tries=3)


def test_real_ports_are_distinct():
    ports = [daemons.free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
