"""
Tenants on real daemons (docs/edge.md, "Tenants"): runs belong to the
caller key that started them — another caller key gets 404 on every
per-run endpoint, also once the run is read back from the Node's store
after an Edge restart, and an admin key sees all — and a stranger holding
1,500 slow HTTP connections from one address does not keep another
address's callers out. Every wait is bounded.
"""

import json
import resource
import selectors
import socket
import threading
import time
from contextlib import contextmanager

import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.daemons import echo_node, wait_for

ALICE, BOB, ROOT = "sk-alice", "sk-bob", "sk-root"
TEXT = "one two three four five six"


def auth(key):
    return {"authorization": f"Bearer {key}"}


def raise_fd_limit():
    """
    Let this process (and the daemons it starts, which inherit it) open as
    many files as the hard limit allows.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


# -- isolation


@pytest.fixture
def keyed(launch):
    edge = launch.edge(
        {
            "nodes": [echo_node("node-1", "tok-1", delay_ms=100)],
            "api_keys": [{"key": ALICE, "name": "alice"}, {"key": BOB, "name": "bob"}],
            "admin_keys": [{"key": ROOT, "name": "ops"}],
        }
    )
    launch.node(edge.node_port, "tok-1")
    wait_connected(edge)
    return edge


def wait_connected(edge):
    wait_for(
        lambda: {n["id"]: n for n in edge.status_with(ROOT)["nodes"]}["node-1"]["connected"], what="node-1 connected"
    )


def start_background(edge, key, text=TEXT):
    status, run = edge.json(
        "POST", "/v1/runs", {"adapter": "echo", "input": text, "stream": False, "background": True}, auth(key)
    )
    assert status == 202, run
    return run["id"]


def run_of(edge, run_id, key):
    return edge.json("GET", f"/v1/runs/{run_id}", headers=auth(key))


def listed(edge, key):
    status, body = edge.json("GET", "/v1/runs", headers=auth(key))
    assert status == 200, body
    return {run["id"] for run in body["runs"]}


def assert_hidden(edge, run_id, key):
    """
    Every per-run endpoint answers C{key} as for a run that does not exist.
    """
    for method, path in (
        ("GET", f"/v1/runs/{run_id}"),
        ("GET", f"/v1/runs/{run_id}/events"),
        ("POST", f"/v1/runs/{run_id}/cancel"),
    ):
        status, _, body = edge.request(method, path, b"{}" if method == "POST" else None, auth(key))
        assert (status, json.loads(body)["error"]["code"]) == (404, "run_not_found"), (path, body)
    assert run_id not in listed(edge, key)


def test_runs_belong_to_their_key(keyed, launch):
    """
    Bob cannot list, read, follow or cancel Alice's runs (running or
    finished) and gets the answer a made-up id gets; Alice and the admin
    key can. After an Edge restart the run is read back from the Node's
    store, which knows its owner: still Alice's alone.
    """
    edge = keyed
    running = start_background(edge, ALICE, "word " * 40)
    assert_hidden(edge, running, BOB)
    assert run_of(edge, running, ALICE)[1]["status"] in ("queued", "running")
    finished = start_background(edge, ALICE)
    wait_for(lambda: run_of(edge, finished, ALICE)[1]["status"] == "complete", what="Alice's run to complete")
    assert_hidden(edge, finished, BOB)
    assert run_of(edge, running, ALICE)[1]["status"] == "running"
    bobs = start_background(edge, BOB)
    assert listed(edge, ALICE) == {running, finished}
    assert listed(edge, BOB) == {bobs}
    assert listed(edge, ROOT) == {running, finished, bobs}
    status, answer = edge.json("POST", f"/v1/runs/{running}/cancel", {}, auth(ALICE))
    assert (status, answer["cancelling"]) == (200, True)

    edge.stop()
    edge.start()
    wait_connected(edge)
    status, run = wait_for(lambda: run_of(edge, finished, ALICE), what="the run read back from the Node's store")
    assert (status, run["output"], run["key"]) == (200, TEXT, "alice")
    assert run_of(edge, finished, ROOT)[0] == 200
    assert_hidden(edge, finished, BOB)
    status, _, body = edge.request("GET", f"/v1/runs/{finished}/events", headers=auth(ALICE))
    assert status == 200 and b'"complete"' in body
    assert {finished, running} <= listed(edge, ALICE)
    assert listed(edge, BOB) == {bobs}


# -- doors per source address

STRANGER = "127.0.0.2"
SLOW_CONNECTIONS = 1500
CALLER_REQUESTS = 20
#: The most connections the stranger opens in all.
MAX_OPENS = 500_000
HEADER_TIMEOUT = 3.0


class Stranger(threading.Thread):
    """
    Holds up to C{count} slow connections to C{port} from C{STRANGER}
    (half send a partial header, half nothing) and opens a new one each
    time the Edge closes one, until stopped (or after C{MAX_OPENS}).

    @ivar opened: connections opened so far.
    @ivar closed: connections the Edge closed so far.
    """

    def __init__(self, port, count):
        super().__init__(daemon=True)
        self.port = port
        self.count = count
        self.opened = 0
        self.closed = 0
        self.stopping = threading.Event()
        self.selector = selectors.DefaultSelector()
        self.error = None

    def open_one(self):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.settimeout(5)
        try:
            sock.bind((STRANGER, 0))
            sock.connect(("127.0.0.1", self.port))
            if self.opened % 2:
                sock.sendall(b"GET /v1/status HTTP/1.1\r\nHost: edge\r\n")
        except OSError:
            sock.close()
            self.closed += 1
            return
        sock.setblocking(False)
        self.selector.register(sock, selectors.EVENT_READ)
        self.opened += 1

    def run(self):
        try:
            while self.opened < self.count and not self.stopping.is_set():
                self.open_one()
            while not self.stopping.is_set():
                for key, _ in self.selector.select(timeout=0.1):
                    sock = key.fileobj
                    try:
                        data = sock.recv(4096)
                    except OSError:
                        data = b""
                    if not data:
                        self.selector.unregister(sock)
                        sock.close()
                        self.closed += 1
                        if self.opened < MAX_OPENS:
                            self.open_one()
        except Exception as e:  # reported by the test
            self.error = e

    def stop(self):
        self.stopping.set()
        self.join(timeout=30)
        for key in list(self.selector.get_map().values()):
            key.fileobj.close()
        self.selector.close()


def scrape(edge):
    _, _, body = edge.request("GET", "/metrics")
    samples = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def served(edge):
    status, body = edge.json(
        "POST", "/v1/chat/completions", {"model": "echo", "messages": [{"role": "user", "content": "still here"}]}
    )
    return status == 200 and body["choices"][0]["message"]["content"] == "still here"


@contextmanager
def fd_soft_limit(soft):
    """
    Daemons started inside inherit a soft RLIMIT_NOFILE of C{soft} (this
    process gets its own back on leaving).
    """
    old = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, old[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, old)


def open_files_limit(pid):
    with open(f"/proc/{pid}/limits") as f:
        for line in f:
            if line.startswith("Max open files"):
                return int(line.split()[3])
    raise AssertionError("no open files limit")


def stranger_against(edge, refused_reason):
    """
    Hold C{SLOW_CONNECTIONS} slow connections from C{STRANGER} against
    C{edge} while 127.0.0.1 makes C{CALLER_REQUESTS} requests, half before
    and half after the stranger's connections reached their header
    deadline and were reopened. @return: the Edge's metrics at the end.
    """
    stranger = Stranger(edge.http_port, SLOW_CONNECTIONS)
    stranger.start()
    try:
        wait_for(lambda: stranger.opened >= SLOW_CONNECTIONS, timeout=60, what="the stranger's connections")
        samples = wait_for(
            lambda: (s := scrape(edge)).get(("iop_edge_http_waiting_connections", ()), 0) >= 200 and s,
            what="the stranger's connections to wait in its line",
        )
        # 256 are read, up to 256 wait: the stranger's others are refused.
        assert samples[("iop_edge_refusals_total", (("reason", refused_reason),))] > 0
        results = [served(edge) for _ in range(CALLER_REQUESTS // 2)]
        wait_for(
            lambda: scrape(edge).get(("iop_edge_refusals_total", (("reason", "header_timeout_sec"),)), 0) > 256,
            timeout=HEADER_TIMEOUT * 5,
            what="the stranger's connections to reach their header deadline (and be reopened)",
        )
        results += [served(edge) for _ in range(CALLER_REQUESTS - len(results))]
        assert stranger.error is None, stranger.error
        assert results == [True] * CALLER_REQUESTS
        samples = scrape(edge)
    finally:
        stranger.stop()
    assert edge.running()
    started = time.monotonic()
    assert served(edge)
    assert time.monotonic() - started < 10
    return samples


def test_slow_stranger_does_not_shut_callers_out(launch):
    """
    A stranger holding 1,500 slow connections from 127.0.0.2 (reopening
    each one the Edge closes) against C{max_http_connections: 500}: its
    256 are read, 244 wait in its line, the rest are refused at once; all
    20 requests from 127.0.0.1 are served — each taking the place of one
    of the stranger's waiting connections — before and after the
    stranger's connections reached their header deadline and were
    reopened.
    """
    if raise_fd_limit() < SLOW_CONNECTIONS + 1000:
        pytest.skip("needs a higher RLIMIT_NOFILE hard limit")
    edge = launch.edge(
        {
            "nodes": [echo_node("node-1", "tok-1")],
            "limits": {"max_http_connections": 500, "header_timeout_sec": HEADER_TIMEOUT},
        }
    )
    launch.node(edge.node_port, "tok-1")
    edge.wait_connected("node-1")
    samples = stranger_against(edge, "max_http_connections")
    assert samples[("iop_edge_refusals_total", (("reason", "address_line_evicted"),))] > 0


def test_slow_stranger_at_1024_open_files(launch):
    """
    With the default limits and only 1,024 open files (a distribution's
    default), the same stranger gets 256 connections read and 256 waiting
    — the rest are refused at once, so it cannot run the Edge out of file
    descriptors — and all 20 requests from 127.0.0.1 are served.
    """
    if raise_fd_limit() < SLOW_CONNECTIONS + 1000:
        pytest.skip("needs a higher RLIMIT_NOFILE hard limit")
    with fd_soft_limit(1024):
        edge = launch.edge({"nodes": [echo_node("node-1", "tok-1")], "limits": {"header_timeout_sec": HEADER_TIMEOUT}})
        launch.node(edge.node_port, "tok-1")
    assert open_files_limit(edge.pid) == 1024
    edge.wait_connected("node-1")
    stranger_against(edge, "max_http_connections_per_address")
