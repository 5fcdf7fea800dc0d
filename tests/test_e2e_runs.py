"""
Runs that outlive their caller, on real processes: the Node's store (rows
of a killed Node, tunnels), background runs read back and resumed, a
background run that survives its Node's link being cut, the events feed
and the token metrics.
"""

import http.client
import json
import os
import signal
import socket
import sqlite3
import threading

from prometheus_client.parser import text_string_to_metric_families
from support.daemons import echo_node, sse_events, sse_with_ids, wait_for
from support.proxy import FreezableProxy

TEXT = "the quick brown fox jumps over the lazy dog"


def store_rows(node):
    with sqlite3.connect(os.path.join(node.workdir, "runs.db")) as db:
        db.row_factory = sqlite3.Row
        return [dict(row) for row in db.execute("SELECT * FROM runs ORDER BY started_at")]


def test_killed_node_marks_running_rows(launch):
    """
    A Node SIGKILLed in the middle of a run leaves its row `running`; when
    it starts again, that row becomes `error` with `node_restarted`.
    """
    edge = launch.edge({"nodes": [echo_node("node-1", "tok-1", delay_ms=200)]})
    node = launch.node(edge.node_port, "tok-1")
    edge.wait_connected("node-1")
    conn, response = edge.stream("POST", "/v1/runs", {"adapter": "echo", "input": "word " * 100, "stream": True})
    try:
        events = sse_events(response)
        assert json.loads(next(events))["type"] == "start"
        wait_for(lambda: [r["status"] for r in store_rows(node)] == ["running"], what="the run's row")
        node.stop(signal.SIGKILL)
    finally:
        conn.close()
    assert [r["status"] for r in store_rows(node)] == ["running"]
    node.start()
    edge.wait_connected("node-1")
    [row] = wait_for(lambda: [r for r in store_rows(node) if r["status"] != "running"], what="the row ended")
    assert (row["status"], row["error_code"]) == ("error", "node_restarted")
    assert row["ended_at"] is not None


def run_state(edge, run_id):
    status, run = edge.json("GET", f"/v1/runs/{run_id}")
    assert status == 200, run
    return run


def test_background_run_survives_its_caller(launch):
    """
    A streamed background run whose caller disconnects after two events
    runs to its end; `GET /v1/runs/{id}` then returns the whole text and
    the usage.
    """
    edge = launch.edge({"nodes": [echo_node("node-1", "tok-1", delay_ms=50)]})
    launch.node(edge.node_port, "tok-1")
    edge.wait_connected("node-1")
    conn, response = edge.stream(
        "POST", "/v1/runs", {"adapter": "echo", "input": TEXT, "stream": True, "background": True}
    )
    run_id = response.getheader("x-iop-run-id")
    events = sse_with_ids(response)
    assert [next(events)[1]["type"] for _ in range(2)] == ["start", "delta"]
    conn.close()
    run = wait_for(lambda: run_state(edge, run_id)["status"] == "complete" and run_state(edge, run_id), what="the end")
    assert run["output"] == TEXT
    assert run["usage"] == {"input_tokens": len(TEXT.split()), "output_tokens": len(TEXT.split())}
    assert run["background"] is True and run["node"] == "node-1"


def test_resume_with_last_event_id(launch):
    """
    A background run started with 202; a reader of its events is cut off
    and reconnects with Last-Event-ID: it gets exactly the missing events
    (the texts concatenate to the input, no seq twice).
    """
    edge = launch.edge({"nodes": [echo_node("node-1", "tok-1", delay_ms=40)]})
    launch.node(edge.node_port, "tok-1")
    edge.wait_connected("node-1")
    text = " ".join(f"w{i}" for i in range(40))
    status, run = edge.json("POST", "/v1/runs", {"adapter": "echo", "input": text, "stream": False, "background": True})
    assert status == 202 and run["status"] in ("queued", "running"), run
    seen = []
    conn, response = edge.stream("GET", f"/v1/runs/{run['id']}/events", None)
    events = sse_with_ids(response)
    for _ in range(6):
        seen.append(next(events))
    conn.close()
    conn, response = edge.stream(
        "GET", f"/v1/runs/{run['id']}/events", None, headers={"last-event-id": str(seen[-1][0])}
    )
    try:
        seen.extend(sse_with_ids(response))
    finally:
        conn.close()
    seqs = [seq for seq, _ in seen]
    assert seqs == list(range(1, len(seen) + 1)), seqs
    assert "".join(p.get("text", "") for _, p in seen) == text
    assert seen[-1][1]["type"] == "complete"


class Feed:
    """
    `GET /v1/events` read on a thread, so the test can act meanwhile.
    """

    def __init__(self, edge, key, query=""):
        self.events = []
        self.conn = http.client.HTTPConnection("127.0.0.1", edge.http_port, timeout=30)
        self.conn.request("GET", "/v1/events" + query, headers={"authorization": f"Bearer {key}"})
        self.response = self.conn.getresponse()
        assert self.response.status == 200
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        # read1, not readline: on a chunked body readline waits for the
        # next chunk before it returns the line it has.
        buffer, name = b"", None
        try:
            while data := self.response.read1(65536):
                buffer += data
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    line = line.rstrip(b"\r")
                    if line.startswith(b"event: "):
                        name = line[7:].decode()
                    elif line.startswith(b"data: "):
                        self.events.append((name, json.loads(line[6:])))
        except (OSError, ValueError, AttributeError, http.client.HTTPException):
            # The test closed the connection under the reader.
            return

    def close(self):
        # Shut the socket first: closing the response would wait for the
        # reader thread's blocked read to return.
        self.conn.sock.shutdown(socket.SHUT_RDWR)
        self.thread.join(5)
        self.conn.close()


def metric(edge, name, **labels):
    _, _, body = edge.request("GET", "/metrics")
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return None


def test_tunnels_on_record_and_usage_always(launch, fake_provider):
    """
    A streamed chat completion tunnelled to an OpenAI-compatible provider
    with `usage: always`, for a caller who did not ask for usage: the
    caller's stream has no usage chunk, yet the usage is on the Edge's
    events feed (tunnel start and end), in the terminal and token metrics
    (by model group, provider, node and key), in the run history and in
    the Node's store.
    """
    fake = fake_provider("openai", delay_ms=10)
    node = {
        "id": "gpu",
        "token": "tok-gpu",
        "adapters": [
            {
                "name": "openai",
                "type": "openai_compat",
                "max_concurrency": 2,
                "base_url": fake.url("/v1"),
                "usage": "always",
            },
        ],
        "providers": [{"id": "openai", "adapter": "openai"}],
    }
    groups = [{"name": "gpt", "providers": [{"node": "gpu", "provider": "openai", "target": "fake-model"}]}]
    edge = launch.edge({"nodes": [node], "model_groups": groups, "admin_keys": ["adm"]})
    node_daemon = launch.node(edge.node_port, "tok-gpu")
    edge.wait_connected("gpu")
    feed = Feed(edge, "adm", "?type=tunnel&node=gpu")
    try:
        body = {"model": "gpt", "stream": True, "messages": [{"role": "user", "content": TEXT}]}
        status, headers, raw = edge.request("POST", "/v1/chat/completions", body)
        assert status == 200
        assert "x-iop-run-id" not in {k.lower() for k in headers}  # a tunnel's headers are the provider's
        assert b'"usage"' not in raw and raw.rstrip().endswith(b"data: [DONE]")
        chunks = [
            json.loads(p)
            for p in (line[6:] for line in raw.decode().split("\n") if line.startswith("data: "))
            if p != "[DONE]"
        ]
        assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]).strip()
        wait_for(lambda: [e for _, e in feed.events if e.get("type") == "end"], what="the tunnel's end on the feed")
    finally:
        feed.close()
    kinds = [(name, e["type"]) for name, e in feed.events]
    assert kinds == [("tunnel", "start"), ("tunnel", "end")], kinds
    end = feed.events[-1][1]
    tunnel_id = end["run_id"]
    assert tunnel_id.startswith("tun-") and feed.events[0][1]["run_id"] == tunnel_id
    assert end["run_id"] == tunnel_id and end["status"] == "complete" and end["usage"]["output_tokens"] > 0
    labels = {"node": "gpu", "model_group": "gpt", "provider": "openai", "key": "anonymous"}
    assert metric(edge, "iop_edge_tokens_total", kind="output", **labels) == end["usage"]["output_tokens"]
    assert metric(edge, "iop_edge_run_terminals_total", type="complete", kind="tunnel") == 1
    status, run = edge.json("GET", f"/v1/runs/{tunnel_id}")
    assert (run["kind"], run["status"], run["usage"]) == ("tunnel", "complete", end["usage"])
    [row] = wait_for(lambda: [r for r in store_rows(node_daemon) if r["status"] == "complete"], what="the row")
    assert (row["run_id"], row["kind"], row["target"]) == (tunnel_id, "tunnel", "fake-model")
    assert json.loads(row["usage"]) == end["usage"] and row["bytes"] == len(raw)


class RunReader:
    """
    `GET /v1/runs/{id}/events` read on a thread: every `(id, payload)`
    until the stream ends.
    """

    def __init__(self, edge, run_id):
        self.events = []
        self.ended = threading.Event()
        self.conn = http.client.HTTPConnection("127.0.0.1", edge.http_port, timeout=60)
        self.conn.request("GET", f"/v1/runs/{run_id}/events")
        self.response = self.conn.getresponse()
        assert self.response.status == 200
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        try:
            buffer, event_id = b"", None
            while data := self.response.read1(65536):
                buffer += data
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    if line.startswith(b"id: "):
                        event_id = int(line[4:])
                    elif line.startswith(b"data: "):
                        self.events.append((event_id, json.loads(line[6:])))
        except (OSError, ValueError, http.client.HTTPException):
            pass
        finally:
            self.ended.set()
            self.conn.close()


def test_background_run_survives_a_cut_link(launch):
    """
    A background run whose Node's link is cut for a few seconds (a frozen
    proxy: no FIN, no RST) goes on on the Node; when the Node is back it
    reports the run, the Edge takes it back, and a reader that followed it
    all along gets the whole stream: every seq once, in order, the text
    equal to the input.
    """
    edge = launch.edge({"nodes": [echo_node("node-1", "tok-1", delay_ms=150)]})
    proxy = FreezableProxy(edge.node_port)
    try:
        launch.node(proxy.port, "tok-1", reconnect={"max_attempts": 0, "interval_sec": 0.5})
        edge.wait_connected("node-1")
        text = " ".join(f"w{i}" for i in range(70))
        status, run = edge.json(
            "POST", "/v1/runs", {"adapter": "echo", "input": text, "stream": False, "background": True}
        )
        assert status == 202, run
        reader = RunReader(edge, run["id"])
        wait_for(lambda: len(reader.events) >= 3, what="the first events")
        proxy.freeze()
        edge.wait_connected("node-1", connected=False, timeout=10)
        assert run_state(edge, run["id"])["status"] == "running"
        proxy.heal()
        edge.wait_connected("node-1", timeout=30)
        assert reader.ended.wait(30), reader.events[-3:]
    finally:
        proxy.close()
    seqs = [seq for seq, _ in reader.events]
    assert seqs == list(range(1, len(seqs) + 1)), seqs
    assert "".join(p.get("text", "") for _, p in reader.events) == text
    assert reader.events[-1][1]["type"] == "complete"
    final = run_state(edge, run["id"])
    assert (final["status"], final["output"]) == ("complete", text)
    assert "taken back" in edge.output()
