"""
How the endpoints only a tunnel carries (L{iop.edge.http.tunnelled})
measure their input for the long/normal class and the token estimate.
"""

from twisted.trial.unittest import SynchronousTestCase

from iop.edge.http.tunnelled import _size
from iop.edge.tenants import CHARS_PER_TOKEN


class InputSizeTests(SynchronousTestCase):
    def test_strings_and_lists(self):
        """
        A prompt or input given as a string or a list of strings counts
        its characters.
        """
        self.assertEqual(_size("x" * 10), 10)
        self.assertEqual(_size(["ab", "cde"]), 5)
        self.assertEqual(_size(None), 0)

    def test_nested_text_counts(self):
        """
        A Responses input of message objects and content parts counts the
        text inside them: 400,000 characters are a long request, not 0.
        """
        text = "x" * 400_000
        messages = [{"role": "user", "content": [{"type": "input_text", "text": text}]}]
        self.assertGreaterEqual(_size(messages), 400_000)
        self.assertLess(_size(messages), 400_100)
        self.assertGreaterEqual(_size([{"role": "user", "content": text}]), 400_000)

    def test_token_ids(self):
        """
        A prompt or embedding input given as token ids (one list, or a
        list of them) counts each id as a token's characters; a boolean is
        not a token.
        """
        self.assertEqual(_size(list(range(1000))), 1000 * CHARS_PER_TOKEN)
        self.assertEqual(_size([[1, 2], [3]]), 3 * CHARS_PER_TOKEN)
        self.assertEqual(_size([True, 2.5]), 0)
