"""
A caller key's C{max_concurrent} through the whole gateway in memory: a
caller who disconnects frees its place without an unhandled error in
the log, a background run holds its place until the run ends, not until
its 202 (or until its caller left), and reading or cancelling runs is
never refused for it.
"""

import copy
import gc
import json

from twisted.trial.unittest import SynchronousTestCase

from iop.testing.edge import edge_config
from iop.testing.gateway import BASE, GATEWAY_YAML, Gateway

KEY = "limited-key"


class KeyLimitTests(SynchronousTestCase):
    def setUp(self):
        data = copy.deepcopy(GATEWAY_YAML)
        data["api_keys"] = [{"key": KEY, "name": "limited", "max_concurrent": 1}]
        self.gateway = Gateway(data)
        self.node = self.gateway.node()
        self.limiter = self.gateway.edge.site.resource.keys.limiter

    def call(self, method, path, body=None):
        headers = {b"authorization": [b"Bearer " + KEY.encode()]}
        data = json.dumps(body).encode() if body is not None else None
        d = self.gateway.http.request(method, BASE + path, headers=headers, data=data)
        self.gateway.flush()
        return d

    def code(self, d):
        return self.successResultOf(self.gateway.read(d))[0]

    def busy(self):
        """
        How many requests of the key are counted in progress.
        """
        return sum(self.limiter.in_progress.values())

    def test_disconnect_logs_no_unhandled_error(self):
        """
        A limited key's caller who disconnects mid-stream frees its place,
        and nothing is logged as an unhandled error (the release ends the
        request's C{notifyFinish} chain instead of passing its failure on).
        """
        self.call("POST", "/v1/runs", {"model": "talk", "input": "one two three", "stream": True})
        self.gateway.advance(0.15)
        self.assertEqual(self.busy(), 1)
        self.gateway.hang_up()
        gc.collect()
        self.assertEqual(self.flushLoggedErrors(), [])
        self.assertEqual(self.busy(), 0)
        self.assertEqual(self.code(self.call("GET", "/v1/status")), 200)

    def test_background_run_holds_its_place_until_it_ends(self):
        """
        A background run answered 202 at once still counts against
        C{max_concurrent} while it runs: another run of the key is 429
        until the run ends, while reading it back is not held up.
        """
        body = {"model": "talk", "input": "one two three", "stream": False, "background": True}
        d = self.call("POST", "/v1/runs", body)
        code, _, answer = self.successResultOf(self.gateway.read(d))
        self.assertEqual((code, self.busy()), (202, 1))
        another = {"model": "talk", "input": "x", "stream": False}
        self.assertEqual(self.code(self.call("POST", "/v1/runs", another)), 429)
        self.assertEqual(
            self.code(
                self.call(
                    "POST", "/v1/chat/completions", {"model": "talk", "messages": [{"role": "user", "content": "x"}]}
                )
            ),
            429,
        )
        run_id = json.loads(answer)["id"]
        self.assertEqual(self.code(self.call("GET", f"/v1/runs/{run_id}")), 200)
        self.assertEqual(self.code(self.call("GET", "/v1/runs")), 200)
        self.gateway.advance(1)
        self.assertEqual(self.busy(), 0)
        d = self.call("POST", "/v1/runs", another)
        self.gateway.advance(1)
        self.assertEqual(self.code(d), 200)

    def test_streamed_background_run_outlives_its_caller_in_the_count(self):
        """
        A streamed background run whose caller leaves goes on, and so does
        its place in the count, until the run's terminal.
        """
        body = {"model": "talk", "input": "one two three", "stream": True, "background": True}
        self.call("POST", "/v1/runs", body)
        self.gateway.advance(0.15)
        self.gateway.hang_up()
        self.assertEqual(self.busy(), 1)
        self.gateway.advance(1)
        self.assertEqual(self.busy(), 0)

    def test_queued_background_run_cancelled(self):
        """
        A background run cancelled while it waits for room frees its
        place at once (and the key at its limit may cancel it).
        """
        data = copy.deepcopy(GATEWAY_YAML)
        data["api_keys"] = [{"key": KEY, "name": "limited", "max_concurrent": 3}]
        self.gateway = Gateway(data)
        self.node = self.gateway.node()
        self.limiter = self.gateway.edge.site.resource.keys.limiter
        body = {"model": "talk", "input": "one two three", "stream": False, "background": True}
        for _ in range(3):
            self.assertEqual(self.code(self.call("POST", "/v1/runs", body)), 202)
        queued = [r for r in self.gateway.service.runs.records() if r.status == "queued"]
        self.assertEqual((len(queued), self.busy()), (1, 3))
        self.assertEqual(self.code(self.call("POST", f"/v1/runs/{queued[0].id}/cancel", {})), 200)
        self.assertEqual(self.busy(), 2)


class KeyReloadTests(SynchronousTestCase):
    """
    A reload (SIGHUP) changes the keys from the next request: the surfaces
    read them from the running configuration.
    """

    def setUp(self):
        self.data = copy.deepcopy(GATEWAY_YAML)
        self.data["api_keys"] = [{"key": KEY, "name": "limited", "max_concurrent": 1}]
        self.gateway = Gateway(self.data)
        self.node = self.gateway.node()

    def code(self, key, body=None):
        headers = {b"authorization": [b"Bearer " + key.encode()]}
        path = "/v1/models" if body is None else "/v1/runs"
        d = self.gateway.http.request(
            "GET" if body is None else "POST",
            BASE + path,
            headers=headers,
            data=json.dumps(body).encode() if body else None,
        )
        self.gateway.flush()
        return self.successResultOf(self.gateway.read(d))[0]

    def reload(self, api_keys):
        self.data["api_keys"] = api_keys
        self.assertEqual(self.gateway.service.reload(edge_config(self.data)), [])

    def test_new_key_in_removed_key_out(self):
        """
        After a reload the new key is let in and the removed one is 401.
        """
        self.assertEqual(self.code(KEY), 200)
        self.reload([{"key": "rotated-key", "name": "limited"}])
        self.assertEqual((self.code("rotated-key"), self.code(KEY)), (200, 401))

    def test_raised_limit_counts_work_already_running(self):
        """
        A key's C{max_concurrent} raised by a reload applies at once, and a
        run admitted before it still counts: 1 running + 1 new fits under
        2, a third does not.
        """
        body = {"model": "talk", "input": "one two three", "stream": False, "background": True}
        self.assertEqual(self.code(KEY, body), 202)
        self.assertEqual(self.code(KEY, body), 429)
        self.reload([{"key": KEY, "name": "limited", "max_concurrent": 2}])
        self.assertEqual(self.code(KEY, body), 202)
        self.assertEqual(self.code(KEY, body), 429)

    def test_limit_given_by_reload_counts_work_already_running(self):
        """
        A key without a C{max_concurrent} has its running work counted all
        the same: a reload that gives it one (here 1, with a run going) has
        it refuse the next at once.
        """
        self.reload([{"key": KEY, "name": "limited"}])
        body = {"model": "talk", "input": "one two three", "stream": False, "background": True}
        self.assertEqual(self.code(KEY, body), 202)
        self.reload([{"key": KEY, "name": "limited", "max_concurrent": 1}])
        self.assertEqual(self.code(KEY, body), 429)
