"""
Tests for L{iop.adapters.streams.json_values}: a burst's values parsed in
one go accept and refuse exactly what C{json} does, one by one.
"""

import json

from hypothesis import given
from hypothesis import strategies as st
from twisted.trial import unittest

from iop.adapters.streams import json_values

values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)


def each(texts: list[bytes]) -> list[object] | None:
    """
    What C{json} makes of C{texts} one by one; C{None} if it refuses one.
    """
    try:
        return [json.loads(text) for text in texts]
    except ValueError:
        return None


class JSONValuesTests(unittest.TestCase):
    @given(st.lists(values, max_size=6))
    def test_values(self, parsed):
        texts = [json.dumps(value).encode() for value in parsed]
        self.assertEqual(json_values(texts), parsed)

    def test_what_json_accepts_beyond_orjson(self):
        texts = [b"NaN", b"-Infinity", b"123456789012345678901234567890", b'"\\ud800"', b'{"a": 1}']
        got, expected = json_values(texts), each(texts)
        assert got is not None and expected is not None
        self.assertEqual(got[2:], expected[2:])  # (NaN is not equal to itself)
        self.assertNotEqual(got[0], got[0])
        self.assertEqual(got[1], float("-inf"))

    def test_refused(self):
        for texts in ([b'{"a": 1}', b"{"], [b"1, 2"], [b"\xff"], [b""], [b"[1]", b"]"]):
            self.assertIsNone(json_values(texts), texts)
            self.assertIsNone(each(texts), texts)
