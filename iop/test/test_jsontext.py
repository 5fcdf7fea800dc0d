"""
Tests for L{iop.jsontext}: a burst's values parsed in one go accept and
refuse exactly what C{json} does, one by one, and nesting too deep to
parse is bad JSON like any other.
"""

import json

from hypothesis import given
from hypothesis import strategies as st
from twisted.trial import unittest

from iop.jsontext import loads, loads_each

#: Integers at and past the ends of 64 bits (where orjson gives a float).
edge_integers = st.integers(min_value=2**63 - 2, max_value=2**65)
edge_integers = edge_integers | edge_integers.map(lambda n: -n)

values = st.recursive(
    st.none() | st.booleans() | st.integers() | edge_integers | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)


def each(texts: list[bytes]) -> list[object] | None:
    """
    What C{json} makes of C{texts} one by one; C{None} if it refuses one.
    """
    try:
        return [json.loads(text) for text in texts]
    except (ValueError, RecursionError):
        return None


class LoadsEachTests(unittest.TestCase):
    @given(st.lists(values, max_size=6))
    def test_values(self, parsed):
        texts = [json.dumps(value).encode() for value in parsed]
        self.assertEqual(loads_each(texts), parsed)

    def test_what_json_accepts_beyond_orjson(self):
        texts = [
            b"NaN",
            b"-Infinity",
            b"123456789012345678901234567890",
            b'"\\ud800"',
            b'{"a": 1}',
            b"-9223372036854775809",
            b"18446744073709551617",
            b"1e400",
        ]
        got, expected = loads_each(texts), each(texts)
        assert got is not None and expected is not None
        self.assertEqual(got[2:], expected[2:])  # (NaN is not equal to itself)
        self.assertNotEqual(got[0], got[0])
        self.assertEqual(got[1], float("-inf"))

    def test_refused(self):
        deep = b"[" * 5000 + b"]" * 5000
        for texts in ([b'{"a": 1}', b"{"], [b"1, 2"], [b"\xff"], [b""], [b"[1]", b"]"], [b"1", deep]):
            self.assertIsNone(loads_each(texts), texts)
            self.assertIsNone(each(texts), texts)


class LoadsTests(unittest.TestCase):
    def test_as_json(self):
        self.assertEqual(loads(b'{"a": [1, 2.5, null]}'), {"a": [1, 2.5, None]})
        self.assertEqual(loads("-9223372036854775809"), -9223372036854775809)

    def test_too_deep_is_a_value_error(self):
        """
        C{json} raises C{RecursionError} for this; every handler of a
        malformed answer catches C{ValueError}.
        """
        for deep in (b"[" * 5000 + b"]" * 5000, '{"a":' * 5000 + "1" + "}" * 5000):
            with self.assertRaises(ValueError):
                loads(deep)

    def test_not_json(self):
        with self.assertRaises(ValueError):
            loads(b"{not json")
