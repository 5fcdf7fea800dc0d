"""
Tests for L{iop.adapters.verdicts}: Retry-After and context-length errors.
"""

from email.utils import formatdate

from twisted.trial.unittest import SynchronousTestCase
from twisted.web.http_headers import Headers

from iop.adapters.verdicts import MAX_RETRY_AFTER_SEC, retry_after, says_context_length


def headers(**pairs):
    return Headers({name.replace("_", "-").encode(): [value.encode()] for name, value in pairs.items()})


class RetryAfterTests(SynchronousTestCase):
    def test_seconds_date_and_millis(self):
        """
        Delay-seconds, an HTTP date (relative to now) and OpenAI's
        retry-after-ms (which wins) all give seconds.
        """
        now = 1_700_000_000.0
        self.assertEqual(retry_after(headers(retry_after="7"), now), 7.0)
        self.assertEqual(retry_after(headers(retry_after=formatdate(now + 30, usegmt=True)), now), 30.0)
        self.assertEqual(retry_after(headers(retry_after="7", retry_after_ms="1500"), now), 1.5)

    def test_nothing_readable(self):
        """
        No header, garbage, a date in the past and NaN are 0; a huge value
        is capped.
        """
        now = 1_700_000_000.0
        for value in ("soon", formatdate(now - 30, usegmt=True), "nan", "-5"):
            self.assertEqual(retry_after(headers(retry_after=value), now), 0.0, value)
        self.assertEqual(retry_after(Headers(), now), 0.0)
        self.assertEqual(retry_after(headers(retry_after="99999999"), now), MAX_RETRY_AFTER_SEC)


class ContextLengthTests(SynchronousTestCase):
    def test_said(self):
        """
        OpenAI's code, llama.cpp's type, vLLM's message, Ollama's error
        string and a plain text body that say so are recognised.
        """
        for body in (
            b'{"error": {"message": "x", "code": "context_length_exceeded"}}',
            b'{"error": {"message": "x", "type": "exceed_context_size_error"}}',
            b'{"object": "error", "message": "This model\'s maximum context length is 4096 tokens."}',
            b'{"error": "prompt is too long"}',
            b"the input exceeds the context window",
        ):
            self.assertTrue(says_context_length(body), body)

    def test_not_said(self):
        """
        Other errors are not context-length ones.
        """
        for body in (b'{"error": {"message": "invalid temperature"}}', b"bad request", b"[]"):
            self.assertFalse(says_context_length(body), body)

    def test_wrong_shape(self):
        """
        A code or type of any JSON value (unhashable too) says nothing, and
        fails nothing: the error is read for its message.
        """
        for body in (b'{"error": {"code": [1], "message": "x"}}', b'{"error": {"type": {}, "message": "x"}}'):
            self.assertFalse(says_context_length(body), body)
        self.assertTrue(says_context_length(b'{"error": {"code": {}, "message": "maximum context length"}}'))
