"""
Run history and node commands at any Edge of a cluster (docs/cluster.md,
"Everything at any Edge").

A run is held by the Edge that served it (its record, its events) and by
its Node's store, which only the Edge that Node is connected to can ask.
When this Edge does not hold a run it asks the others
(L{iop.edge.seam.ICluster.ask_peers}) and answers with the first that
does: a run read back is that Edge's answer; a run's events, or its
cancel, are the caller's request proxied to it. A run whose Node this
Edge lost to another Edge is read there (the service answers with a
L{Forward}). A list of runs is every Edge's, merged. A request about a
node another Edge owns (a node command, a session's end) is proxied to
that Edge. A request that came from another Edge is answered from what
this Edge holds, so a lookup never goes round the cluster twice.

On an Edge alone, nobody is asked: the answers are this Edge's own.
"""

from typing import Any
from urllib.parse import quote

from twisted.internet import defer
from twisted.internet.defer import Deferred
from twisted.python.failure import Failure
from twisted.web.server import NOT_DONE_YET

from iop.edge.errors import ServiceError
from iop.edge.history import merge_listings
from iop.edge.http.api import EdgeAPI
from iop.edge.http.common import forwarded
from iop.edge.http.request import EdgeRequest
from iop.edge.seam import Forward, PeerAnswer


def _not_found(failure: Failure) -> bool:
    return isinstance(failure.value, ServiceError) and failure.value.kind == "not_found"


def run_path(run_id: str) -> bytes:
    """
    Where a run is read back (C{GET /v1/runs/{id}}).
    """
    return f"/v1/runs/{quote(run_id, safe='')}".encode("ascii")


def holder(answers: list[PeerAnswer]) -> PeerAnswer | None:
    """
    The first Edge that answered a run's read with the run.
    """
    for answer in answers:
        if answer.code == 200 and isinstance(answer.body, dict):
            return answer
    return None


def _elsewhere(service: EdgeAPI, request: EdgeRequest, run_id: str, failure: Failure) -> "Deferred[PeerAnswer]":
    """
    The Edge that holds C{run_id}, which this Edge did not find
    (C{failure}, its C{not_found}); that failure again when no Edge does.
    """
    if forwarded(request) or not _not_found(failure):
        return defer.fail(failure)

    def found(answers: list[PeerAnswer]) -> PeerAnswer | Failure:
        answer = holder(answers)
        return failure if answer is None else answer

    return service.cluster.ask_peers(request, run_path(run_id)).addCallback(found)


def get_run(service: EdgeAPI, request: EdgeRequest, run_id: str, owner: str | None) -> "Deferred[object]":
    """
    C{GET /v1/runs/{id}}: this Edge's answer, else the Edge's that holds
    the run.
    """
    d = service.get_run(run_id, owner, may_forward=not forwarded(request))

    def elsewhere(failure: Failure) -> object:
        if isinstance(failure.value, Forward):
            return _proxy(service, request, failure.value)
        return _elsewhere(service, request, run_id, failure).addCallback(lambda answer: answer.body)

    found: Deferred[object] = d.addErrback(elsewhere)
    return found


def _proxy(service: EdgeAPI, request: EdgeRequest, forward: Forward) -> object:
    service.cluster.proxy(request, forward)
    return NOT_DONE_YET


def proxy_to_holder(service: EdgeAPI, request: EdgeRequest, run_id: str, failure: Failure) -> "Deferred[object]":
    """
    A request about a run this Edge does not hold (C{failure}: its
    C{not_found}, or the L{Forward} to the Edge that holds it now):
    proxied to the Edge that does, else that failure.
    """
    if isinstance(failure.value, Forward):
        return defer.succeed(_proxy(service, request, failure.value))
    return _elsewhere(service, request, run_id, failure).addCallback(
        lambda answer: _proxy(service, request, answer.forward)
    )


def list_runs(
    service: EdgeAPI, request: EdgeRequest, local: "Deferred[dict[str, Any]]", limit: int
) -> "Deferred[dict[str, Any]]":
    """
    C{GET /v1/runs}: this Edge's list (C{local}) merged with every other
    Edge's answer to the same request.
    """
    if forwarded(request):
        return local
    peers = service.cluster.ask_peers(request, request.uri)

    def merged(mine: dict[str, Any]) -> "Deferred[dict[str, Any]]":
        def answered(answers: list[PeerAnswer]) -> dict[str, Any]:
            theirs = [a.body for a in answers if a.code == 200 and isinstance(a.body, dict)]
            return merge_listings([mine, *theirs], limit)

        return peers.addCallback(answered)

    return local.addCallback(merged)


def proxied_to_owner(service: EdgeAPI, request: EdgeRequest, node_id: str) -> bool:
    """
    Whether a request about C{node_id} went to the Edge of the cluster
    that owns it (proxied there now), rather than being answered here.
    """
    forward = None if forwarded(request) else service.cluster.node_target(node_id)
    if forward is None:
        return False
    _proxy(service, request, forward)
    return True
