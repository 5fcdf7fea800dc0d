"""
Run history and node commands at any Edge of a cluster
(L{iop.edge.http.anywhere}): the whole HTTP surface of one Edge in memory,
its cluster a stand-in whose other Edges answer what a test says, so that
what this Edge asks them, and what it makes of their answers, is seen.
"""

import json
from typing import Any

from twisted.internet import defer
from twisted.internet.defer import Deferred
from twisted.trial.unittest import SynchronousTestCase

from iop.edge.history import merge_listings
from iop.edge.http.request import EdgeRequest
from iop.edge.seam import Forward, PeerAnswer, SoloEdge
from iop.testing.gateway import Gateway

ADMIN = {"authorization": "Bearer admin"}

B = Forward("edge-b", "http://edge-b.invalid:7180", "test")
C = Forward("edge-c", "http://edge-c.invalid:7180", "test")


class OtherEdges(SoloEdge):
    """
    A cluster whose other Edges answer C{answers[path]} to a read, and
    where a proxied request is answered by the stand-in itself (naming the
    Edge it went to).

    @ivar asked: the paths asked of the other Edges.
    @ivar proxied: C{(edge_id, method, uri)} of each request proxied.
    """

    def __init__(self) -> None:
        self.answers: dict[bytes, list[PeerAnswer]] = {}
        self.owners: dict[str, Forward] = {}
        self.asked: list[bytes] = []
        self.proxied: list[tuple[str, bytes, bytes]] = []

    def node_target(self, node_id: str) -> Forward | None:
        return self.owners.get(node_id)

    def ask_peers(self, request: EdgeRequest, path: bytes) -> "Deferred[list[PeerAnswer]]":
        self.asked.append(path)
        return defer.succeed(self.answers.get(path, []))

    def proxy(self, request: EdgeRequest, forward: Forward) -> None:
        self.proxied.append((forward.edge_id, request.method, request.uri))
        request.setResponseCode(200)
        request.write(json.dumps({"proxied_to": forward.edge_id}).encode())
        request.finish()


def stored_run(run_id: str, status: str = "complete", node: str = "n2", created: float = 10.0) -> dict[str, Any]:
    return {"id": run_id, "object": "run", "status": status, "node": node, "created_at": created}


class AnywhereTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.gateway = Gateway()
        self.cluster = OtherEdges()
        # (What the surfaces ask; the Edge's own pieces keep their cluster.)
        self.gateway.service.cluster = self.cluster

    def answer(self, d: "Deferred[Any]") -> tuple[int, Any]:
        code, _, body = self.successResultOf(self.gateway.read(d))
        return code, json.loads(body)

    def test_run_held_by_another_edge(self) -> None:
        """
        A run this Edge does not hold is looked for at the other Edges;
        the first that holds it answers.
        """
        run = stored_run("run-x")
        self.cluster.answers[b"/v1/runs/run-x"] = [PeerAnswer(B, 404, {}), PeerAnswer(C, 200, run)]
        code, body = self.answer(self.gateway.get("/v1/runs/run-x", ADMIN))
        self.assertEqual((code, body), (200, run))
        self.assertEqual(self.cluster.asked, [b"/v1/runs/run-x"])

    def test_run_nowhere(self) -> None:
        """
        A run no Edge holds is this Edge's own 404.
        """
        self.cluster.answers[b"/v1/runs/run-x"] = [PeerAnswer(B, 404, {"error": {}})]
        code, body = self.answer(self.gateway.get("/v1/runs/run-x", ADMIN))
        self.assertEqual((code, body["error"]["type"]), (404, "not_found_error"))
        self.assertEqual(self.cluster.asked, [b"/v1/runs/run-x"])

    def test_events_proxied_to_the_holder(self) -> None:
        """
        The events of a run another Edge holds are the caller's request
        proxied to it, C{Last-Event-ID} and all.
        """
        self.cluster.answers[b"/v1/runs/run-x"] = [PeerAnswer(C, 200, stored_run("run-x", "running"))]
        headers = dict(ADMIN, **{"last-event-id": "4"})
        code, body = self.answer(self.gateway.get("/v1/runs/run-x/events", headers))
        self.assertEqual((code, body), (200, {"proxied_to": "edge-c"}))
        self.assertEqual(self.cluster.proxied, [("edge-c", b"GET", b"/v1/runs/run-x/events")])

    def test_cancel_proxied_to_the_holder(self) -> None:
        """
        A cancel of a run not in flight here goes to the Edge that holds it.
        """
        self.cluster.answers[b"/v1/runs/run-x"] = [PeerAnswer(B, 200, stored_run("run-x", "running"))]
        code, body = self.answer(self.gateway.post("/v1/runs/run-x/cancel", {}))
        self.assertEqual(body, {"proxied_to": "edge-b"})
        self.assertEqual(self.cluster.proxied, [("edge-b", b"POST", b"/v1/runs/run-x/cancel")])

    def test_list_merges_every_edge(self) -> None:
        """
        The list of runs is this Edge's and every other Edge's answer to
        the same request, merged.
        """
        path = b"/v1/runs?limit=5"
        self.cluster.answers[path] = [
            PeerAnswer(B, 200, {"runs": [stored_run("run-b", created=20.0)], "incomplete": ["n1"]}),
            PeerAnswer(C, 503, {"error": {}}),
        ]
        code, body = self.answer(self.gateway.get("/v1/runs?limit=5", ADMIN))
        self.assertEqual(code, 200)
        self.assertEqual([r["id"] for r in body["runs"]], ["run-b"])
        # n1 is connected nowhere: no Edge could ask it.
        self.assertEqual(body["incomplete"], ["n1"])
        self.assertEqual(self.cluster.asked, [path])

    def test_command_proxied_to_the_owner(self) -> None:
        """
        A node command for a node another Edge owns is proxied there.
        """
        self.cluster.owners["n1"] = B
        d = self.gateway.http.post(
            "http://edge.invalid/v1/nodes/n1/commands", json={"command": "list_models"}, headers=ADMIN
        )
        self.gateway.flush()
        code, body = self.answer(d)
        self.assertEqual(body, {"proxied_to": "edge-b"})
        self.assertEqual(self.cluster.proxied, [("edge-b", b"POST", b"/v1/nodes/n1/commands")])


class MergeTests(SynchronousTestCase):
    def test_every_run_once_newest_first(self) -> None:
        """
        A run two Edges know is taken from the one that saw it end; the
        list is newest first and at most C{limit} long.
        """
        mine = {"runs": [stored_run("r1", "running", created=1.0), stored_run("r2", created=2.0)]}
        theirs = {"runs": [stored_run("r1", "complete", created=1.0), stored_run("r3", created=3.0)]}
        merged = merge_listings([mine, theirs], 10)
        self.assertEqual(
            [(r["id"], r["status"]) for r in merged["runs"]],
            [("r3", "complete"), ("r2", "complete"), ("r1", "complete")],
        )
        self.assertNotIn("incomplete", merged)
        self.assertEqual(len(merge_listings([mine, theirs], 2)["runs"]), 2)

    def test_lost_node_is_worth_least(self) -> None:
        """
        An Edge's record of a run it ended for losing the Node is worth
        less than the one of the Edge the Node took it to, even running.
        """
        lost = dict(stored_run("r1", "error"), error={"code": "node_disconnected", "message": "gone"})
        merged = merge_listings([{"runs": [lost]}, {"runs": [stored_run("r1", "running")]}], 10)
        self.assertEqual([r["status"] for r in merged["runs"]], ["running"])

    def test_incomplete_only_where_no_edge_could_ask(self) -> None:
        merged = merge_listings([{"runs": [], "incomplete": ["n1", "n2"]}, {"runs": [], "incomplete": ["n2"]}], 5)
        self.assertEqual(merged["incomplete"], ["n2"])
