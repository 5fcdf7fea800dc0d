"""
The Edge's HTTP routes: one table from path pattern to resource, for the
OpenAI-compatible surface, the native surface, C{/metrics} and the status
page (C{/ui/}, see L{iop.edge.http.ui}); a JSON 404
for every other path.

Hand-routed on C{twisted.web} rather than Klein (the reasons are in
docs/architecture.md): the table below is the whole router. A pattern
segment in braces (C{{run_id}}) matches any one segment and reaches the
handler as C{request.path_params["run_id"]}. A prefix route (the status
page's files) takes every longer path under it, the rest reaching the
handler as C{request.path_params["path"]}.
"""

from twisted.web.resource import Resource

from iop.edge.http.common import Keys, NotFound
from iop.edge.http.native import CancelRun, NodeCommands, Runs, Status, TerminateSession
from iop.edge.http.openai import ChatCompletions, Models
from iop.edge.http.ui import add_ui_routes


class Router(Resource):
    """
    Matches the whole request path against patterns: exact ones first,
    then those with parameters, then prefixes.
    """

    isLeaf = True

    def __init__(self, observer=None):
        super().__init__()
        #: called as C{observer(route, request)} before each request is
        #: rendered (the request metrics); the route is the pattern.
        self.observer = observer
        self._exact = {}
        self._patterns = []
        self._prefixes = []

    def route(self, pattern, resource):
        segments = tuple(pattern.strip("/").split("/"))
        if any(s.startswith("{") for s in segments):
            self._patterns.append((segments, (pattern, resource)))
        else:
            self._exact[segments] = (pattern, resource)

    def prefix(self, pattern, resource):
        self._prefixes.append((tuple(pattern.strip("/").split("/")), (pattern, resource)))

    def render(self, request):
        try:
            segments = tuple(s.decode("utf-8") for s in request.prepath + request.postpath)
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
        if found is None:
            for prefix, candidate in self._prefixes:
                if len(segments) > len(prefix) and segments[: len(prefix)] == prefix:
                    found, request.path_params = candidate, {"path": "/".join(segments[len(prefix) :])}
                    break
        route, resource = found if found is not None else ("unmatched", NotFound())
        if self.observer is not None:
            self.observer(route, request)
        return resource.render(request)


def _match(pattern, segments):
    if len(pattern) != len(segments):
        return None
    params = {}
    for want, have in zip(pattern, segments, strict=True):
        if want.startswith("{"):
            if not have:
                return None
            params[want[1:-1]] = have
        elif want != have:
            return None
    return params


def build_root(service, config, clock, metrics_resource=None):
    keys = Keys(config.api_keys, config.admin_keys)
    http_metrics = getattr(metrics_resource, "http", None)
    router = Router(http_metrics.observe if http_metrics is not None else None)
    router.route("/v1/chat/completions", ChatCompletions(service, keys, clock))
    router.route("/v1/models", Models(service, keys))
    router.route("/v1/runs", Runs(service, keys))
    router.route("/v1/runs/{run_id}/cancel", CancelRun(service, keys))
    router.route("/v1/sessions/terminate", TerminateSession(service, keys))
    router.route("/v1/nodes/{node}/commands", NodeCommands(service, keys))
    router.route("/v1/status", Status(service, keys))
    if metrics_resource is not None:
        router.route("/metrics", metrics_resource)
    add_ui_routes(router, service, keys, clock)
    return router
