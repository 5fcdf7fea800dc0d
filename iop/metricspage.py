"""
C{/metrics} for both daemons: the Prometheus text exposition of one
registry, rendered on the reactor thread.

Not C{prometheus_client.twisted.MetricsResource}: that one imports the
global reactor and collects in a thread pool, where collectors would read
live Edge and Node state while the reactor changes it. Rendering a few
dozen samples is cheap enough to do in place.
"""

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from twisted.web.iweb import IRequest
from twisted.web.resource import Resource


class MetricsPage(Resource):
    """
    The Prometheus text exposition of one registry.
    """

    isLeaf = True

    def __init__(self, registry: CollectorRegistry) -> None:
        super().__init__()
        self.registry = registry

    def render_GET(self, request: IRequest) -> bytes:

        request.setHeader(b"Content-Type", CONTENT_TYPE_LATEST.encode("ascii"))
        return generate_latest(self.registry)
