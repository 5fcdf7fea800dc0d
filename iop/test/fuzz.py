"""
Shared pieces of the project's fuzz tests (hypothesis): how many examples
to run, and strategies for hostile JSON.

The short mode runs in C{make test}/C{trial iop}: a bounded number of
examples, derandomized so a failure reproduces. C{make fuzz} sets
C{IOP_FUZZ=long} for many more examples under a wall-clock bound
(C{IOP_FUZZ_SECONDS}, per test).
"""

import json
import os
import time

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

LONG = os.environ.get("IOP_FUZZ") == "long"

#: Wall-clock bound of one test in the long mode.
LONG_SECONDS = float(os.environ.get("IOP_FUZZ_SECONDS", "120"))


def fuzz_settings(short, long=100_000):
    """
    Hypothesis settings for one fuzz test: C{short} examples normally,
    C{long} (under the time bound) with C{IOP_FUZZ=long}.
    """
    return settings(
        max_examples=long if LONG else short,
        deadline=None,
        derandomize=not LONG,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    )


class Budget:
    """
    The long mode's wall-clock bound: C{spent()} turns true once a test has
    run for L{LONG_SECONDS}; the test then accepts every further example
    without work (hypothesis has no time limit of its own).
    """

    def __init__(self):
        self.start = time.monotonic()

    def spent(self):
        return LONG and time.monotonic() - self.start > LONG_SECONDS


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
    body = draw(good)
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
    deep = {}

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
