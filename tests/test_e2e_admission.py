"""
One admission ledger and a truthful control plane, on real processes: the
shipped configuration under a burst, an explicit node, node commands
(unknown, a slow streamed model pull, a caller who leaves), and a config
refresh the Node refuses.
"""

import json
import os
import signal
import threading

import yaml
from support.daemons import echo_node, sse_events, wait_for

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ADMIN = {"authorization": "Bearer adm"}


def completion(edge, text, results, index):
    """
    Stream one chat completion to its end; store its whole text (or the
    error) in C{results[index]}.
    """
    body = {"model": "echo-model", "stream": True, "messages": [{"role": "user", "content": text}]}
    conn, response = edge.stream("POST", "/v1/chat/completions", body, timeout=60)
    try:
        if response.status != 200:
            results[index] = ("error", response.status, response.read())
            return
        payloads = list(sse_events(response))
        chunks = [json.loads(p) for p in payloads[:-1]]
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
        results[index] = ("ok", payloads[-1], text)
    finally:
        conn.close()


def test_shipped_config_burst(launch):
    """
    conf/edge.yaml as shipped: one long request, four normal ones and one
    more at once all complete whole — the ones that do not fit wait in the
    queue instead of being refused by the Node's gate (HTTP 429).
    """
    with open(os.path.join(ROOT, "conf", "edge.yaml")) as f:
        config = yaml.safe_load(f)
    config.pop("manhole", None)
    edge = launch.edge(config)
    launch.node(edge.node_port, "demo-node-token")
    edge.wait_connected("node-1")
    long_text = "x" * 4100
    normal_text = " ".join(f"w{i}" for i in range(12))
    texts = [long_text] + [normal_text] * 5
    results = [None] * len(texts)
    threads = [threading.Thread(target=completion, args=(edge, t, results, i)) for i, t in enumerate(texts)]
    for thread in threads:
        thread.start()
    try:
        queued = wait_for(
            lambda: edge.status()["model_groups"][0]["queued"] >= 1 and edge.status(), what="a request to wait"
        )
    finally:
        for thread in threads:
            thread.join(timeout=60)
    assert queued["model_groups"][0]["queued"] >= 1
    assert [r[0] for r in results] == ["ok"] * len(texts), results
    assert all(r[1] == "[DONE]" for r in results)
    assert [r[2] for r in results] == texts
    (provider,) = edge.status()["nodes"][0]["providers"]
    assert provider["in_use"] == {"normal": 0, "long": 0}


def test_explicit_node_honoured(launch):
    """
    A native run naming a model group and a node runs on that node, even
    when the pool would pick the other.
    """
    providers = [{"id": "echo", "adapter": "echo", "capacity": {"normal": 2}}]
    nodes = [echo_node(n, f"tok-{n}", delay_ms=200, providers=providers) for n in ("a", "b")]
    group = {"name": "g", "providers": [{"node": n, "provider": "echo"} for n in ("a", "b")]}
    edge = launch.edge({"nodes": nodes, "model_groups": [group]})
    for n in ("a", "b"):
        launch.node(edge.node_port, f"tok-{n}")
        edge.wait_connected(n)
    body = {"model": "g", "node": "b", "input": "one two three four five", "stream": True}
    conn, response = edge.stream("POST", "/v1/runs", body)
    try:
        assert response.status == 200
        in_use = {n["id"]: n["providers"][0]["in_use"]["normal"] for n in edge.status()["nodes"]}
        assert in_use == {"a": 0, "b": 1}
        events = [json.loads(p) for p in sse_events(response)]
    finally:
        conn.close()
    assert events[-1]["type"] == "complete"
    status, body = edge.json("POST", "/v1/runs", {"model": "g", "node": "nope", "input": "x", "stream": False})
    assert status == 404, body


def test_node_commands(launch, fake_provider):
    """
    An unknown command is the caller's mistake (400 `unknown_command`). A
    model pull that takes longer than the short command timeout completes,
    streaming Ollama's progress; a caller who leaves a pull cancels it at
    the provider.
    """
    ollama = fake_provider("ollama", delay_ms=300)
    node = {
        "id": "gpu",
        "token": "tok-gpu",
        "adapters": [{"name": "ollama", "type": "ollama", "max_concurrency": 2, "base_url": ollama.url()}],
    }
    edge = launch.edge({"nodes": [node], "admin_keys": ["adm"], "commands": {"timeout_sec": 1}})
    launch.node(edge.node_port, "tok-gpu")
    edge.wait_connected("gpu")
    commands = "/v1/nodes/gpu/commands"

    status, body = edge.json("POST", commands, {"command": "frobnicate", "adapter": "ollama"}, ADMIN)
    assert (status, body["error"]["code"]) == (400, "unknown_command"), body

    pull = {"command": "ollama_pull", "adapter": "ollama", "args": {"model": "slow-model"}, "stream": True}
    conn, response = edge.stream("POST", commands, pull, ADMIN)
    try:
        assert response.status == 200
        assert response.getheader("content-type") == "text/event-stream"
        events = [json.loads(p) for p in sse_events(response)]
    finally:
        conn.close()
    progress = [e["completed"] for e in events if "completed" in e]
    assert progress == list(range(10, 101, 10))
    assert events[-1]["done"] is True and events[-1]["result"]["status"] == "success"

    before = ollama.stats()["closed_early"]
    conn, response = edge.stream("POST", commands, pull, ADMIN)
    try:
        assert response.status == 200
        events = sse_events(response)
        next(events)
        next(events)
    finally:
        conn.close()
    wait_for(lambda: ollama.stats()["closed_early"] > before, what="the pull to be cancelled at the provider")


def test_refused_refresh_shows_in_status(launch):
    """
    A reload whose new adapter the Node cannot build is refused by the
    Node: the Edge logs the Node's reason and /v1/status shows it, with
    the adapters the node still runs.
    """
    edge = launch.edge({"nodes": [echo_node("node-1", "tok-1")], "admin_keys": ["adm"]})
    launch.node(edge.node_port, "tok-1")
    edge.wait_connected("node-1")
    # A CLI adapter whose command is not installed on the Node passes the
    # Edge's checks (which cannot know that) but cannot start there.
    agent = {"name": "agent", "type": "cli", "max_concurrency": 1, "command": ["iop-no-such-command-xyz"]}
    edge.config["nodes"][0]["adapters"].append(agent)
    edge.rewrite_config()
    edge.process.send_signal(signal.SIGHUP)
    node = wait_for(
        lambda: (n := edge.status()["nodes"][0]).get("config_refresh", {}).get("state") == "refused" and n,
        what="the refused refresh in the status",
    )
    assert "agent" in node["config_refresh"]["reason"]
    assert [a["name"] for a in node["adapters"]] == ["echo"]
    assert "refused its config refresh" in edge.output()
