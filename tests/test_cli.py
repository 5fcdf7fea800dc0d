"""
The `iop` command line against real daemons: every command as a separate
`iop` process, its --json output parsed and checked, its tables naming
the nodes, streaming as the answer arrives, and one-line errors with
distinct exit statuses.
"""

import hashlib
import json
import os
import select
import subprocess
import sys
import threading
import time

import pytest
from support.daemons import echo_node, free_port, wait_for

IOP = os.path.join(os.path.dirname(sys.executable), "iop")
TEXT = "the quick brown fox jumps over the lazy dog"

# The command line's exit statuses (iop.cli.client).
FAILED, AUTH, NOT_FOUND, UNREACHABLE = 1, 4, 5, 3


@pytest.fixture
def edge(launch):
    """
    An Edge with keys, a connected echo node (node-1), a configured node
    that never connects (node-2) and a model group on node-1.
    """
    edge = launch.edge(
        {
            "nodes": [echo_node("node-1", "tok-1", delay_ms=100), echo_node("node-2", "tok-2")],
            "model_groups": [{"name": "echo-model", "providers": [{"node": "node-1", "provider": "echo"}]}],
            "api_keys": ["caller"],
            "admin_keys": ["adm"],
        }
    )
    launch.node(edge.node_port, "tok-1")
    wait_for(lambda: edge.status_with("caller")["nodes"][0]["connected"], what="node-1 to connect")
    return edge


def environment(edge, **extra):
    env = dict(os.environ, IOP_EDGE=edge.base_url, IOP_API_KEY="caller", IOP_ADMIN_KEY="adm", COLUMNS="160")
    for name in ("IOP_API_KEY", "IOP_ADMIN_KEY"):
        if extra.get(name) is None and name in extra:
            del env[name]
    env.update({k: v for k, v in extra.items() if v is not None})
    return env


def iop(edge, *args, stdin=None, **env):
    return subprocess.run(
        [IOP, *args], env=environment(edge, **env), input=stdin, capture_output=True, text=True, timeout=60
    )


def one_line_error(result, code, words):
    assert result.returncode == code, (result.returncode, result.stdout, result.stderr)
    assert result.stderr.count("\n") == 1, result.stderr
    assert words in result.stderr, result.stderr


def test_status_json_and_tables(edge):
    """
    `iop --json status` is the Edge's snapshot; `iop status` shows the
    nodes with their state, the providers and the model group.
    """
    result = iop(edge, "--json", "status")
    assert result.returncode == 0, result.stderr
    status = json.loads(result.stdout)
    nodes = {n["id"]: n for n in status["nodes"]}
    assert nodes["node-1"]["connected"] and not nodes["node-2"]["connected"]
    assert status["model_groups"] == [{"name": "echo-model", "queued": 0}]

    table = iop(edge, "status")
    assert table.returncode == 0, table.stderr
    for words in ("node-1", "node-2", "ready", "offline", "never connected", "0/4", "echo-model"):
        assert words in table.stdout


def test_nodes(edge):
    """
    `iop nodes` lists every configured node; --json after the command
    works too.
    """
    result = iop(edge, "nodes", "--json")
    assert result.returncode == 0, result.stderr
    assert [n["id"] for n in json.loads(result.stdout)] == ["node-1", "node-2"]
    table = iop(edge, "nodes")
    assert "node-1" in table.stdout and "node-2" in table.stdout


def test_status_watch(edge):
    """
    `iop status --watch --json` prints a fresh snapshot per interval until
    stopped.
    """
    process = subprocess.Popen(
        [IOP, "status", "--watch", "--json", "--interval", "0.2"],
        env=environment(edge),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        snapshots = [json.loads(process.stdout.readline()) for _ in range(3)]
    finally:
        process.terminate()
        process.wait(timeout=10)
    assert all(s["nodes"][0]["id"] == "node-1" for s in snapshots)


def test_status_watch_not_on_a_terminal(edge):
    """
    `iop status --watch` into a pipe prints each view after the last (a
    redraw in place would show nothing until it stops).
    """
    process = subprocess.Popen(
        [IOP, "status", "--watch", "--interval", "0.2"], env=environment(edge), stdout=subprocess.PIPE
    )
    output = b""
    deadline = time.monotonic() + 20
    try:
        while output.count(b"Ctrl-C to stop") < 2 and time.monotonic() < deadline:
            ready, _, _ = select.select([process.stdout], [], [], max(deadline - time.monotonic(), 0))
            if ready:
                chunk = os.read(process.stdout.fileno(), 65536)
                assert chunk, "the output ended"
                output += chunk
    finally:
        process.terminate()
        process.wait(timeout=10)
    assert output.count(b"Ctrl-C to stop") >= 2, output
    assert b"node-1" in output


def test_chat_streams(edge):
    """
    `iop chat` prints the answer as it arrives: the first words are on
    stdout while the (slow) completion is still running, and the whole
    text ends with a newline.
    """
    process = subprocess.Popen(
        [IOP, "chat", "echo-model", TEXT],
        env=environment(edge),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        first = process.stdout.read1(1024)
        assert first and TEXT.startswith(first.decode())
        assert process.poll() is None, "the whole answer came at once"
        rest = process.stdout.read()
        assert process.wait(timeout=30) == 0, process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert (first + rest).decode() == TEXT + "\n"


def test_chat_json(edge):
    """
    `iop chat --json` gives one document with the text and the usage.
    """
    result = iop(edge, "chat", "echo", TEXT, "--json")
    assert result.returncode == 0, result.stderr
    answer = json.loads(result.stdout)
    assert answer["text"] == TEXT and answer["finish_reason"] == "stop"
    assert answer["usage"]["completion_tokens"] == len(TEXT.split())


def test_chat_unknown_model(edge):
    """
    An unknown model is a one-line "not found" with its exit status.
    """
    one_line_error(iop(edge, "chat", "no-such-model", "hi"), NOT_FOUND, "no-such-model")


def test_node_command(edge):
    """
    `iop node N command NAME` runs a node command with the admin key; the
    JSON answer names the node's adapters, the human one shows them.
    """
    result = iop(edge, "--json", "node", "node-1", "command", "capabilities")
    assert result.returncode == 0, result.stderr
    answer = json.loads(result.stdout)
    assert answer["node"] == "node-1"
    assert [a["name"] for a in answer["result"]["adapters"]] == ["echo"]
    human = iop(edge, "node", "node-1", "command", "usage_status", "--adapter", "echo")
    assert human.returncode == 0 and "echo" in human.stdout


def test_node_command_errors(edge):
    """
    An unknown node, a node that is not connected, no admin key and a
    caller key used as admin key each give one line and their own status.
    """
    one_line_error(iop(edge, "node", "nope", "command", "capabilities"), NOT_FOUND, "no node 'nope'")
    one_line_error(iop(edge, "node", "node-2", "command", "capabilities"), FAILED, "node-2 is not connected")
    one_line_error(iop(edge, "node", "node-1", "command", "capabilities", IOP_ADMIN_KEY=None), AUTH, "IOP_ADMIN_KEY")
    one_line_error(iop(edge, "node", "node-1", "command", "capabilities", "--admin-key", "caller"), AUTH, "403")


def test_bad_key_and_unreachable(edge):
    """
    A refused caller key exits 4 and an Edge that is not there exits 3,
    each with one line.
    """
    one_line_error(iop(edge, "status", "--key", "wrong"), AUTH, "401")
    one_line_error(iop(edge, "status", IOP_API_KEY=None, IOP_ADMIN_KEY=None), AUTH, "401")
    port = free_port()
    one_line_error(iop(edge, "status", "--edge", f"http://127.0.0.1:{port}"), UNREACHABLE, "connection refused")


def test_token_hash(edge):
    """
    `iop token-hash` reads the token from stdin and prints its SHA-256,
    the form edge.yaml takes as token_sha256.
    """
    result = iop(edge, "token-hash", stdin="tok-1\n")
    assert result.stdout.strip() == hashlib.sha256(b"tok-1").hexdigest()


def test_events(edge):
    """
    `iop events --type run --node node-1` tails the events feed with the
    admin key: one line per event, naming its topic, type, node and run.
    Without an admin key it is a one-line refusal.
    """
    process = subprocess.Popen(
        [IOP, "events", "--type", "run", "--node", "node-1"],
        env=environment(edge),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    stop = threading.Event()

    def runs():
        # Until the feed has shown one whole run: the first may start
        # before `iop events` is connected.
        while not stop.is_set():
            edge.run_events({"adapter": "echo", "input": "hi"}, headers={"authorization": "Bearer caller"})

    worker = threading.Thread(target=runs, daemon=True)
    worker.start()
    deadline = threading.Timer(30, process.terminate)
    deadline.start()
    started, lines, words, line = {}, [], {}, ""
    try:
        for line in process.stdout:
            lines.append(line)
            words = dict(w.split("=", 1) for w in line.split()[2:] if "=" in w)
            if words.get("type") == "start":
                started[words["run_id"]] = line
            elif words.get("type") == "complete" and words.get("run_id") in started:
                break
    finally:
        deadline.cancel()
        stop.set()
        process.terminate()
        process.wait(timeout=10)
        worker.join(10)
    assert words.get("run_id") in started, lines
    assert " run type=start node=node-1 run_id=run-" in started[words["run_id"]], lines
    assert " run type=complete node=node-1 run_id=" + words["run_id"] in line, lines
    one_line_error(iop(edge, "events", IOP_ADMIN_KEY=None), AUTH, "IOP_ADMIN_KEY")


def test_pull_streams_progress(launch, fake_provider):
    """
    `iop pull N MODEL` finds the node's Ollama adapter and pulls through
    the streamed node command: the human form ends with the pull's final
    status, `--json` prints each progress event as a JSON line, the last
    one the terminal.
    """
    ollama = fake_provider("ollama")
    node = echo_node("gpu", "tok")
    node["adapters"].append({"name": "ollama", "type": "ollama", "max_concurrency": 1, "base_url": ollama.url()})
    edge = launch.edge({"nodes": [node], "admin_keys": ["adm"]})
    launch.node(edge.node_port, "tok")
    edge.wait_connected("gpu")
    result = iop(edge, "pull", "gpu", "llama3.2:3b")
    assert result.returncode == 0, result.stderr
    assert "pulled llama3.2:3b on gpu: success" in result.stdout
    lines = [json.loads(line) for line in iop(edge, "--json", "pull", "gpu", "llama3.2:3b").stdout.splitlines()]
    assert [line["completed"] for line in lines if "completed" in line] == list(range(10, 101, 10))
    assert lines[-1]["done"] is True and lines[-1]["result"]["status"] == "success"
    one_line_error(iop(edge, "pull", "nope", "x"), NOT_FOUND, "no node 'nope'")
