"""
A logical session belongs to the caller key whose run first used it
(docs/edge.md, "Isolation"), on real processes: another key can neither
end it nor run on it, and the session's command-line process keeps going.
"""

import json
import os
import sys

from support.daemons import FAKE_CLI, sse_events, wait_for

ALICE = {"authorization": "Bearer sk-alice"}
BOB = {"authorization": "Bearer sk-bob"}
TERMINATE = {"node": "gpu", "adapter": "agent", "session_id": "s-alice"}


def _running(pid):
    """
    Whether process C{pid} runs (it exists and has not exited).
    """
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_another_key_cannot_end_or_use_a_session(launch, tmp_path):
    """
    Alice's run holds session s-alice's process: Bob's terminate is 404
    `unknown_session` and the process lives on; Bob's run on the session
    fails `session_owned` without reaching the tool; Alice's own terminate
    then ends her run `session_terminated`.
    """
    pidfile = str(tmp_path / "cli.pid")
    node = {
        "id": "gpu",
        "token": "tok-gpu",
        "adapters": [
            {
                "name": "agent",
                "type": "cli",
                "max_concurrency": 2,
                "command": [sys.executable, FAKE_CLI],
                "env": {"FAKE_CLI_PIDFILE": pidfile, "FAKE_CLI_DELAY": "0.2"},
                "sessions": True,
                "grace_sec": 1,
            }
        ],
        "providers": [{"id": "agent", "adapter": "agent"}],
    }
    edge = launch.edge(
        {
            "api_keys": [{"key": "sk-alice", "name": "alice"}, {"key": "sk-bob", "name": "bob"}],
            "nodes": [node],
            "model_groups": [{"name": "agent", "providers": [{"node": "gpu", "provider": "agent"}]}],
        }
    )
    launch.node(edge.node_port, "tok-gpu")
    edge.wait_connected("gpu")
    run = {"adapter": "agent", "node": "gpu", "input": "w " * 100, "session_id": "s-alice", "stream": True}
    conn, response = edge.stream("POST", "/v1/runs", run, ALICE)
    try:
        events = sse_events(response)
        json.loads(next(events))
        wait_for(lambda: os.path.exists(pidfile) and open(pidfile).read(), what="the process to start")
        pid = int(open(pidfile).read())

        status, body = edge.json("POST", "/v1/sessions/terminate", TERMINATE, BOB)
        assert (status, body["terminated"], body["error"]["code"]) == (404, False, "unknown_session"), body
        assert _running(pid)

        bobs = edge.run_events(dict(run, input="what did she say?"), BOB)
        assert [(e["type"], e["error"]["code"]) for e in bobs] == [("error", "session_owned")], bobs
        assert int(open(pidfile).read()) == pid and _running(pid)

        status, body = edge.json("POST", "/v1/sessions/terminate", TERMINATE, ALICE)
        assert (status, body["terminated"]) == (200, True), body
        rest = [json.loads(p) for p in events]
    finally:
        conn.close()
    assert (rest[-1]["type"], rest[-1]["error"]["code"]) == ("error", "session_terminated"), rest[-1]
