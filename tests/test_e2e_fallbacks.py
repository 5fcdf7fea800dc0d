"""
Fallbacks, priority and recovering health with real daemons: an Edge, a
Node and fake OpenAI-compatible providers (tests/support/fake_providers.py)
that answer, refuse (429 from C{error-model}) or are down (a closed port).

  - a model group whose providers fail before answering is served by its
    fallback group, and the answer names the model that served it;
  - a group prefers its priority-0 provider, whatever the load of the
    other;
  - with every provider of a group ejected, work still tries the one that
    failed longest ago (panic mode), and its first answer makes it healthy;
  - an ejected provider is probed and returns as soon as it answers
    again, long before its cooldown.

After every case no lease is held. (Each fake provider gets its own port:
two started with port 0 would share one port file.)
"""

import http.client
import json

import pytest
from support.daemons import free_port, wait_for

ADMIN = {"authorization": "Bearer admin"}


def chat(edge, model, stream=False):
    """
    One chat completion. @return: C{(status, body bytes)}.
    """
    conn = http.client.HTTPConnection("127.0.0.1", edge.http_port, timeout=30)
    try:
        body = {"model": model, "stream": stream, "messages": [{"role": "user", "content": "one two"}]}
        conn.request(
            "POST", "/v1/chat/completions", body=json.dumps(body), headers={"content-type": "application/json"}
        )
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def adapter(name, url, **options):
    return {"name": name, "type": "openai_compat", "max_concurrency": 2, "base_url": url, **options}


def start(launch, adapters, groups, health=None):
    node = {"id": "gpu", "token": "tok", "adapters": adapters, "providers": [{"id": a["name"]} for a in adapters]}
    config = {"nodes": [node], "model_groups": groups, "admin_keys": ["admin"]}
    if health is not None:
        config["health"] = health
    edge = launch.edge(config)
    launch.node(edge.node_port, "tok")
    edge.wait_connected("gpu")
    return edge


def providers(edge):
    return {p["id"]: p for p in edge.status()["nodes"][0]["providers"]}


def assert_at_rest(edge):
    wait_for(
        lambda: all(p["in_use"] == {"normal": 0, "long": 0} for p in providers(edge).values()),
        what="every lease to be back",
    )


def test_fallback_group_taken(launch, fake_provider):
    """
    C{main}'s provider is down and its other one answers 429: the work goes
    to C{small}'s provider, whose whole answer the caller gets, streamed
    or not; the non-streamed normalized view is not involved (a tunnel
    relays the fallback's own bytes, naming its model).
    """
    healthy = fake_provider("openai", delay_ms=5, port=free_port())
    refusing = fake_provider("openai", delay_ms=5, port=free_port())
    down = f"http://127.0.0.1:{free_port()}/v1"
    edge = start(
        launch,
        [adapter("down", down), adapter("busy", refusing.url("/v1")), adapter("small", healthy.url("/v1"))],
        [
            {
                "name": "main",
                "providers": [
                    {"node": "gpu", "provider": "down", "target": "fake-model"},
                    {"node": "gpu", "provider": "busy", "target": "error-model", "priority": 1},
                ],
                "fallbacks": ["small"],
            },
            {"name": "small", "providers": [{"node": "gpu", "provider": "small", "target": "slow-model"}]},
        ],
    )
    status, body = chat(edge, "main")
    assert status == 200, body
    answer = json.loads(body)
    assert (answer["model"], answer["choices"][0]["message"]["content"]) == ("slow-model", "one two")
    assert refusing.stats()["requests"] == 1
    status, body = chat(edge, "main", stream=True)
    assert status == 200 and body.rstrip().endswith(b"data: [DONE]"), body
    assert b'"error"' not in body
    metrics = edge.request("GET", "/metrics")[2].decode()
    assert 'iop_edge_fallbacks_total{fallback="small",model_group="main",reason="fallbacks"} 2.0' in metrics
    assert_at_rest(edge)


def test_priority_before_load(launch, fake_provider):
    """
    The priority-0 provider takes every request while it has room, though
    the priority-1 one (listed first) is idle.
    """
    first = fake_provider("openai", delay_ms=5, port=free_port())
    second = fake_provider("openai", delay_ms=5, port=free_port())
    edge = start(
        launch,
        [adapter("second", second.url("/v1")), adapter("first", first.url("/v1"))],
        [
            {
                "name": "m",
                "providers": [
                    {"node": "gpu", "provider": "second", "target": "fake-model", "priority": 1},
                    {"node": "gpu", "provider": "first", "target": "fake-model"},
                ],
            }
        ],
    )
    for _ in range(4):
        assert chat(edge, "m")[0] == 200
    assert (first.stats()["requests"], second.stats()["requests"]) == (4, 0)
    assert_at_rest(edge)


def test_panic_mode_then_back(launch, fake_provider):
    """
    The only provider of a group is down and ejected: requests still try
    it (the caller gets its failure, not a 503 for the whole cooldown), and
    once it is up the next request is answered and it is healthy again.
    """
    port = free_port()
    edge = start(
        launch,
        [adapter("a", f"http://127.0.0.1:{port}/v1")],
        [{"name": "m", "providers": [{"node": "gpu", "provider": "a", "target": "fake-model"}]}],
        health={"failures_to_eject": 2, "cooldown_sec": 600, "probe_interval_sec": 0},
    )
    for _ in range(2):
        assert chat(edge, "m")[0] == 502
    assert providers(edge)["a"]["health"] == "ejected"
    (group,) = edge.status()["model_groups"]
    assert group.get("panic") is True
    status, body = chat(edge, "m")
    assert (status, json.loads(body)["error"]["code"]) == (502, "provider_unreachable")
    fake_provider("openai", delay_ms=5, port=port)
    assert chat(edge, "m")[0] == 200
    assert providers(edge)["a"]["health"] == "ok"
    assert_at_rest(edge)


def test_probe_returns_provider(launch, fake_provider):
    """
    The priority-0 provider is down: work goes to the other one and it is
    ejected for a long cooldown. Once it is up again, a probe finds it and
    it serves again within seconds.
    """
    port = free_port()
    backup = fake_provider("openai", delay_ms=5)
    edge = start(
        launch,
        [adapter("primary", f"http://127.0.0.1:{port}/v1"), adapter("backup", backup.url("/v1"))],
        [
            {
                "name": "m",
                "providers": [
                    {"node": "gpu", "provider": "primary", "target": "fake-model"},
                    {"node": "gpu", "provider": "backup", "target": "fake-model", "priority": 1},
                ],
            }
        ],
        health={"failures_to_eject": 1, "cooldown_sec": 600, "probe_interval_sec": 0.5},
    )
    capabilities = edge.json("POST", "/v1/nodes/gpu/commands", {"command": "capabilities"}, ADMIN)[1]
    (primary,) = [a for a in capabilities["result"]["adapters"] if a["name"] == "primary"]
    if "probe" not in primary["commands"]:
        pytest.skip("this Node's HTTP adapters do not answer the probe command")
    assert chat(edge, "m")[0] == 200
    assert providers(edge)["primary"]["health"] == "ejected"
    revived = fake_provider("openai", delay_ms=5, port=port)
    wait_for(lambda: providers(edge)["primary"]["health"] == "ok", timeout=10, what="a probe to return the provider")
    assert providers(edge)["primary"]["probes"]["passed"] == 1
    before = revived.stats()["requests"]
    assert chat(edge, "m")[0] == 200
    assert revived.stats()["requests"] == before + 1
    assert_at_rest(edge)
