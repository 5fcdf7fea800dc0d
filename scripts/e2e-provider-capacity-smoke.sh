#!/usr/bin/env bash
# Provider capacity smoke test on real processes: two model names over one
# capacity-1 provider on a real Node. Concurrent requests must run one at a
# time (the provider's in_use never exceeds 1, the others wait in their
# queue), all complete, and every counter ends at 0.
#
#   scripts/e2e-provider-capacity-smoke.sh        (after `make install`)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
exec "$PY" - <<'PYEOF'
import json
import sys
import tempfile
import threading

sys.path.insert(0, "tests")  # the process harness: tests/support/ (cwd is the repo root)
from support.daemons import Launcher, echo_node, sse_events

workdir = tempfile.mkdtemp(prefix="iop-smoke-")
node_conf = echo_node("gpu-box", "smoke-token", delay_ms=30,
                      providers=[{"id": "gpu", "adapter": "echo", "capacity": {"normal": 1, "long": 0}}])
groups = [{"name": name, "providers": [{"node": "gpu-box", "provider": "gpu", "target": name}], "queue_timeout_sec": 60}
          for name in ("model-small", "model-large")]
launcher = Launcher(workdir)
results, peak = [], {"in_use": 0, "queued": 0}
try:
    edge = launcher.edge({"nodes": [node_conf], "model_groups": groups})
    launcher.node(edge.node_port, "smoke-token")
    edge.wait_connected("gpu-box")

    def request(model, text):
        conn, response = edge.stream("POST", "/v1/chat/completions",
                                     {"model": model, "stream": True, "messages": [{"role": "user", "content": text}]}, timeout=120)
        chunks = [p for p in sse_events(response)]
        conn.close()
        text_out = "".join(c["choices"][0]["delta"].get("content", "") for c in map(json.loads, chunks[:-1]) if c["choices"])
        results.append((model, response.status, text_out == text, chunks[-1] == "[DONE]"))

    threads = [threading.Thread(target=request, args=(m, f"request {i} for {m} " * 5))
               for i in range(3) for m in ("model-small", "model-large")]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        status = edge.status()
        provider = status["nodes"][0]["providers"][0]
        peak["in_use"] = max(peak["in_use"], provider["in_use"]["normal"])
        peak["queued"] = max(peak["queued"], sum(g["queued"] for g in status["model_groups"]))
        for t in threads:
            t.join(timeout=0.02)
    final = edge.status()
    provider = final["nodes"][0]["providers"][0]
    print(f"requests: {len(results)}, all ok: {all(r[1] == 200 and r[2] and r[3] for r in results)}")
    print(f"peak in_use: {peak['in_use']} (capacity 1), peak queued: {peak['queued']}")
    print(f"final in_use: {provider['in_use']}, final queued: {[g['queued'] for g in final['model_groups']]}")
    assert len(results) == 6 and all(r[1] == 200 and r[2] and r[3] for r in results), results
    assert peak["in_use"] == 1, peak
    assert peak["queued"] >= 1, peak
    assert provider["in_use"] == {"normal": 0, "long": 0}
    assert all(g["queued"] == 0 for g in final["model_groups"])
    print("provider capacity smoke: OK")
finally:
    launcher.stop_all()
PYEOF
