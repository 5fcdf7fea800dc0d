"""
The header rule (L{iop.httpheaders}) as a table: what a caller's request
headers become at the provider, and what a provider's response headers
become at the caller.
"""

from twisted.trial.unittest import SynchronousTestCase
from twisted.web.http_headers import Headers

from iop.httpheaders import caller_request_headers, header_pairs, provider_request_headers, relay_headers

CALLER = [
    ("Host", "edge.example"),
    ("Content-Length", "42"),
    ("Authorization", "Bearer edge-key"),
    ("Connection", "keep-alive, X-Hop"),
    ("Keep-Alive", "timeout=5"),
    ("X-Hop", "1"),
    ("TE", "trailers"),
    ("Content-Type", "application/json"),
    ("User-Agent", "OpenAI/Python 2.0"),
    ("OpenAI-Organization", "org-1"),
    ("x-stainless-lang", "python"),
    ("X-Trace", "t-1"),
    ("Accept", "text/event-stream"),
    ("X-Team", "caller"),
    ("X-Secret", "s"),
]


class HeaderRuleTests(SynchronousTestCase):
    def test_request_rule(self):
        """
        Each caller header, and whether (with what value) it reaches the
        provider through an adapter with an api_key, a configured header
        and a drop list.
        """
        at_node = caller_request_headers(CALLER)
        adapter_headers = [("X-Team", "ops"), ("Authorization", "Bearer provider-key")]
        sent = provider_request_headers(at_node, adapter_headers, ["x-secret"])
        expected = {
            "Host": None,  # the HTTP client sets the provider's
            "Content-Length": None,  # recomputed
            "Authorization": "Bearer provider-key",  # the caller's was for the Edge
            "Connection": None,  # hop-by-hop
            "Keep-Alive": None,
            "X-Hop": None,  # named by Connection
            "TE": None,
            "Content-Type": "application/json",
            "User-Agent": "OpenAI/Python 2.0",
            "OpenAI-Organization": "org-1",
            "x-stainless-lang": "python",
            "X-Trace": "t-1",
            "Accept": "text/event-stream",
            "X-Team": "ops",  # the adapter's headers win
            "X-Secret": None,  # drop_headers
        }
        got: dict[str, list[str]] = {}
        for name, value in sent:
            got.setdefault(name.lower(), []).append(value)
        for name, want in expected.items():
            self.assertEqual(got.get(name.lower()), None if want is None else [want], name)

    def test_no_api_key_no_authorization(self):
        """
        Without an api_key the provider gets no Authorization at all.
        """
        sent = provider_request_headers(caller_request_headers(CALLER), [])
        self.assertNotIn("authorization", {name.lower() for name, _ in sent})

    def test_response_rule(self):
        """
        A provider's response headers come back as they were (names, order,
        repeated values) minus hop-by-hop ones.
        """
        provider = [
            ("Content-Type", "text/event-stream"),
            ("Transfer-Encoding", "chunked"),
            ("Connection", "close"),
            ("Set-Cookie", "a=1"),
            ("Set-Cookie", "b=2"),
            ("X-Request-Id", "r"),
            ("Date", "Sun, 29 Nov 2026 12:00:00 GMT"),
        ]
        self.assertEqual(
            relay_headers(provider),
            [
                ("Content-Type", "text/event-stream"),
                ("Set-Cookie", "a=1"),
                ("Set-Cookie", "b=2"),
                ("X-Request-Id", "r"),
                ("Date", "Sun, 29 Nov 2026 12:00:00 GMT"),
            ],
        )

    def test_header_pairs(self):
        """
        A C{twisted.web} C{Headers} becomes text pairs, one per value, so a
        repeated header keeps every value in order.
        """
        headers = Headers()
        headers.addRawHeader(b"Set-Cookie", b"a=1")
        headers.addRawHeader(b"Set-Cookie", b"b=2")
        headers.addRawHeader(b"X-Name", "caf\xe9".encode("latin-1"))
        self.assertEqual(
            sorted(header_pairs(headers)),
            [("Set-Cookie", "a=1"), ("Set-Cookie", "b=2"), ("X-Name", "caf\xe9")],
        )
