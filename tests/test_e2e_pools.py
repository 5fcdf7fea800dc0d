"""
Provider pools with real processes: shared capacity, the wait queue, and
a waiter that survives the death of one of two Nodes and is served exactly
once when that Node comes back.
"""

import json
import signal
import threading

from support.daemons import echo_node, sse_events, wait_for


def two_node_edge(delay_ms):
    nodes = [
        echo_node(
            n,
            f"tok-{n}",
            delay_ms=delay_ms,
            providers=[{"id": "gpu", "adapter": "echo", "capacity": {"normal": 1, "long": 0}}],
        )
        for n in ("a", "b")
    ]
    groups = [
        {
            "name": "chat",
            "providers": [
                {"node": "a", "provider": "gpu", "target": "m"},
                {"node": "b", "provider": "gpu", "target": "m"},
            ],
            "queue_timeout_sec": 60,
        }
    ]
    return {"nodes": nodes, "model_groups": groups}


class Stream(threading.Thread):
    """
    One native run streamed in the background; keeps every event.
    """

    def __init__(self, edge, body):
        super().__init__(daemon=True)
        self.edge = edge
        self.body = body
        self.events = []
        self.status = None
        self.started = threading.Event()

    def run(self):
        conn, response = self.edge.stream("POST", "/v1/runs", self.body, timeout=90)
        self.status = response.status
        if response.status != 200:
            self.events.append({"type": "http_error", "status": response.status, "body": response.read().decode()})
        try:
            for payload in sse_events(response):
                self.events.append(json.loads(payload))
                self.started.set()
        finally:
            conn.close()
            self.started.set()

    def types(self):
        return [e["type"] for e in self.events]


def providers(edge):
    return {(n["id"], p["id"]): p for n in edge.status()["nodes"] for p in n["providers"]}


def queued(edge, group="chat"):
    return {g["name"]: g["queued"] for g in edge.status()["model_groups"]}[group]


def test_waiter_survives_node_death_and_is_served_once(launch):
    """
    Both providers busy, a third request queues. Killing one Node errors
    its run but keeps the waiter (the other Node is live). Restarting it
    serves the waiter exactly once on its ready; afterwards every counter
    is 0.
    """
    edge = launch.edge(two_node_edge(delay_ms=60))
    node_a = launch.node(edge.node_port, "tok-a")
    launch.node(edge.node_port, "tok-b")
    edge.wait_connected("a")
    edge.wait_connected("b")
    busy = [Stream(edge, {"model": "chat", "input": "w " * 150, "stream": True}) for _ in range(2)]
    for s in busy:
        s.start()
    wait_for(lambda: all(p["in_use"]["normal"] == 1 for p in providers(edge).values()), what="both providers busy")
    waiter = Stream(edge, {"model": "chat", "input": "the waiter", "stream": True})
    waiter.start()
    wait_for(lambda: queued(edge) == 1, what="the third request to queue")

    node_a.stop(signal.SIGKILL)
    wait_for(lambda: any(s.types() and s.types()[-1] == "error" for s in busy), what="a's run to error")
    assert queued(edge) == 1, "the waiter must keep waiting while b is live"
    assert {e["type"] for e in waiter.events} <= {"queued"}, "the waiter is told only of its place"

    node_a = launch.node(edge.node_port, "tok-a")
    waiter.join(timeout=30)
    assert not waiter.is_alive()
    told = [e for e in waiter.events if e["type"] == "queued"]
    assert told and all(e["position"] == 1 for e in told)
    types = [t for t in waiter.types() if t != "queued"]
    assert types[0] == "start" and types[-1] == "complete"
    assert sum(1 for t in types if t in ("complete", "error", "cancelled")) == 1
    assert "".join(e.get("text", "") for e in waiter.events) == "the waiter"
    for s in busy:
        s.join(timeout=60)
    wait_for(
        lambda: all(p["in_use"] == {"normal": 0, "long": 0} for p in providers(edge).values()) and queued(edge) == 0,
        what="all counters back to 0",
    )


def one_busy_provider(launch, delay_ms, queue_timeout_sec, names=("chat",)):
    """
    Model groups C{names} over one capacity-1 provider on node "a", with
    its slot taken by a 30-word run of the first group in the background.
    """
    node = echo_node(
        "a",
        "tok-a",
        delay_ms=delay_ms,
        providers=[{"id": "gpu", "adapter": "echo", "capacity": {"normal": 1, "long": 0}}],
    )
    groups = [
        {
            "name": name,
            "providers": [{"node": "a", "provider": "gpu", "target": name}],
            "queue_timeout_sec": queue_timeout_sec,
        }
        for name in names
    ]
    edge = launch.edge({"nodes": [node], "model_groups": groups})
    launch.node(edge.node_port, "tok-a")
    edge.wait_connected("a")
    busy = Stream(edge, {"model": names[0], "input": "w " * 30, "stream": True})
    busy.start()
    wait_for(lambda: providers(edge)[("a", "gpu")]["in_use"]["normal"] == 1, what="the slot taken")
    return edge, busy


def test_shared_capacity_two_model_names(launch):
    """
    Two model names over one capacity-1 provider: concurrent requests run
    one at a time (the second waits in the queue), both complete, and the
    counters end at 0.
    """
    edge, first = one_busy_provider(launch, delay_ms=40, queue_timeout_sec=30, names=("small", "large"))
    second = Stream(edge, {"model": "large", "input": "y " * 5, "stream": True})
    second.start()
    wait_for(lambda: queued(edge, "large") == 1, what="the second to wait")
    assert providers(edge)[("a", "gpu")]["in_use"]["normal"] == 1
    first.join(timeout=30)
    second.join(timeout=30)
    assert first.types()[-1] == "complete" and second.types()[-1] == "complete"
    assert providers(edge)[("a", "gpu")]["in_use"] == {"normal": 0, "long": 0}


def test_no_live_provider_is_503_at_once(launch):
    """
    With every provider's node offline, a request is refused with 503 at
    once (never queued), in OpenAI error form naming the model group.
    """
    edge = launch.edge(two_node_edge(delay_ms=0))
    status, body = edge.json(
        "POST", "/v1/chat/completions", {"model": "chat", "messages": [{"role": "user", "content": "x"}]}
    )
    assert status == 503
    assert "chat" in body["error"]["message"]
    nodes = edge.status()["nodes"]
    assert [n["connected"] for n in nodes] == [False, False]
    assert all(p["status"] == "unavailable" and p["health"] == "offline" for n in nodes for p in n["providers"])


def test_queue_timeout_is_429(launch):
    """
    A waiter whose queue timeout passes gets HTTP 429 naming the group.
    """
    edge, busy = one_busy_provider(launch, delay_ms=100, queue_timeout_sec=0.5)
    status, body = edge.json(
        "POST", "/v1/chat/completions", {"model": "chat", "messages": [{"role": "user", "content": "x"}]}
    )
    assert status == 429
    assert "chat" in body["error"]["message"]
    busy.join(timeout=30)


def test_waiter_leaves_queue_when_caller_goes(launch):
    """
    A queued caller that disconnects leaves the queue at once; the run it
    would have started never happens.
    """
    edge, busy = one_busy_provider(launch, delay_ms=50, queue_timeout_sec=60)
    conn, _ = edge.stream_request("POST", "/v1/runs", {"model": "chat", "input": "never", "stream": True})
    wait_for(lambda: queued(edge) == 1, what="the waiter to queue")
    conn.sock.close()
    conn.close()
    wait_for(lambda: queued(edge) == 0, timeout=5, what="the waiter to leave")
    busy.join(timeout=30)
    assert busy.types()[-1] == "complete"
    assert providers(edge)[("a", "gpu")]["in_use"] == {"normal": 0, "long": 0}
