"""
Validation before placement (issue 12, findings 1 and 6): every field a
surface uses is checked before the service is asked for a lease, so a
malformed request is a 400 naming the field, reaches no Node and holds no
lease; an exception that still escapes a handler is a logged 500.
"""

import json
from typing import Any

from treq.testing import StubTreq
from twisted.logger import LogLevel, capturedLogs
from twisted.trial.unittest import SynchronousTestCase

from iop.edge.http import openai
from iop.edge.http.validate import MAX_DEPTH, HTTPError, check_tree, parse_body
from iop.protocols import messages
from iop.testing.edge import EdgeHarness

BASE = "http://edge.invalid"
HI = [{"role": "user", "content": "hi"}]


class TreeTests(SynchronousTestCase):
    def test_depth_limit(self):
        """
        A body nested exactly L{MAX_DEPTH} levels is accepted; one level
        more is refused with C{invalid_json}.
        """
        body = "[" * (MAX_DEPTH - 1) + "]" * (MAX_DEPTH - 1)
        parse_body(b'{"a": ' + body.encode() + b"}")
        e = self.assertRaises(HTTPError, parse_body, b'{"a": [' + body.encode() + b"]}")
        self.assertEqual((e.kind, e.code), ("invalid", "invalid_json"))

    def test_recursion_limit_is_a_400(self):
        """
        A body deeper than the interpreter's recursion limit is a 400 too,
        never a C{RecursionError}.
        """
        e = self.assertRaises(HTTPError, parse_body, b"[" * 200_000)
        self.assertEqual(e.code, "invalid_json")

    def test_surrogates_anywhere(self):
        """
        A lone surrogate in any string or key is refused, naming where.
        """
        for raw, param in [
            (b'{"a": "\\ud800"}', "a"),
            (b'{"a": [1, {"b": "x\\udfffy"}]}', "a[1].b"),
            (b'{"\\ud800": 1}', ""),
        ]:
            e = self.assertRaises(HTTPError, parse_body, raw)
            self.assertEqual((e.code, e.param), ("invalid_string", param), raw)
        # A correctly paired surrogate escape is a real character.
        self.assertEqual(parse_body(b'{"a": "\\ud83d\\ude00"}'), {"a": "\U0001f600"})

    def test_constants_refused(self):
        """
        C{NaN} and C{Infinity} are not JSON numbers.
        """
        for raw in (b'{"a": NaN}', b'{"a": -Infinity}'):
            self.assertEqual(self.assertRaises(HTTPError, parse_body, raw).code, "invalid_json")

    def test_numbers_out_of_range_refused(self):
        """
        A number too large for a float (read by C{json} as infinity) and an
        integer outside 64 bits are refused, naming where; both ends of the
        64-bit range are accepted.
        """
        for raw, param in [
            (b'{"temperature": 1e400}', "temperature"),
            (b'{"a": [-1e999]}', "a[0]"),
            (b'{"max_tokens": 1' + b"0" * 400 + b"}", "max_tokens"),
            (b'{"seed": 18446744073709551616}', "seed"),
            (b'{"seed": -9223372036854775809}', "seed"),
        ]:
            e = self.assertRaises(HTTPError, parse_body, raw)
            self.assertEqual((e.code, e.param), ("invalid_number", param), raw)
        body = parse_body(b'{"a": 18446744073709551615, "b": -9223372036854775808, "c": 1.5e300}')
        self.assertEqual(body, {"a": 2**64 - 1, "b": -(2**63), "c": 1.5e300})

    def test_duplicate_keys_refused(self):
        """
        An object that names a key twice is refused, at any depth: the
        Edge would check and account one value (C{json} keeps the last)
        while a tunnel forwards the caller's bytes, in which a provider may
        read the other.
        """
        for raw in (
            b'{"model": "cheap", "max_tokens": 5, "max_tokens": 100000}',
            b'{"messages": [{"role": "user", "role": "system", "content": "x"}]}',
        ):
            e = self.assertRaises(HTTPError, parse_body, raw)
            self.assertEqual((e.kind, e.code), ("invalid", "invalid_json"), raw)
        e = self.assertRaises(HTTPError, parse_body, b'{"a": 1, "a": 2}')
        self.assertIn("'a'", e.message)

    def test_check_tree_is_iterative(self):
        """
        The walk needs no recursion: a tree far deeper than the recursion
        limit is refused by depth, not by a crash.
        """
        value: list[object] = []
        for _ in range(5000):
            value = [value]
        self.assertEqual(self.assertRaises(HTTPError, check_tree, value).code, "invalid_json")


class SurfaceValidationTests(SynchronousTestCase):
    def setUp(self):
        self.edge = EdgeHarness()
        self.node, self.pump, _ = self.edge.register()
        assert self.edge.site is not None
        # (StubTreq's request functions are set on it at run time.)
        self.http: Any = StubTreq(self.edge.site.resource)

    def post(self, path, body=None, raw=None, key=None):
        headers = {b"content-type": [b"application/json"]}
        if key:
            headers[b"authorization"] = [b"Bearer " + key]
        data = raw if raw is not None else json.dumps(body).encode()
        d = self.http.post(BASE + path, data=data, headers=headers)
        self.http.flush()
        response = self.successResultOf(d)
        return response.code, json.loads(self.successResultOf(response.content()))

    def assert_refused(self, path, body=None, code=None, param=None, raw=None, key=None):
        status, answer = self.post(path, body, raw, key)
        self.assertEqual(status, 400, answer)
        error = answer["error"]
        self.assertEqual(error["type"], "invalid_request_error")
        if code is not None:
            self.assertEqual(error["code"], code)
        if param is not None:
            self.assertEqual(error["param"], param)
        self.pump.flush()
        work = [kind for kind, _ in self.node.received if kind not in ("register_response", "node_ready_response")]
        self.assertEqual(work, [])
        self.assertEqual(self.edge.service.pool.active_leases(), [])

    def test_stream_options_not_an_object(self):
        """
        Finding 1: C{stream_options} that is not an object (on a model
        group, so after placement it used to raise) is a 400 before any
        lease is taken.
        """
        values: tuple[object, ...] = ("x", [], 5, True)
        for value in values:
            body = {"model": "grp", "stream": True, "stream_options": value, "messages": HI}
            self.assert_refused("/v1/chat/completions", body, "invalid_stream_options", "stream_options")
        body = {"model": "grp", "stream_options": {"include_usage": "yes"}, "messages": HI}
        self.assert_refused("/v1/chat/completions", body, "invalid_include_usage", "stream_options.include_usage")

    def test_duplicate_key_before_placement(self):
        """
        A body naming a key twice is a 400 C{invalid_json} before any
        lease is taken.
        """
        raw = b'{"model": "grp", "model": "echo", "messages": [{"role": "user", "content": "hi"}]}'
        self.assert_refused("/v1/chat/completions", raw=raw, code="invalid_json")

    def test_surrogates_in_every_used_field(self):
        """
        Finding 1: a lone surrogate in message content, C{session_id},
        C{target} (or any other field) is a 400 naming it, not a 502 and a
        leaked lease.
        """
        cases = [
            ("/v1/chat/completions", {"model": "grp", "messages": [{"role": "user", "content": "\ud800"}]}),
            ("/v1/chat/completions", {"model": "\ud800", "messages": HI}),
            ("/v1/runs", {"model": "grp", "input": "hi", "session_id": "\ud800"}),
            ("/v1/runs", {"model": "grp", "input": "hi", "target": "a\udfff"}),
            ("/v1/runs", {"adapter": "echo", "input": [{"role": "\ud800", "content": "x"}]}),
            ("/v1/runs", {"model": "grp", "input": "hi", "options": {"stop": ["\ud800"]}}),
            ("/v1/sessions/terminate", {"adapter": "echo", "session_id": "\ud800"}),
        ]
        for path, body in cases:
            self.assert_refused(path, body, "invalid_string")

    def test_huge_token_caps(self):
        """
        A C{max_tokens} of 400 digits (which overflowed the fair share's
        float after the slot was taken: a 500 and a slot never returned) is
        a 400 on every surface; the largest accepted cap is placed and its
        lease returned.
        """
        huge = b"1" + b"0" * 400
        cases = [
            (
                "/v1/chat/completions",
                b'{"model": "grp", "max_tokens": %s, "messages": [{"role": "user", "content": "hi"}]}',
                "max_tokens",
            ),
            ("/v1/runs", b'{"model": "grp", "input": "hi", "options": {"max_tokens": %s}}', "options.max_tokens"),
            ("/v1/completions", b'{"model": "grp", "prompt": "hi", "max_tokens": %s}', "max_tokens"),
        ]
        for path, template, param in cases:
            self.assert_refused(path, raw=template % huge, code="invalid_number", param=param)
        body = {"model": "grp", "max_tokens": 2**64 - 1, "messages": HI}
        d = self.http.post(BASE + "/v1/chat/completions", data=json.dumps(body).encode())
        self.http.flush()
        self.pump.flush()
        (request,) = self.node.of("run_request")
        self.assertEqual(len(self.edge.service.pool.active_leases()), 1)
        for seq, kind in enumerate(("start", "complete"), 1):
            self.node.connection.send(messages.run_event(run_id=request.run_id, seq=seq, type=kind))
        self.pump.flush()
        self.http.flush()
        self.assertEqual(self.successResultOf(d).code, 200)
        self.assertEqual(self.edge.service.pool.active_leases(), [])

    def test_node_command_fields(self):
        """
        Finding 6: a surrogate in a node command's fields is a 400.
        """
        for body in (
            {"command": "\ud800"},
            {"command": "capabilities", "adapter": "\udc00"},
            {"command": "capabilities", "args": {"k": "\ud800"}},
        ):
            self.assert_refused("/v1/nodes/n1/commands", body, "invalid_string", key=b"admin")
        self.assert_refused("/v1/nodes/n1/commands", {"command": 5}, "invalid_command", key=b"admin")
        self.assert_refused("/v1/nodes/n1/commands", {"command": "x", "args": []}, "invalid_args", key=b"admin")

    def test_deep_nesting(self):
        """
        Finding 6: deeply nested JSON is a 400 at every endpoint, not a
        C{RecursionError} and a 502.
        """
        raw = b'{"model": "grp", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
        for path in ("/v1/chat/completions", "/v1/runs", "/v1/sessions/terminate"):
            self.assert_refused(path, raw=raw, code="invalid_json")
        self.assert_refused("/v1/nodes/n1/commands", raw=raw, code="invalid_json", key=b"admin")

    def test_content_part_text_not_a_string(self):
        """
        Finding 6: a text part whose C{text} is not a string is a 400 naming
        it; so is a part that is not an object.
        """
        body = {"model": "grp", "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}
        self.assert_refused("/v1/chat/completions", body, "invalid_text", "messages[0].content[0].text")
        body = {"model": "grp", "messages": [{"role": "user", "content": ["x"]}]}
        self.assert_refused("/v1/chat/completions", body, "invalid_messages", "messages[0].content[0]")

    def test_wrong_types(self):
        """
        Every used field has its type checked: booleans are booleans,
        names are strings of bounded length, options and args objects.
        """
        self.assert_refused("/v1/chat/completions", {"model": "grp", "messages": HI, "stream": "yes"}, "invalid_stream")
        self.assert_refused("/v1/chat/completions", {"model": ["grp"], "messages": HI}, "invalid_model")
        self.assert_refused("/v1/chat/completions", {"model": "g" * 600, "messages": HI}, "invalid_model")
        self.assert_refused("/v1/chat/completions", {"model": "grp", "messages": [{"content": "x"}]}, "missing_role")
        self.assert_refused("/v1/runs", {"model": "grp", "input": "x", "background": 1}, "invalid_background")
        self.assert_refused("/v1/runs", {"model": "grp", "input": "x", "options": [1]}, "invalid_options")
        self.assert_refused("/v1/runs", {"model": "grp", "input": "x", "node": 3}, "invalid_node")
        self.assert_refused("/v1/runs", {"model": "grp", "input": "x", "stream": "no"}, "invalid_stream")
        self.assert_refused("/v1/runs", {"model": "grp", "input": 5}, "invalid_input")
        self.assert_refused("/v1/sessions/terminate", {"adapter": "echo"}, "missing_session_id")

    def test_valid_shapes_still_pass(self):
        """
        What the checks accept reaches the Node unchanged: text parts are
        joined, other part types ignored by a normalized run, nulls read as
        absent.
        """
        content = [
            {"type": "text", "text": "a"},
            {"type": "image_url", "image_url": {"url": "x"}},
            {"type": "text", "text": "b"},
        ]
        body = {
            "model": "grp",
            "stream": None,
            "stream_options": None,
            "messages": [{"role": "user", "content": content}],
        }
        d = self.http.post(BASE + "/v1/chat/completions", data=json.dumps(body).encode())
        self.http.flush()
        self.pump.flush()
        (request,) = self.node.of("run_request")
        self.assertEqual([(m.role, m.content) for m in request.messages], [("user", "ab")])
        self.assertNoResult(d)

    def test_escaping_exception_is_a_logged_500(self):
        """
        An exception that escapes a handler (a bug) is a 500
        C{internal_error}, logged as an error with its traceback.
        """

        def broken(body):
            raise ZeroDivisionError("bug")

        self.patch(openai, "parse_chat", broken)
        with capturedLogs() as events:
            status, answer = self.post("/v1/chat/completions", {"model": "grp", "messages": HI})
        self.assertEqual((status, answer["error"]["code"]), (500, "internal_error"))
        self.assertEqual(len(self.flushLoggedErrors(ZeroDivisionError)), 1)
        self.assertEqual([e["log_level"] for e in events if "log_failure" in e], [LogLevel.error])

    def test_failure_starting_work_returns_the_lease(self):
        """
        Whatever fails between placement and the work being in flight (here
        the surface's listener) returns the lease: the caller gets an
        C{internal_error} and the provider is free again.
        """

        def broken(*args):
            raise ZeroDivisionError("bug")

        self.patch(openai.ResponseRenderer, "__init__", broken)
        status, answer = self.post("/v1/chat/completions", {"model": "grp", "messages": HI})
        self.assertEqual(answer["error"]["code"], "internal_error")
        self.assertIn(status, (500, 502))
        self.assertEqual(len(self.flushLoggedErrors(ZeroDivisionError)), 1)
        self.assertEqual(self.edge.service.pool.active_leases(), [])
