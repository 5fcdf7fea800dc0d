"""
The Edge's HTTP routes: one table from path pattern to resource, for the
OpenAI-compatible surface, the native surface and C{/metrics}; a JSON 404
for every other path.

Hand-routed on C{twisted.web} rather than Klein (the reasons are in
docs/architecture.md): the table below is the whole router. A pattern
segment in braces (C{{run_id}}) matches any one segment and reaches the
handler as C{request.path_params["run_id"]}.
"""

from twisted.web.resource import Resource

from iop.edge.http.common import Keys, NotFound
from iop.edge.http.native import CancelRun, NodeCommands, Runs, Status, TerminateSession
from iop.edge.http.openai import ChatCompletions, Models


class Router(Resource):
    """
    Matches the whole request path against patterns, exact ones first.
    """

    isLeaf = True

    def __init__(self):
        super().__init__()
        self._exact = {}
        self._patterns = []

    @classmethod
    def only(cls, pattern, resource):
        """
        A router with one route (and JSON 404s for everything else).
        """
        router = cls()
        router.route(pattern, resource)
        return router

    def route(self, pattern, resource):
        segments = tuple(pattern.strip("/").split("/"))
        if any(s.startswith("{") for s in segments):
            self._patterns.append((segments, resource))
        else:
            self._exact[segments] = resource

    def render(self, request):
        try:
            segments = tuple(s.decode("utf-8") for s in request.prepath + request.postpath)
        except UnicodeDecodeError:
            return NotFound().render(request)
        resource = self._exact.get(segments)
        request.path_params = {}
        if resource is None:
            for pattern, candidate in self._patterns:
                params = _match(pattern, segments)
                if params is not None:
                    resource, request.path_params = candidate, params
                    break
        if resource is None:
            return NotFound().render(request)
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
    keys = Keys(config.api_keys, config.admin_keys, clock.seconds)
    router = Router()
    router.route("/v1/chat/completions", ChatCompletions(service, keys, clock))
    router.route("/v1/models", Models(service, keys))
    router.route("/v1/runs", Runs(service, keys))
    router.route("/v1/runs/{run_id}/cancel", CancelRun(service, keys))
    router.route("/v1/sessions/terminate", TerminateSession(service, keys))
    router.route("/v1/nodes/{node}/commands", NodeCommands(service, keys))
    router.route("/v1/status", Status(service, keys))
    if metrics_resource is not None:
        router.route("/metrics", metrics_resource)
    return router
