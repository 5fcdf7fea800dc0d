"""
Real iop daemons for integration tests: `twistd -n iop-edge` and
`twistd -n iop-node` subprocesses, each in its own working directory, on
loopback ports the OS picked, always torn down.

Every wait here polls with a bounded deadline; nothing sleeps a fixed time
to synchronize.
"""

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import yaml

TWISTD = os.path.join(os.path.dirname(sys.executable), "twistd")
HERE = os.path.dirname(os.path.abspath(__file__))
FAKE_PROVIDERS = os.path.join(HERE, "fake_providers.py")
FAKE_CLI = os.path.join(HERE, "fake_cli.py")


#: Every port L{free_port} handed out in this process.
_handed_out = set()


def free_port(tries=100):
    """
    A loopback port that is free now and was not handed out before in
    this process. The OS may give a port it gave a moment ago again once
    its socket is closed, so two calls in a row (an Edge's node and HTTP
    ports) could otherwise get one port, and the second listener fail.
    """
    for _ in range(tries):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port
    raise AssertionError(f"no loopback port not handed out before in {tries} tries")


def wait_for(predicate, timeout=15.0, interval=0.05, what="condition"):
    """
    Poll C{predicate} until it returns a true value (returned) or the
    deadline passes (AssertionError).
    """
    deadline = time.monotonic() + timeout
    last_error = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except (OSError, http.client.HTTPException, ValueError) as e:
            last_error = e
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last error: {last_error!r})")


def holds_for(predicate, duration, interval=0.1, what="condition"):
    """
    Check C{predicate} again and again for C{duration} seconds
    (AssertionError the first time it is false): that something I{stays}
    true, not only that it is true once.
    """
    deadline = time.monotonic() + duration
    while True:
        assert predicate(), f"{what} stopped holding"
        if time.monotonic() >= deadline:
            return
        time.sleep(interval)


class Daemon:
    """
    One twistd process. Output goes to C{<workdir>/daemon.log}.
    """

    def __init__(self, tapname, workdir, config_path, extra_env=None):
        self.tapname = tapname
        self.workdir = workdir
        self.config_path = config_path
        self.log_path = os.path.join(workdir, "daemon.log")
        self.extra_env = extra_env or {}
        self.process = None

    def start(self):
        env = dict(os.environ, PYTHONUNBUFFERED="1", **self.extra_env)
        self._log = open(self.log_path, "ab")
        self.process = subprocess.Popen(
            [TWISTD, "-n", "--pidfile=", *self._profiling(), self.tapname, "--config", self.config_path],
            cwd=self.workdir,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        return self

    def _profiling(self):
        """
        twistd's cProfile options when C{IOP_TWISTD_PROFILE_DIR} names a
        directory (C{bench/profile.py --cprofile}): the daemon writes its
        statistics there, as C{<tap>-<n>.prof}, when it stops.
        """
        directory = os.environ.get("IOP_TWISTD_PROFILE_DIR")
        if not directory:
            return []
        n = len([name for name in os.listdir(directory) if name.startswith(self.tapname)])
        path = os.path.join(directory, f"{self.tapname}-{n}.prof")
        return ["--profile", path, "--profiler", "cprofile", "--savestats"]

    @property
    def pid(self):
        return self.process.pid

    def running(self):
        return self.process is not None and self.process.poll() is None

    def wait(self, timeout=15.0):
        """
        Wait for exit; return the exit status.
        """
        return self.process.wait(timeout=timeout)

    def stop(self, signum=signal.SIGTERM, timeout=15.0):
        """
        Signal and reap; returns the exit status. Never leaves a process.
        """
        if self.process is None:
            return None
        if self.running():
            self.process.send_signal(signum)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=timeout)
        self._log.close()
        return self.process.returncode

    def output(self):
        with open(self.log_path, "rb") as f:
            return f.read().decode("utf-8", "replace")


class Edge(Daemon):
    def __init__(self, workdir, config):
        self.node_port = free_port()
        self.http_port = free_port()
        config = dict(config)
        config["listen"] = {
            "nodes": f"tcp:{self.node_port}:interface=127.0.0.1",
            "http": f"tcp:{self.http_port}:interface=127.0.0.1",
        }
        os.makedirs(workdir, exist_ok=True)
        super().__init__("iop-edge", workdir, os.path.join(workdir, "edge.yaml"))
        self.config = config
        self.rewrite_config()

    def rewrite_config(self):
        """
        Write C{self.config} to the Edge's edge.yaml (after changing it).
        """
        with open(self.config_path, "w") as f:
            yaml.safe_dump(self.config, f)

    def rewrite_listen(self, **endpoints):
        """
        Replace listener endpoints (C{nodes=}, C{http=}) before starting,
        e.g. to listen with TLS.
        """
        self.config["listen"].update(endpoints)
        self.rewrite_config()

    def start(self):
        self.start_process()
        wait_for(self._listening, what="the Edge to listen")
        return self

    def start_process(self):
        """
        Start without waiting for the listeners (for a start that must fail).
        """
        return super().start()

    def _listening(self):
        if not self.running():
            raise AssertionError(f"iop-edge exited:\n{self.output()}")
        self.request("GET", "/v1/models")
        return True

    def request(self, method, path, body=None, headers=None, timeout=30.0):
        """
        One HTTP request. @return: C{(status, headers, body_bytes)}.
        """
        conn = http.client.HTTPConnection("127.0.0.1", self.http_port, timeout=timeout)
        try:
            data = json.dumps(body).encode() if isinstance(body, (dict, list)) else body
            conn.request(method, path, body=data, headers={"content-type": "application/json", **(headers or {})})
            response = conn.getresponse()
            return response.status, dict(response.getheaders()), response.read()
        finally:
            conn.close()

    def json(self, method, path, body=None, headers=None):
        status, _, data = self.request(method, path, body, headers)
        return status, json.loads(data)

    def status(self):
        """
        C{/v1/status}, with the first caller key when keys are configured.
        """
        keys = self.config.get("api_keys") or []
        key = keys[0] if keys and isinstance(keys[0], str) else (keys[0].get("key") if keys else None)
        return self.json("GET", "/v1/status", headers={"authorization": f"Bearer {key}"} if key else None)[1]

    def status_with(self, key):
        return self.json("GET", "/v1/status", headers={"authorization": f"Bearer {key}"})[1]

    def node_connected(self, node_id):
        nodes = {n["id"]: n for n in self.status()["nodes"]}
        return nodes[node_id]["connected"]

    def wait_connected(self, node_id, connected=True, timeout=20.0):
        wait_for(
            lambda: self.node_connected(node_id) == connected, timeout=timeout, what=f"{node_id} connected={connected}"
        )

    def stream_request(self, method, path, body, headers=None, timeout=30.0):
        """
        Send a request without waiting for the answer. @return: C{(connection, None)}.
        """
        conn = http.client.HTTPConnection("127.0.0.1", self.http_port, timeout=timeout)
        conn.request(
            method,
            path,
            body=None if body is None else json.dumps(body).encode(),
            headers={"content-type": "application/json", **(headers or {})},
        )
        return conn, None

    def stream(self, method, path, body, headers=None, timeout=30.0):
        """
        Open a streaming request. @return: C{(connection, response)}.
        """
        conn, _ = self.stream_request(method, path, body, headers, timeout)
        return conn, conn.getresponse()

    def run_events(self, body, headers=None, timeout=30.0):
        """
        One streamed native run (C{POST /v1/runs}), read to its end.
        @return: its events, as dicts.
        """
        conn, response = self.stream("POST", "/v1/runs", dict(body, stream=True), headers, timeout)
        try:
            assert response.status == 200, response.read()
            return [json.loads(p) for p in sse_events(response)]
        finally:
            conn.close()

    @property
    def base_url(self):
        return f"http://127.0.0.1:{self.http_port}"


class Node(Daemon):
    def __init__(self, workdir, edge_port, token, reconnect=None, extra=None):
        os.makedirs(workdir, exist_ok=True)
        config = {
            "edge": f"tcp:host=127.0.0.1:port={edge_port}",
            "token": token,
            "store": "file:runs.db?mode=rwc",
            "reconnect": reconnect or {"max_attempts": 0, "interval_sec": 0.2},
        }
        config.update(extra or {})
        path = os.path.join(workdir, "node.yaml")
        with open(path, "w") as f:
            yaml.safe_dump(config, f)
        super().__init__("iop-node", workdir, path)


class Launcher:
    """
    Starts Edges and Nodes, each in its own numbered directory under
    C{root}, and stops every one of them (L{stop_all}) whatever happened.
    """

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


def sse_events(response, max_lines=100_000):
    """
    Yield each C{data:} payload of a server-sent event stream as it comes,
    until the stream ends. Each read is bounded by the connection's
    timeout, the whole stream by C{max_lines}.
    """
    buffer = b""
    for _ in range(max_lines):
        line = response.readline()
        if not line:
            return
        line = line.rstrip(b"\r\n")
        if line.startswith(b"data: "):
            buffer = line[6:]
        elif line == b"" and buffer:
            yield buffer.decode("utf-8")
            buffer = b""
    raise AssertionError(f"event stream still going after {max_lines} lines")


def sse_with_ids(response, max_lines=100_000):
    """
    Yield C{(id, payload)} for each event of a server-sent event stream
    as it comes (C{id} an int, or C{None} without one; the payload parsed
    as JSON), until the stream ends. Reads nothing past the event it
    yields, so a new one may read on the same response. Each read is
    bounded by the connection's timeout, the whole stream by
    C{max_lines}.
    """
    event_id, data = None, None
    for _ in range(max_lines):
        line = response.readline()
        if not line:
            return
        line = line.rstrip(b"\r\n")
        if line.startswith(b"id: "):
            event_id = int(line[4:])
        elif line.startswith(b"data: "):
            data = json.loads(line[6:])
        elif line == b"" and data is not None:
            yield event_id, data
            event_id, data = None, None
    raise AssertionError(f"event stream still going after {max_lines} lines")


def echo_node(node_id, token, delay_ms=0, max_concurrency=4, providers=None):
    """
    An edge.yaml node entry with one echo adapter.
    """
    return {
        "id": node_id,
        "token": token,
        "adapters": [{"name": "echo", "type": "echo", "max_concurrency": max_concurrency, "delay_ms": delay_ms}],
        "providers": providers
        or [{"id": "echo", "adapter": "echo", "capacity": {"normal": max_concurrency, "long": 0}}],
    }


class FakeProvider:
    """
    A fake provider server (the C{script}, normally L{FAKE_PROVIDERS})
    running as a subprocess.
    """

    def __init__(self, script, workdir, kind, delay_ms, port=0):
        self.port_file = os.path.join(workdir, f"{kind}-{port or 'any'}.port")
        self.process = subprocess.Popen(
            [
                sys.executable,
                script,
                kind,
                "--port-file",
                self.port_file,
                "--delay-ms",
                str(delay_ms),
                "--port",
                str(port),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_for(
            lambda: os.path.exists(self.port_file) and open(self.port_file).read().strip(), what=f"fake {kind} provider"
        )
        self.port = int(open(self.port_file).read().strip())

    def url(self, path=""):
        return f"http://127.0.0.1:{self.port}{path}"

    def stats(self):
        with urllib.request.urlopen(self.url("/_stats"), timeout=5) as response:
            return json.loads(response.read())

    def requests(self):
        """
        The last requests the provider received: method, path, headers (as
        C{[name, value]} pairs, names as they arrived) and JSON body.
        """
        with urllib.request.urlopen(self.url("/_requests"), timeout=5) as response:
            return json.loads(response.read())

    def stop(self):
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except Exception:
            self.process.kill()
            self.process.wait(timeout=10)
