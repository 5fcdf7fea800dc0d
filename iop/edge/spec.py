"""
What a caller asks of the Edge, independent of the surface it came through.

A surface builds one L{RunSpec} and hands it to
L{iop.edge.service.EdgeService.submit}. When the request can travel as a
raw provider tunnel (an OpenAI-surface request), the spec also carries a
L{TunnelSpec}; the provider the pool chooses decides which of the two is
used, never the caller.
"""

import json
import secrets
from dataclasses import dataclass, field

from iop.edge.tenants import CHARS_PER_TOKEN, Tenant
from iop.edge.timing import Timing
from iop.run import ENDPOINT_TYPES, TUNNEL_TYPES

#: Request fields that cap an answer's tokens, by API (chat, responses).
_MAX_TOKEN_FIELDS = ("max_completion_tokens", "max_tokens", "max_output_tokens")


def tokens_of(chars: int) -> int:
    """
    The Edge's estimate of the tokens C{chars} characters of text make
    (L{CHARS_PER_TOKEN} a token, rounded up): what budgets charge before a
    back end reports, and what an answer says as its usage when none did.
    """
    return -(-chars // CHARS_PER_TOKEN)


def new_id(prefix: str) -> str:
    """
    A fresh, unguessable id such as C{run-3f2a...}.
    """
    return f"{prefix}-{secrets.token_hex(12)}"


@dataclass
class TunnelSpec:
    """
    The caller's HTTP request, to be relayed to an OpenAI-compatible
    provider as it is.

    @ivar path: relative to the provider's base URL (C{/chat/completions}).
    @ivar headers: C{[(name, value)]} to send to the provider.
    @ivar body: the caller's JSON body; only C{model} is rewritten to the
        provider's target.
    """

    method: str
    path: str
    headers: list
    body: dict
    #: The caller's body bytes, when known: forwarded as they are when
    #: C{model} needs no rewriting.
    raw: bytes | None = None

    @property
    def types(self) -> frozenset[str]:
        """
        The adapter types that carry this request as a tunnel.
        """
        return ENDPOINT_TYPES.get(self.path, TUNNEL_TYPES)

    def encoded_body(self, target: str) -> bytes:
        """
        The body to send to a provider that knows the model as C{target}:
        the caller's own bytes when the model keeps its name, else encoded
        once with C{model} replaced.
        """
        if self.raw is not None and (not target or target == self.body.get("model")):
            return self.raw
        return json.dumps(dict(self.body, model=target or self.body.get("model"))).encode("utf-8")


@dataclass
class RunSpec:
    """
    SubmitRun's arguments. Either C{model} (a model group) or C{adapter}
    (an adapter name, on C{node} or the single ready node) says where.

    @ivar tunnel: how to carry the request if the chosen provider takes raw
        OpenAI-compatible HTTP; C{None} means "always a normalized run".
    @ivar runs: whether a provider that cannot take the tunnel may serve
        the request as a normalized run (only chat completions can).
    @ivar background: the run goes on when its caller leaves (never a
        tunnel: a background run is always a normalized run, so that its
        events can be kept and read back).
    @ivar outlives_edge: its Node keeps it going when its link is lost,
        as it keeps a background run (a native run in an Edge cluster):
        should its Edge die, the Node's next Edge takes it on, and its
        caller, cut off, resumes its events at any Edge. The Edge that
        lost the link still ends it for its caller, as ever.
    @ivar caller: the name of the caller's key, for the token metrics.
    @ivar tenant: the caller's key as a L{Tenant} (share, priority,
        budgets); C{None}: an anonymous caller.
    @ivar priority: the class the caller asked for (C{x-iop-priority}),
        already capped at its key's own; C{None}: the key's.
    @ivar run_id: the run's id once known: a background run gets it when
        submitted, so the caller can be told before the run is placed.
    @ivar timing: its caller request's L{Timing}, marked as the work is
        placed, sent and answered (a fresh one when nobody reads it).
    @ivar traceparent: the trace context a normalized run sends to the
        provider (L{iop.edge.tracing.outgoing_traceparent}); empty: none.
    @ivar continues: the run goes on with an answer cut mid-way (its
        C{options} carry the part the caller has as C{assistant_prefix}):
        only a provider whose adapter has C{continuation: true} may take
        it.
    """

    messages: list
    adapter: str = ""
    target: str = ""
    node: str | None = None
    model: str | None = None
    session_id: str = ""
    background: bool = False
    outlives_edge: bool = False
    options: dict = field(default_factory=dict)
    tunnel: TunnelSpec | None = None
    runs: bool = True
    size: int | None = None
    caller: str | None = None
    tenant: Tenant | None = None
    priority: int | None = None
    run_id: str = ""
    timing: Timing = field(default_factory=Timing)
    traceparent: str = ""
    continues: bool = False

    def serves(self, adapter_type: str) -> bool:
        """
        Whether a provider of C{adapter_type} can serve this request.
        """
        return self.runs or (self.tunnel is not None and adapter_type in self.tunnel.types)

    def tunnels_on(self, adapter_type: str) -> bool:
        """
        Whether this request travels as a tunnel to C{adapter_type}.
        """
        return self.tunnel is not None and adapter_type in self.tunnel.types

    def token_estimate(self, answer_tokens: int, capped: bool = False) -> int:
        """
        The tokens this request is expected to cost, for fair share and
        budgets: its input by length, plus its own cap on the answer
        (C{max_tokens} and kin) or else C{answer_tokens}; embeddings have
        no answer tokens.

        @param capped: count the answer at most C{answer_tokens} (what an
            answer that reported no usage is charged: a caller's
            C{max_tokens} is its word, not what it used).
        """
        body = self.tunnel.body if self.tunnel is not None else self.options
        cap = next((body[name] for name in _MAX_TOKEN_FIELDS if isinstance(body.get(name), int)), None)
        if cap is None:
            cap = 0 if self.tunnel is not None and self.tunnel.path == "/embeddings" else answer_tokens
        if capped:
            cap = min(cap, answer_tokens)
        return tokens_of(self.input_chars()) + max(cap, 0)

    def input_chars(self) -> int:
        """
        How long the input is, for a model group's long/normal threshold:
        C{size} when the surface measured it, else the messages' text.
        """
        if self.size is not None:
            return self.size
        return sum(len(m.get("content") or "") for m in self.messages)
