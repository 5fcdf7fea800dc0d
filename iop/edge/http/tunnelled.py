"""
The OpenAI endpoints that only a tunnel can carry: C{POST /v1/completions},
C{POST /v1/embeddings} and C{POST /v1/responses}, streaming or not.

Each is placed by C{model} through the same model groups, leases and
queues as chat completions, on the providers whose adapter type carries
that endpoint (L{iop.run.ENDPOINT_TYPES}), and relayed byte for byte with
C{model} rewritten to the provider's target. A model group with no such
provider answers 400 naming the endpoint.
"""

from iop.edge.http.api import EdgeAPI
from iop.edge.http.common import Call, JSONResource, Keys, caller_headers, claim
from iop.edge.http.openai import TunnelPassthrough
from iop.edge.http.request import EdgeRequest
from iop.edge.http.validate import string
from iop.edge.spec import RunSpec, TunnelSpec
from iop.edge.tenants import CHARS_PER_TOKEN


def _size(value: object) -> int:
    """
    How many characters a prompt or input holds, for the long/normal
    request class and the token estimate: its strings wherever they are
    nested (a Responses input of message objects and content parts counts
    its text, and the few characters of their keys' values too), and a
    token id (an integer, as in a prompt given as tokens) as
    L{CHARS_PER_TOKEN} characters. The body's nesting is bounded by its
    parser already.
    """
    size = 0
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            size += len(item)
        elif isinstance(item, int) and not isinstance(item, bool):
            size += CHARS_PER_TOKEN
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
    return size


class TunnelledEndpoint(JSONResource):
    """
    @param path: the endpoint under the provider's base URL, e.g.
        C{/completions}.
    """

    runs_work = True

    def __init__(self, service: EdgeAPI, keys: Keys, path: str) -> None:
        super().__init__(service, keys)
        self.path = path

    def handle_POST(self, request: EdgeRequest) -> int:
        body = self.read_json(request)
        model = string(body, "model", required=True)
        spec = RunSpec(
            messages=[],
            model=model,
            adapter=model,
            tunnel=TunnelSpec(
                "POST",
                self.path,
                caller_headers(request, streamed=body.get("stream") is True),
                body,
                getattr(request, "raw_body", None),
            ),
            runs=False,
            size=_size(body.get("prompt", body.get("input"))),
        )
        claim(spec, request)
        call = Call(self.service, request)
        return call.submit(spec, lambda kind, work_id: TunnelPassthrough(call, self.path))
