"""
Runs belong to the caller key that started them (docs/edge.md,
"Isolation"), through the whole gateway in memory: another caller key
gets 404 on every per-run endpoint — the same answer as for a run that
does not exist — and a list of its own; an admin key sees and cancels
every run; the Node's store, which answers once the Edge has forgotten a
run, knows each run's owner from the wire; an open caller API is one
tenant.
"""

import copy
import json

from twisted.trial.unittest import SynchronousTestCase

from iop.testing.gateway import BASE, GATEWAY_YAML, Gateway

ALICE, BOB, ROOT = "alice-key", "bob-key", "root-key"


def keyed(**extra) -> dict:
    data = copy.deepcopy(GATEWAY_YAML)
    data["api_keys"] = [{"key": ALICE, "name": "alice"}, {"key": BOB, "name": "bob"}]
    data["admin_keys"] = [{"key": ROOT, "name": "ops"}]
    data.update(extra)
    return data


class IsolationTestCase(SynchronousTestCase):
    config = staticmethod(keyed)

    def setUp(self):
        self.gateway = Gateway(self.config())
        self.node = self.gateway.node()

    def call(self, method, path, key=None, body=None):
        headers = {b"authorization": [b"Bearer " + key.encode()]} if key else {}
        data = json.dumps(body).encode() if body is not None else None
        d = self.gateway.http.request(method, BASE + path, headers=headers, data=data)
        self.gateway.flush()
        return d

    def answer(self, d):
        code, _, body = self.successResultOf(self.gateway.read(d))
        return code, body

    def json(self, d):
        code, body = self.answer(d)
        return code, json.loads(body)

    def background_run(self, key, model="talk"):
        """
        Start a background run as C{key}: @return: its id.
        """
        body = {"model": model, "input": "one two three", "stream": False, "background": True}
        code, run = self.json(self.call("POST", "/v1/runs", key, body))
        self.assertEqual(code, 202)
        return run["id"]

    def status(self, run_id: str) -> str:
        """
        The status of the run C{run_id}, which must exist.
        """
        record = self.gateway.service.runs.get(run_id)
        assert record is not None, f"no run {run_id}"
        return record.status

    def finished_run(self, key):
        run_id = self.background_run(key)
        self.gateway.advance(1)
        self.assertEqual(self.status(run_id), "complete")
        return run_id

    def assert_hidden(self, d, run_id):
        """
        C{d} is answered exactly as for a run that does not exist.
        """
        code, body = self.json(d)
        self.assertEqual((code, body["error"]["code"]), (404, "run_not_found"))
        self.assertNotIn("alice", json.dumps(body))
        return body


class ReadTests(IsolationTestCase):
    def test_run_and_events_of_another_key_are_404(self):
        """
        Alice reads her run with its output and its events; Bob gets the
        404 a made-up id gets, for the run and for its events; the admin
        key reads both.
        """
        run_id = self.finished_run(ALICE)
        code, run = self.json(self.call("GET", f"/v1/runs/{run_id}", ALICE))
        self.assertEqual((code, run["output"], run["key"]), (200, "one two three", "alice"))
        hidden = self.assert_hidden(self.call("GET", f"/v1/runs/{run_id}", BOB), run_id)
        missing = self.assert_hidden(self.call("GET", "/v1/runs/run-nope", BOB), "run-nope")
        self.assertEqual(
            hidden["error"]["message"].replace(run_id, "ID"), missing["error"]["message"].replace("run-nope", "ID")
        )
        self.assertEqual(self.json(self.call("GET", f"/v1/runs/{run_id}", ROOT))[1]["output"], "one two three")
        code, body = self.answer(self.call("GET", f"/v1/runs/{run_id}/events", ALICE))
        self.assertEqual(code, 200)
        self.assertIn(b'"type": "complete"', body)
        self.assert_hidden(self.call("GET", f"/v1/runs/{run_id}/events", BOB), run_id)
        self.assertEqual(self.answer(self.call("GET", f"/v1/runs/{run_id}/events", ROOT))[0], 200)

    def test_lists_are_per_key(self):
        """
        C{GET /v1/runs} lists only the caller's runs (from the Edge's
        memory and the Node's store alike); the admin key lists every key's,
        or one key's with C{?key=}; a caller key's C{?key=} does not widen
        its view.
        """
        mine = {self.finished_run(ALICE), self.finished_run(ALICE)}
        theirs = self.finished_run(BOB)
        admins = self.finished_run(ROOT)

        def listed(key, query=""):
            code, body = self.json(self.call("GET", "/v1/runs" + query, key))
            self.assertEqual(code, 200)
            return {run["id"] for run in body["runs"]}

        self.assertEqual(listed(ALICE), mine)
        self.assertEqual(listed(ALICE, "?key=bob"), mine)
        self.assertEqual(listed(BOB), {theirs})
        self.assertEqual(listed(ROOT), mine | {theirs, admins})
        self.assertEqual(listed(ROOT, "?key=alice"), mine)
        self.assertEqual(listed(ROOT, "?key=ops"), {admins})

    def test_node_store_knows_the_owner(self):
        """
        Once the Edge has forgotten a run, the Node's store answers for it
        with the owner it was told on the wire: Bob still gets 404 for the
        run, its events and in lists, Alice and the admin key get it whole.
        """
        self.gateway = Gateway(keyed(run_log={"max_age_sec": 1, "max_runs": 1}))
        self.node = self.gateway.node()
        run_id = self.finished_run(ALICE)
        self.gateway.advance(2)
        self.finished_run(BOB)
        self.assertIsNone(self.gateway.service.runs.get(run_id))
        self.assertEqual(self.node.store.rows[run_id]["caller"], "alice")
        code, run = self.json(self.call("GET", f"/v1/runs/{run_id}", ALICE))
        self.assertEqual((code, run["output"], run["key"]), (200, "one two three", "alice"))
        self.assertEqual(self.json(self.call("GET", f"/v1/runs/{run_id}", ROOT))[0], 200)
        self.assert_hidden(self.call("GET", f"/v1/runs/{run_id}", BOB), run_id)
        self.assert_hidden(self.call("GET", f"/v1/runs/{run_id}/events", BOB), run_id)
        self.assertEqual(self.answer(self.call("GET", f"/v1/runs/{run_id}/events", ALICE))[0], 200)
        code, body = self.json(self.call("GET", "/v1/runs", BOB))
        self.assertNotIn(run_id, {run["id"] for run in body["runs"]})

    def test_tunnel_of_another_key(self):
        """
        A tunnel is its caller's too: the Node records its owner, and
        another caller key can neither read nor cancel it.
        """
        body = {"model": "big", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        self.call("POST", "/v1/chat/completions", ALICE, body)
        [record] = [r for r in self.gateway.service.runs.records() if r.kind == "tunnel"]
        self.assertEqual(self.node.store.rows[record.wire_id]["caller"], "alice")
        self.assert_hidden(self.call("GET", f"/v1/runs/{record.id}", BOB), record.id)
        self.assert_hidden(self.call("POST", f"/v1/runs/{record.id}/cancel", BOB), record.id)
        self.assertFalse(record.done)
        self.assertEqual(self.json(self.call("GET", f"/v1/runs/{record.id}", ALICE))[1]["kind"], "tunnel")

    def test_status_page_shows_own_runs(self):
        """
        The status page's recent runs are the caller key's own; the admin
        key sees every key's.
        """
        alice, bob = self.finished_run(ALICE), self.finished_run(BOB)

        def shown(key):
            return {run["id"] for run in self.json(self.call("GET", "/ui/state", key))[1]["runs"]}

        self.assertEqual(shown(ALICE), {alice})
        self.assertEqual(shown(BOB), {bob})
        self.assertEqual(shown(ROOT), {alice, bob})


class CancelTests(IsolationTestCase):
    def test_cancel_of_another_key_is_404(self):
        """
        Bob's cancel of Alice's running run is a 404 and the run goes on;
        Alice's own cancel ends it.
        """
        run_id = self.background_run(ALICE)
        self.gateway.advance(0.15)
        self.assert_hidden(self.call("POST", f"/v1/runs/{run_id}/cancel", BOB), run_id)
        self.assertEqual(self.status(run_id), "running")
        self.assertEqual(
            self.json(self.call("POST", f"/v1/runs/{run_id}/cancel", ALICE)),
            (200, {"run_id": run_id, "cancelling": True}),
        )
        self.gateway.advance(1)
        self.assertEqual(self.status(run_id), "cancelled")
        # Ended: a second cancel is a conflict saying so (Bob's still 404).
        code, body = self.json(self.call("POST", f"/v1/runs/{run_id}/cancel", ALICE))
        self.assertEqual((code, body["error"]["code"]), (409, "run_finished"))
        self.assertIn("already ended (cancelled)", body["error"]["message"])
        self.assert_hidden(self.call("POST", f"/v1/runs/{run_id}/cancel", BOB), run_id)
        # Forgotten by the Edge (run_log.max_age_sec), read from the store.
        self.gateway.advance(601)
        self.assertIsNone(self.gateway.service.runs.get(run_id))
        code, body = self.json(self.call("POST", f"/v1/runs/{run_id}/cancel", ALICE))
        self.assertEqual((code, body["error"]["code"]), (409, "run_finished"))
        self.assert_hidden(self.call("POST", f"/v1/runs/{run_id}/cancel", BOB), run_id)

    def test_cancel_queued_run(self):
        """
        A queued background run is its key's too: Bob cannot cancel it,
        the admin key can.
        """
        running = [self.background_run(ALICE), self.background_run(ALICE)]
        queued = self.background_run(ALICE)
        self.assertEqual(self.status(queued), "queued")
        self.assert_hidden(self.call("POST", f"/v1/runs/{queued}/cancel", BOB), queued)
        self.assertEqual(self.status(queued), "queued")
        self.assertEqual(self.json(self.call("POST", f"/v1/runs/{queued}/cancel", ROOT))[0], 200)
        self.assertEqual(self.status(queued), "cancelled")
        self.assertEqual([self.status(r) for r in running], ["running", "running"])


def open_api(**extra) -> dict:
    return dict(copy.deepcopy(GATEWAY_YAML), **extra)


class OpenAPITests(IsolationTestCase):
    config = staticmethod(open_api)

    def test_everyone_is_anonymous(self):
        """
        With no caller keys configured, every caller is C{anonymous} and
        sees, reads and cancels every run.
        """
        done = self.finished_run(None)
        running = self.background_run(None)
        code, body = self.json(self.call("GET", "/v1/runs"))
        self.assertEqual({run["id"] for run in body["runs"]}, {done, running})
        self.assertEqual(self.json(self.call("GET", f"/v1/runs/{done}"))[1]["key"], "anonymous")
        self.assertEqual(self.json(self.call("POST", f"/v1/runs/{running}/cancel"))[0], 200)
