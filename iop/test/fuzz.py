"""
Shared pieces of the project's fuzz tests (hypothesis): how many examples
to run, and strategies for hostile JSON.

The short mode runs in C{make test}/C{trial iop}: a bounded number of
examples, derandomized so a failure reproduces. C{make fuzz} sets
C{IOP_FUZZ=long} for many more examples, bounded per test by wall-clock
time (C{IOP_FUZZ_SECONDS}, default 120) and, for the wire, by frames
(C{IOP_FUZZ_FRAMES}, default 1,000,000).
"""

import copy
import json
import os
import struct
import time
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from twisted.logger import ILogObserver, LogEvent, LogLevel, globalLogPublisher
from twisted.trial.unittest import SynchronousTestCase
from zope.interface import provider

from iop.protocols.wire import MAX_FRAME_BYTES

LONG = os.environ.get("IOP_FUZZ") == "long"

#: Wall-clock bound of one test in the long mode.
LONG_SECONDS = float(os.environ.get("IOP_FUZZ_SECONDS", "120"))
#: Frame bound of one wire test in the long mode.
LONG_FRAMES = int(os.environ.get("IOP_FUZZ_FRAMES", "1000000"))


def fuzz(strategy, check, short, batch=500):
    """
    Run C{check(value)} on values of C{strategy}: C{short} derandomized
    examples normally; with C{IOP_FUZZ=long}, batches of C{batch} random
    examples until L{LONG_SECONDS} have passed or the checks have counted
    L{LONG_FRAMES} frames (C{check} returns how many it fed, or C{None}).

    @return: the number of examples and frames checked.
    """
    counted = {"examples": 0, "frames": 0}

    def one(value):
        counted["examples"] += 1
        counted["frames"] += check(value) or 0

    common = settings(
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    )
    if not LONG:
        given(strategy)(settings(common, max_examples=short, derandomize=True)(one))()
        return counted
    started = time.monotonic()
    run = given(strategy)(settings(common, max_examples=batch, derandomize=False)(one))

    while time.monotonic() - started < LONG_SECONDS and counted["frames"] < LONG_FRAMES:
        run()
    print(f"fuzz: {counted['examples']} examples, {counted['frames']} frames in {time.monotonic() - started:.0f}s")
    return counted


#: Strings a surface must refuse or carry intact: lone surrogates, NULs,
#: long and non-ASCII text.
nasty_strings = st.one_of(
    st.text(max_size=12),
    st.sampled_from(["\ud800", "a\udfffb", "\x00", "é" * 40, "\U0001f600", "x" * 600, "", " "]),
)

json_leaves = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False, allow_infinity=False), nasty_strings
)

json_values = st.recursive(
    json_leaves,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(nasty_strings, children, max_size=4),
    max_leaves=10,
)


class Deep:
    """
    A value nested C{depth} levels deep, written out as raw JSON (the json
    module cannot encode it).
    """

    def __init__(self, depth):
        self.depth = depth

    def raw(self):
        return "[" * self.depth + "]" * self.depth

    def __repr__(self):
        return f"Deep({self.depth})"


deep_values = st.integers(min_value=60, max_value=3000).map(Deep)


bad_values = st.one_of(json_values, deep_values, nasty_strings)


def _containers(value):
    found = [value]
    for child in value.values() if isinstance(value, dict) else value:
        if isinstance(child, dict | list):
            found.extend(_containers(child))
    return found


@st.composite
def mutated(draw, good, max_mutations=3):
    """
    A well-formed body from C{good} with up to C{max_mutations} hostile
    edits anywhere in its tree: a value replaced by any JSON value, an
    absurdly deep one or a nasty string; a key removed; a key added.
    Zero edits (a valid request) is as likely as any other count.
    """
    # A copy: the edits must not reach values a strategy shares (st.just).
    body = copy.deepcopy(draw(good))
    for _ in range(draw(st.integers(0, max_mutations))):
        containers = _containers(body)
        target = containers[draw(st.integers(0, len(containers) - 1))]
        action = draw(st.sampled_from(["replace", "remove", "add"]))
        if isinstance(target, dict):
            keys = sorted(target)
            if action == "add" or not keys:
                target[draw(nasty_strings)] = draw(bad_values)
            elif action == "remove":
                del target[keys[draw(st.integers(0, len(keys) - 1))]]
            else:
                target[keys[draw(st.integers(0, len(keys) - 1))]] = draw(bad_values)
        elif target:
            index = draw(st.integers(0, len(target) - 1))
            if action == "remove":
                del target[index]
            else:
                target[index] = draw(bad_values)
        else:
            target.append(draw(bad_values))
    return body


def encode(body):
    """
    A generated body as request bytes: JSON, with L{Deep} values spliced
    in as raw text.
    """
    deep: dict[str, Any] = {}

    def default(value):
        if isinstance(value, Deep):
            marker = f"__deep{len(deep)}__"
            deep[marker] = value.raw()
            return marker
        raise TypeError(type(value))

    text = json.dumps(body, default=default)
    for marker, raw in deep.items():
        text = text.replace(json.dumps(marker), raw)
    return text.encode("utf-8", "surrogatepass")


# -- wire messages -------------------------------------------------------------

_INT_RANGES = {
    "CPPTYPE_INT32": (-(2**31), 2**31 - 1),
    "CPPTYPE_INT64": (-(2**63), 2**63 - 1),
    "CPPTYPE_UINT32": (0, 2**32 - 1),
    "CPPTYPE_UINT64": (0, 2**64 - 1),
}


def _scalar(field):
    """
    A strategy for one value of a scalar protobuf field, biased towards
    the edges (empty, zero, huge).
    """
    cpp = field.cpp_type
    if cpp == field.CPPTYPE_STRING:
        if field.type == field.TYPE_BYTES:
            return st.binary(max_size=64)
        return st.text(max_size=24)
    if cpp == field.CPPTYPE_BOOL:
        return st.booleans()
    if cpp in (field.CPPTYPE_DOUBLE, field.CPPTYPE_FLOAT):
        return st.floats(allow_nan=True, width=32 if cpp == field.CPPTYPE_FLOAT else 64)
    if cpp == field.CPPTYPE_ENUM:
        values = [v.number for v in field.enum_type.values]
        return st.one_of(st.sampled_from(values), st.integers(-5, 1000))
    for name, (low, high) in _INT_RANGES.items():
        if cpp == getattr(field, name):
            return st.integers(low, high)
    raise AssertionError(f"no strategy for {field.full_name}")


_ID_FIELDS = ("run_id", "tunnel_id", "request_id", "id")


@st.composite
def wire_message(draw, descriptor, depth=0, ids=()):
    """
    A message of C{descriptor}'s type with random fields: each field set
    or not, repeated ones 0-3 times, nested messages down to depth 3. With
    C{ids}, a field named like an id (C{run_id}, C{tunnel_id},
    C{request_id}, C{id}) is always set, mostly to one of C{ids}, so that
    frames hit work in flight.
    """
    from google.protobuf import message_factory

    message = message_factory.GetMessageClass(descriptor)()
    for field in descriptor.fields:
        names_work = bool(ids) and field.name in _ID_FIELDS
        if not names_work and not draw(st.booleans()):
            continue
        count = draw(st.integers(0, 3)) if field.is_repeated else 1
        for _ in range(count):
            if field.cpp_type == field.CPPTYPE_MESSAGE:
                if depth >= 3:
                    break
                value = draw(wire_message(field.message_type, depth + 1, ids))
                target = getattr(message, field.name)
                if field.is_repeated:
                    target.add().CopyFrom(value)
                else:
                    target.CopyFrom(value)
                continue
            strategy = _scalar(field)
            if names_work:
                strategy = st.one_of(st.sampled_from(list(ids)), st.sampled_from(list(ids)), strategy)
            value = draw(strategy)
            if field.is_repeated:
                getattr(message, field.name).append(value)
            else:
                setattr(message, field.name, value)
    return message


def envelopes(ids=(), kinds=None):
    """
    An C{Envelope} carrying any one of its message types (or of C{kinds},
    envelope field names; one named twice is drawn twice as often), with
    random fields.
    """
    from iop.protocols import messages

    every = list(messages.Envelope.DESCRIPTOR.oneofs_by_name["body"].fields)
    by_name = {f.name: f for f in every}
    fields = every if kinds is None else [by_name[k] for k in kinds]

    @st.composite
    def envelope(draw):
        field = draw(st.sampled_from(fields))
        env = messages.Envelope()
        getattr(env, field.name).CopyFrom(draw(wire_message(field.message_type, ids=ids)))
        return env

    return envelope()


@st.composite
def mutated_bytes(draw, data):
    """
    C{data} as it is, or with bytes flipped, cut, inserted or appended.
    """
    data = bytearray(data)
    for _ in range(draw(st.integers(0, 3))):
        action = draw(st.sampled_from(["flip", "cut", "insert", "append"]))
        if action == "flip" and data:
            i = draw(st.integers(0, len(data) - 1))
            data[i] ^= draw(st.integers(1, 255))
        elif action == "cut" and data:
            del data[draw(st.integers(0, len(data) - 1)) :]
        elif action == "insert":
            i = draw(st.integers(0, len(data)))
            data[i:i] = draw(st.binary(min_size=1, max_size=8))
        else:
            data += draw(st.binary(min_size=1, max_size=8))
    return bytes(data)


# -- the fast generator of the long mode ---------------------------------------


class RandomMessages:
    """
    The same kind of wire messages as L{wire_message}, from a seeded
    C{random.Random}: about a hundred times faster than hypothesis, for the
    long mode's million frames (no shrinking; the seed is printed so that a
    failure can be replayed).
    """

    def __init__(self, seed, ids=()):
        import random

        self.rng = random.Random(seed)
        self.ids = list(ids)

    def text(self):
        rng = self.rng
        choice = rng.random()
        if choice < 0.1:
            return ""
        if choice < 0.2:
            return rng.choice(["\x00", "é" * 40, "\U0001f600", "x" * 600, " "])
        return "".join(chr(rng.randrange(32, 0x2FF)) for _ in range(rng.randrange(1, 24)))

    def scalar(self, field):
        rng = self.rng
        cpp = field.cpp_type
        if cpp == field.CPPTYPE_STRING:
            if field.type == field.TYPE_BYTES:
                return rng.randbytes(rng.randrange(0, 64))
            return self.text()
        if cpp == field.CPPTYPE_BOOL:
            return rng.random() < 0.5
        if cpp in (field.CPPTYPE_DOUBLE, field.CPPTYPE_FLOAT):
            return rng.choice([0.0, -1.5, 1e30, float("inf"), float("nan"), rng.random()])
        if cpp == field.CPPTYPE_ENUM:
            values = [v.number for v in field.enum_type.values]
            return rng.choice(values) if rng.random() < 0.8 else rng.randrange(-5, 1000)
        for name, (low, high) in _INT_RANGES.items():
            if cpp == getattr(field, name):
                return rng.choice([low, high, 0, 1, rng.randint(low, high), rng.randint(0, 600)])
        raise AssertionError(field.full_name)

    def message(self, descriptor, depth=0):
        from google.protobuf import message_factory

        rng = self.rng
        message = message_factory.GetMessageClass(descriptor)()
        for field in descriptor.fields:
            names_work = bool(self.ids) and field.name in _ID_FIELDS
            if not names_work and rng.random() < 0.5:
                continue
            for _ in range(rng.randrange(0, 4) if field.is_repeated else 1):
                if field.cpp_type == field.CPPTYPE_MESSAGE:
                    if depth >= 3:
                        break
                    value = self.message(field.message_type, depth + 1)
                    target = getattr(message, field.name)
                    (target.add() if field.is_repeated else target).CopyFrom(value)
                    continue
                if names_work and rng.random() < 0.7:
                    value = rng.choice(self.ids)
                else:
                    value = self.scalar(field)
                if field.is_repeated:
                    getattr(message, field.name).append(value)
                else:
                    setattr(message, field.name, value)
        return message

    def envelope(self, kinds=None):
        from iop.protocols import messages

        every = list(messages.Envelope.DESCRIPTOR.oneofs_by_name["body"].fields)
        by_name = {f.name: f for f in every}
        field = self.rng.choice(every if kinds is None else [by_name[k] for k in kinds])
        env = messages.Envelope()
        getattr(env, field.name).CopyFrom(self.message(field.message_type))
        return env

    def mutate(self, data):
        rng = self.rng
        data = bytearray(data)
        for _ in range(rng.randrange(1, 4)):
            action = rng.choice(["flip", "cut", "insert", "append"])
            if action == "flip" and data:
                data[rng.randrange(len(data))] ^= rng.randrange(1, 256)
            elif action == "cut" and data:
                del data[rng.randrange(len(data)) :]
            elif action == "insert":
                i = rng.randrange(len(data) + 1)
                data[i:i] = rng.randbytes(rng.randrange(1, 9))
            else:
                data += rng.randbytes(rng.randrange(1, 9))
        return bytes(data)


# -- frames ---------------------------------------------------------------------

#: What a ready Node may send: the messages that go deepest.
RESULTS = (
    *("run_event",) * 4,
    *("provider_tunnel_frame",) * 4,
    "node_command_response",
    "cancel_response",
    "node_draining",
    "ping",
)


def framed(data):
    return struct.pack("!I", len(data)) + data


def random_chunk(generator):
    """
    A chunk of any kind (like the strategy C{anything} of
    L{iop.test.test_fuzz_wire}), from the long mode's fast generator.
    """
    rng = generator.rng
    kind = rng.choice(["envelope", "mutated", "junk", "oversize", "short"])
    if kind in ("envelope", "mutated"):
        data = generator.envelope().SerializeToString()
        return framed(generator.mutate(data) if kind == "mutated" else data)
    if kind == "junk":
        return rng.randbytes(rng.randrange(1, 65))
    if kind == "oversize":
        return struct.pack("!I", rng.choice([65537, MAX_FRAME_BYTES + 1, 2**32 - 1]))
    return struct.pack("!I", rng.randrange(5, 101)) + rng.randbytes(rng.randrange(0, 5))


def watch_critical(case: SynchronousTestCase) -> list[LogEvent]:
    """
    The events logged as critical or with a failure (an internal error)
    from now until C{case} ends: a fuzz test expects none.
    """
    critical: list[LogEvent] = []

    @provider(ILogObserver)
    def observe(event: LogEvent) -> None:
        if event.get("log_level") == LogLevel.critical or "log_failure" in event:
            critical.append(event)

    globalLogPublisher.addObserver(observe)
    case.addCleanup(globalLogPublisher.removeObserver, observe)
    return critical
