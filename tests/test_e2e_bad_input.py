"""
Bad input against real daemons: garbage on the Node port and malformed
HTTP bodies each hurt only their own connection or request, and the
Edge keeps serving the real Node. Every loop is bounded; everything talks
to loopback only.
"""

import json
import random
import socket
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.daemons import Launcher, echo_node, wait_for
from support.probes import closed_by_peer, frame, still_serving

from iop.protocols import messages
from iop.protocols.wire import MAX_FRAME_BYTES, WIRE_VERSION


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    launcher = Launcher(str(tmp_path_factory.mktemp("bad-input")))
    try:
        edge = launcher.edge({"nodes": [echo_node("node-1", "tok-1")]})
        launcher.node(edge.node_port, "tok-1")
        edge.wait_connected("node-1")
        yield edge
    finally:
        launcher.stop_all()


BAD_STREAMS = {
    "garbage frame": struct.pack("!I", 5) + b"\xff\xff\xff\xff\x0f",
    "oversize header": struct.pack("!I", MAX_FRAME_BYTES + 1),
    "empty envelope": struct.pack("!I", 0),
    "work before registering": frame(messages.run_event("x", 0, "delta")),
    "ready before registering": frame(messages.ready_request(node_id="node-1")),
    "unknown token": frame(messages.register_request("nope", WIRE_VERSION)),
    "duplicate of a live node": frame(messages.register_request("tok-1", WIRE_VERSION)),
}


@pytest.mark.parametrize("name", sorted(BAD_STREAMS))
def test_bad_frames_close_only_their_connection(served, name):
    """
    Each kind of bad input on the Node port closes that one connection;
    the registered Node stays connected and serves.
    """
    with socket.create_connection(("127.0.0.1", served.node_port), timeout=5) as sock:
        sock.sendall(BAD_STREAMS[name])
        assert closed_by_peer(sock), f"{name}: the Edge kept the connection open"
    assert served.node_connected("node-1")
    assert still_serving(served)


def test_random_bytes_fuzz(served):
    """
    A bounded number of connections sending random bytes never disturb the
    registered Node.
    """
    rng = random.Random(1234)
    for _ in range(40):
        with socket.create_connection(("127.0.0.1", served.node_port), timeout=5) as sock:
            payload = bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 512)))
            try:
                sock.sendall(payload)
            except OSError:
                pass
    wait_for(lambda: served.node_connected("node-1"), what="node-1 still connected")
    assert still_serving(served)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=12,
)
chat_bodies = st.fixed_dictionaries(
    {},
    optional={
        "model": st.one_of(st.just("echo"), json_values),
        "messages": st.one_of(
            st.lists(st.fixed_dictionaries({"role": json_values, "content": json_values}), max_size=3), json_values
        ),
        "stream": json_values,
        "stream_options": json_values,
    },
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=chat_bodies)
def test_malformed_chat_bodies_get_4xx(served, body):
    """
    Random, mostly malformed chat bodies are answered with a 2xx or a 4xx
    in OpenAI error form, never a server error.
    """
    status, headers, data = served.request("POST", "/v1/chat/completions", json.dumps(body).encode())
    assert status < 500, (body, data)
    if status >= 400:
        assert "error" in json.loads(data)


def test_non_json_bodies(served):
    """
    Bodies that are not JSON objects get 400 invalid_json.
    """
    for raw in (b"", b"[]", b"null", b"{", b"\xff\xfe", b'"text"'):
        status, _, data = served.request("POST", "/v1/runs", raw)
        if raw == b"":
            assert status == 400
            continue
        assert status == 400, raw
        assert json.loads(data)["error"]["code"] == "invalid_json"
    assert still_serving(served)
