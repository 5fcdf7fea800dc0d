"""
The Edge's HTTP resource tree: the OpenAI-compatible surface, the native
surface and C{/metrics}, with JSON 404s everywhere else.
"""

from twisted.web.resource import Resource

from iop.edge.http.common import Keys, NotFound
from iop.edge.http.native import Nodes, Runs, Status, TerminateSession
from iop.edge.http.openai import ChatCompletions, Models


class _Branch(Resource):
    """
    An inner node of the tree: known children, JSON 404 otherwise.
    """

    def getChild(self, name, request):
        return NotFound()

    def render(self, request):
        return NotFound().render(request)


def build_root(service, config, clock, metrics_resource=None):
    keys = Keys(config.api_keys, config.admin_keys)
    root = _Branch()
    v1 = _Branch()
    root.putChild(b"v1", v1)
    chat = _Branch()
    v1.putChild(b"chat", chat)
    chat.putChild(b"completions", ChatCompletions(service, keys, clock))
    v1.putChild(b"models", Models(service, keys))
    v1.putChild(b"runs", Runs(service, keys))
    v1.putChild(b"status", Status(service, keys))
    sessions = _Branch()
    v1.putChild(b"sessions", sessions)
    sessions.putChild(b"terminate", TerminateSession(service, keys))
    v1.putChild(b"nodes", Nodes(service, keys))
    if metrics_resource is not None:
        root.putChild(b"metrics", metrics_resource)
    return root
