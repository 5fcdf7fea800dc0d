"""
The status page on the whole gateway in memory (L{iop.testing.gateway}):
its data endpoint (C{/ui/state}) follows a node and a run live, sits
behind the caller key, and its static files and redirects are served
without the disk or the network.
"""

import copy
import json

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from iop.edge.bus import EventBus
from iop.edge.http.ui import RecentRuns
from iop.testing.gateway import BASE, GATEWAY_YAML, Gateway

TEXT = "one two three four"


class StatePageTests(SynchronousTestCase):
    def setUp(self):
        self.gateway = Gateway()

    def state(self, headers=None):
        d = self.gateway.http.get(BASE + "/ui/state", headers=headers)
        self.gateway.flush()
        code, _, body = self.successResultOf(self.gateway.read(d))
        return code, json.loads(body)

    def test_node_connection_and_generation(self):
        """
        Before the node connects it is listed offline; once ready it is
        connected with its generation, and the Edge's clock is given so
        the page measures ages on it.
        """
        code, data = self.state()
        self.assertEqual(code, 200)
        self.assertFalse(data["status"]["nodes"][0]["connected"])
        self.assertNotIn("generation", data["status"]["nodes"][0])
        self.gateway.clock.advance(7)
        self.gateway.node()
        _, data = self.state()
        node = data["status"]["nodes"][0]
        self.assertTrue(node["connected"])
        self.assertEqual(node["generation"], 1)
        self.assertEqual(data["now"], self.gateway.clock.seconds())
        self.assertEqual(node["connected_since"], 7)

    def test_in_use_and_recent_run(self):
        """
        While a streamed run holds a lease the page sees in_use 1 and the
        run as running with its adapter; after it ends, in_use is 0 and
        the run is complete with its usage and duration.
        """
        self.gateway.node()
        d = self.gateway.post("/v1/runs", {"model": "talk", "input": TEXT})
        _, data = self.state()
        provider = data["status"]["nodes"][0]["providers"][0]
        self.assertEqual(provider["in_use"]["normal"], 1)
        (run,) = data["runs"]
        self.assertEqual((run["status"], run["node"], run["adapter"]), ("running", "n1", "echo"))
        self.gateway.advance(1)
        self.successResultOf(self.gateway.read(d))
        _, data = self.state()
        self.assertEqual(data["status"]["nodes"][0]["providers"][0]["in_use"]["normal"], 0)
        (run,) = data["runs"]
        self.assertEqual(run["status"], "complete")
        self.assertEqual(run["usage"]["output_tokens"], len(TEXT.split()))
        self.assertGreater(run["ended_at"], run["started_at"])

    def test_caller_key(self):
        """
        With caller keys configured the data needs one (401 without, 200
        with), while the page itself loads without a key so it can ask.
        """
        config = copy.deepcopy(GATEWAY_YAML)
        config["api_keys"] = ["caller"]
        self.gateway = Gateway(config)
        code, body = self.state()
        self.assertEqual((code, body["error"]["code"]), (401, "missing_api_key"))
        code, _ = self.state({"authorization": "Bearer caller"})
        self.assertEqual(code, 200)
        code, _, page = self.successResultOf(self.gateway.read(self.gateway.get("/ui/")))
        self.assertEqual(code, 200)
        self.assertIn(b"<title>", page)

        self.assertEqual(page.count(b"<title>"), 1)

    def test_provider_words_for_admins_only(self):
        """
        Like C{/v1/status}, the page's data shows a caller key a
        provider's C{last_error} as its code alone; an admin key sees it
        whole.
        """
        config = copy.deepcopy(GATEWAY_YAML)
        config["api_keys"], config["admin_keys"] = ["caller"], ["root"]
        self.gateway = Gateway(config)
        self.gateway.node()
        status = self.gateway.service.status

        def failed_status():
            answer = status()
            answer["nodes"][0]["providers"][0]["last_error"] = "upstream_error: 400: bad field 'team-b secret'"
            return answer

        self.patch(self.gateway.service, "status", failed_status)

        def last_error(key):
            _, data = self.state({"authorization": "Bearer " + key})
            return data["status"]["nodes"][0]["providers"][0]["last_error"]

        self.assertEqual(last_error("caller"), "upstream_error")
        self.assertEqual(last_error("root"), "upstream_error: 400: bad field 'team-b secret'")


class StaticFileTests(SynchronousTestCase):
    def setUp(self):
        self.gateway = Gateway()

    def fetch(self, path):
        d = self.gateway.http.get(BASE + path, allow_redirects=False)
        self.gateway.flush()
        return self.successResultOf(self.gateway.read(d))

    def test_files(self):
        """
        The page, its script and its style come from the package with
        their content types and a policy that allows nothing from another
        origin; the page names no other origin.
        """
        for path, kind in (("/ui/", b"text/html"), ("/ui/app.js", b"text/javascript"), ("/ui/style.css", b"text/css")):
            code, headers, body = self.fetch(path)
            self.assertEqual(code, 200, path)
            self.assertTrue(headers.getRawHeaders(b"content-type")[0].startswith(kind), path)
            self.assertIn(b"default-src 'none'", headers.getRawHeaders(b"content-security-policy")[0])
            self.assertNotIn(b"http://", body.replace(b"http://www.w3.org", b""))
            self.assertNotIn(b"https://", body)

    def test_unknown_file_and_redirects(self):
        """
        A name not shipped is a 404 (no path reaches the disk); C{/} and
        C{/ui} redirect to the page relative to themselves.
        """
        self.assertEqual(self.fetch("/ui/../../setup.py")[0], 404)
        self.assertEqual(self.fetch("/ui/nope.js")[0], 404)
        self.assertEqual(self.fetch("/ui/static/app.js")[0], 404)
        for path in ("/", "/ui"):
            code, headers, _ = self.fetch(path)
            self.assertEqual(code, 302)
            self.assertEqual(headers.getRawHeaders(b"location"), [b"ui/"])

    def test_api_routes_unchanged(self):
        """
        The prefix route takes only what no other route matches: unknown
        API paths are still the JSON 404.
        """
        code, _, body = self.fetch("/v1/nope")
        self.assertEqual(code, 404)
        self.assertEqual(json.loads(body)["error"]["type"], "not_found_error")


class RecentRunsTests(SynchronousTestCase):
    def test_bounded_newest_first(self):
        """
        Only the last C{size} runs are kept, newest first; a terminal for
        a run whose start was not seen still makes a row.
        """
        clock = Clock()
        bus = EventBus(clock)
        recent = RecentRuns(bus, clock, size=2)
        for n in range(3):
            bus.publish("run", {"run_id": f"r{n}", "node": "n", "type": "start"})
        bus.publish("run", {"run_id": "r9", "node": "n", "type": "error", "error": {"code": "boom", "message": "x"}})
        clock.advance(0)
        runs = recent.snapshot()
        self.assertEqual([r["id"] for r in runs], ["r9", "r2"])
        self.assertEqual((runs[0]["status"], runs[0]["error"]), ("error", "boom"))
