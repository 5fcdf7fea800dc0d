"""
The status page: C{/ui/} serves a static page (HTML, CSS and JS shipped in
C{static/}, no build step and nothing fetched from elsewhere, so it works
offline) that polls C{/ui/state} and redraws itself.

  GET /             302 to ui/
  GET /ui/          the page (and its files under /ui/)
  GET /ui/state     the page's data (caller key when keys are set)

The page's files hold no data and are served to anyone; the data endpoint
is behind the caller key like C{/v1/status}, and the page asks for the key
when it gets a 401. C{/ui/state} is C{/v1/status} plus what only a page
needs: the Edge's clock (ages are computed against it, not the browser's),
each connected node's generation, and the recent runs (only the caller
key's own, unless it is an admin key: docs/edge.md, "Isolation").

Recent runs come from the event bus, like the metrics: a bounded list of
the last L{RecentRuns.size} runs and tunnels, which is what the page shows
(the history is C{GET /v1/runs}).
"""

from collections import OrderedDict
from importlib import resources
from typing import Any, Protocol

from twisted.internet.interfaces import IReactorTime
from twisted.web.resource import Resource
from twisted.web.server import Request

from iop.edge.bus import EventBus
from iop.edge.http.api import EdgeAPI
from iop.edge.http.common import JSONResource, Keys, run_owner
from iop.edge.http.request import EdgeRequest
from iop.edge.status import seen_by
from iop.run import TERMINAL_TYPES

CONTENT_TYPES = {
    ".html": b"text/html; charset=utf-8",
    ".css": b"text/css; charset=utf-8",
    ".js": b"text/javascript; charset=utf-8",
    ".svg": b"image/svg+xml",
    ".png": b"image/png",
}

#: Only this origin's files and data: nothing inline, nothing from elsewhere.
CONTENT_SECURITY_POLICY = (
    b"default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    b"connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


class RecentRuns:
    """
    The last C{size} runs and tunnels seen on the bus, newest first: id,
    kind, node, adapter and target, status, start and end times on the
    Edge's clock, usage and error code.
    """

    def __init__(self, bus: EventBus, clock: IReactorTime, size: int = 30) -> None:
        self.clock = clock
        self.size = size
        #: (by run id, as the payload gives it)
        self._runs: OrderedDict[str | None, dict[str, Any]] = OrderedDict()
        self.subscription = bus.subscribe(self._observe, topics=["run", "tunnel"])

    def _observe(self, topic: str, payload: dict[str, Any]) -> None:
        run_id = payload.get("run_id")
        status = payload.get("status") if topic == "tunnel" else payload.get("type")
        if payload.get("type") == "start":
            self._started(run_id, topic, payload)
        elif status in TERMINAL_TYPES:
            run = self._runs.get(run_id) or self._started(run_id, topic, payload)
            run["status"] = status
            run["ended_at"] = self.clock.seconds()
            if payload.get("usage"):
                run["usage"] = payload["usage"]
            if payload.get("error"):
                run["error"] = payload["error"].get("code", "")

    def _started(self, run_id: str | None, kind: str, payload: dict[str, Any]) -> dict[str, Any]:
        run = {
            "id": run_id,
            "kind": kind,
            "node": payload.get("node"),
            "status": "running",
            "started_at": self.clock.seconds(),
            "key": payload.get("key"),
        }
        for field in ("adapter", "target"):
            if payload.get(field) is not None:
                run[field] = payload[field]
        self._runs[run_id] = run
        while len(self._runs) > self.size:
            self._runs.popitem(last=False)
        return run

    def snapshot(self, owner: str | None = None) -> list[dict[str, Any]]:
        """
        The runs, newest first: only those of the caller key named
        C{owner}, when given.
        """
        return [dict(run) for run in reversed(self._runs.values()) if owner is None or run["key"] == owner]


class Routes(Protocol):
    """
    Where the page's routes go (L{iop.edge.http.root.Router}).
    """

    def route(self, pattern: str, resource: Resource) -> None: ...

    def prefix(self, pattern: str, resource: Resource) -> None: ...


class State(JSONResource):
    """
    C{GET /ui/state}: everything the page draws, in one answer.
    """

    def __init__(self, service: EdgeAPI, keys: Keys, clock: IReactorTime, recent: RecentRuns) -> None:
        super().__init__(service, keys)
        self.clock = clock
        self.recent = recent

    def handle_GET(self, request: EdgeRequest) -> dict[str, Any]:
        request.setHeader(b"cache-control", b"no-store")
        status = seen_by(self.service.status(), request.sees_all)
        for node in status["nodes"]:
            link = self.service.registry.ready_link(node["id"])
            if link is not None:
                node["generation"] = link.generation
        return {"now": self.clock.seconds(), "status": status, "runs": self.recent.snapshot(run_owner(request))}


class StaticFiles(Resource):
    """
    The page's files, read once from the package: only the names shipped
    in C{static/} exist (no path from the request touches the disk).
    C{index.html} answers for the directory itself.
    """

    isLeaf = True

    def __init__(self, package: str = "iop.edge.http", folder: str = "static") -> None:
        super().__init__()
        self.files: dict[str, tuple[bytes, bytes]] = {}
        for entry in resources.files(package).joinpath(folder).iterdir():
            suffix = "." + entry.name.rsplit(".", 1)[-1]
            if entry.is_file() and suffix in CONTENT_TYPES:
                self.files[entry.name] = (CONTENT_TYPES[suffix], entry.read_bytes())

    def render_GET(self, request: EdgeRequest) -> bytes:
        name = request.path_params.get("path") or "index.html"
        found = self.files.get(name)
        if found is None:
            request.setResponseCode(404)
            request.setHeader(b"content-type", b"text/plain; charset=utf-8")
            return b"not found\n"
        content_type, data = found
        request.setHeader(b"content-type", content_type)
        request.setHeader(b"cache-control", b"no-cache")
        request.setHeader(b"content-security-policy", CONTENT_SECURITY_POLICY)
        request.setHeader(b"x-content-type-options", b"nosniff")
        request.setHeader(b"referrer-policy", b"no-referrer")
        return data

    def render_HEAD(self, request: EdgeRequest) -> bytes:
        return self.render_GET(request)


class Redirect(Resource):
    """
    A 302 to a location relative to the request (so it also works behind
    a proxy that serves the Edge under a path prefix).
    """

    isLeaf = True

    def __init__(self, location: bytes) -> None:
        super().__init__()
        self.location = location

    def render(self, request: Request) -> bytes:
        request.setResponseCode(302)
        request.setHeader(b"location", self.location)
        request.setHeader(b"content-type", b"text/plain; charset=utf-8")
        return b"the status page is at " + self.location + b"\n"


def add_ui_routes(router: Routes, service: EdgeAPI, keys: Keys, clock: IReactorTime) -> None:
    """
    Route C{/}, C{/ui} and C{/ui/...} on C{router} to the status page.
    """
    recent = RecentRuns(service.bus, clock)
    router.route("/", Redirect(b"ui/"))
    router.route("/ui", Redirect(b"ui/"))
    router.route("/ui/state", State(service, keys, clock, recent))
    router.prefix("/ui/", StaticFiles())
