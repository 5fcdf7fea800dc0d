"""
The Edge's HTTP routes: one table from path pattern to resource, for the
OpenAI-compatible surface, the native surface, C{/metrics} and the status
page (C{/ui/}, see L{iop.edge.http.ui}); a JSON 404
for every other path.

Hand-routed on C{twisted.web} rather than Klein (the reasons are in
docs/architecture.md): the table below is the whole router. A pattern
segment in braces (C{{run_id}}) matches any one segment and reaches the
handler as C{request.path_params["run_id"]}; a last segment C{{name...}}
matches the rest of the path, slashes included (model ids such as
C{Qwen/Qwen3-8B}). A prefix route (the status page's files) takes every
longer path under it, the rest reaching the handler as
C{request.path_params["path"]}.
"""

from collections.abc import Callable

from twisted.internet.interfaces import IReactorTime
from twisted.web.resource import Resource

from iop.edge.http.api import EdgeAPI
from iop.edge.http.common import Keys, NotFound
from iop.edge.http.native import CancelRun, Events, NodeCommands, Queue, Run, RunEvents, Runs, Status, TerminateSession
from iop.edge.http.openai import ChatCompletions, Model, Models
from iop.edge.http.request import EdgeRequest
from iop.edge.http.tunnelled import TunnelledEndpoint
from iop.edge.http.ui import add_ui_routes
from iop.edge.tracing import RequestTracing


class Router(Resource):
    """
    Matches the whole request path against patterns: exact ones first,
    then those with parameters, in the order they were added.
    """

    isLeaf = True
    #: The keys its resources check (what the console and tests read the
    #: keys' spending from), once L{build_root} built it.
    keys: Keys

    def __init__(self, *observers: Callable[[str, EdgeRequest], object]) -> None:
        super().__init__()
        #: each called as C{observer(route, request)} before each request
        #: is rendered (the request metrics, the tracing spans); the route
        #: is the pattern.
        self.observers = observers
        self._exact: dict[tuple[str, ...], tuple[str, Resource]] = {}
        self._patterns: list[tuple[tuple[str, ...], tuple[str, Resource]]] = []

    @classmethod
    def only(cls, pattern: str, resource: Resource) -> "Router":
        """
        A router with one route (and JSON 404s for everything else).
        """
        router = cls()
        router.route(pattern, resource)
        return router

    def route(self, pattern: str, resource: Resource) -> None:
        segments = tuple(pattern.strip("/").split("/"))
        if any(s.startswith("{") for s in segments):
            self._patterns.append((segments, (pattern, resource)))
        else:
            self._exact[segments] = (pattern, resource)

    def prefix(self, pattern: str, resource: Resource) -> None:
        """
        Route every longer path under C{pattern} to C{resource}, the rest
        as C{request.path_params["path"]}.
        """
        self.route(pattern.rstrip("/") + "/{path...}", resource)

    def render(self, request: EdgeRequest) -> bytes | int:
        try:
            segments = tuple(s.decode("utf-8") for s in (request.prepath or []) + (request.postpath or []))
        except UnicodeDecodeError:
            return NotFound().render(request)
        found = self._exact.get(segments)
        request.path_params = {}
        if found is None:
            for pattern, candidate in self._patterns:
                params = _match(pattern, segments)
                if params is not None:
                    found, request.path_params = candidate, params
                    break
        route, resource = found if found is not None else ("unmatched", NotFound())
        for observer in self.observers:
            observer(route, request)
        return resource.render(request)


def _match(pattern: tuple[str, ...], segments: tuple[str, ...]) -> dict[str, str] | None:
    if pattern[-1].endswith("...}") and len(segments) >= len(pattern):
        rest = "/".join(segments[len(pattern) - 1 :])
        head = _match(pattern[:-1], segments[: len(pattern) - 1])
        if head is None:
            return None
        head[pattern[-1][1:-4]] = rest
        return head
    if len(pattern) != len(segments):
        return None
    params: dict[str, str] = {}
    for want, have in zip(pattern, segments, strict=True):
        if want.startswith("{"):
            if not have:
                return None
            params[want[1:-1]] = have
        elif want != have:
            return None
    return params


def build_root(
    service: EdgeAPI,
    clock: IReactorTime,
    metrics_resource: Resource | None = None,
    tracing: RequestTracing | None = None,
    count_request: Callable[[str, EdgeRequest], None] | None = None,
) -> Router:
    """
    The caller API's routes, C{/metrics} among them when
    C{metrics_resource} is given; C{count_request} (the request metrics:
    counted whether or not C{/metrics} is served here, or behind a key)
    and C{tracing}'s spans, when given, observe every request. The keys
    are those of C{service.config}, whichever is running.
    """
    keys = Keys.following(lambda: service.config, clock.seconds)
    observers = [o for o in (count_request, tracing.observe if tracing is not None else None) if o is not None]
    router = Router(*observers)
    router.keys = keys
    router.route("/v1/chat/completions", ChatCompletions(service, keys, clock))
    for path in ("/completions", "/embeddings", "/responses"):
        router.route("/v1" + path, TunnelledEndpoint(service, keys, path))
    router.route("/v1/models", Models(service, keys))
    router.route("/v1/models/{model...}", Model(service, keys))
    router.route("/v1/runs", Runs(service, keys))
    router.route("/v1/runs/{run_id}", Run(service, keys))
    router.route("/v1/runs/{run_id}/events", RunEvents(service, keys))
    router.route("/v1/runs/{run_id}/cancel", CancelRun(service, keys))
    router.route("/v1/sessions/terminate", TerminateSession(service, keys))
    router.route("/v1/nodes/{node}/commands", NodeCommands(service, keys))
    router.route("/v1/status", Status(service, keys))
    router.route("/v1/queue", Queue(service, keys))
    router.route("/v1/events", Events(service, keys))
    if metrics_resource is not None:
        router.route("/metrics", metrics_resource)
    add_ui_routes(router, service, keys, clock)
    return router
