"""
Where a piece of work goes, and the lease it holds there.

Placement order:

  1. an explicit C{node}: with a C{model} naming a model group, only that
     group's providers on that node are candidates (none: 404 naming both);
     otherwise the adapter named by C{adapter} (or C{model}) on that node;
  2. else a C{model} naming a model group: the group's pool;
  3. else the adapter of that name on the one ready node that has it
     (the single-node fallback);
  4. else 404 C{model_not_found} when no configured node has such an
     adapter, 503 when none of those that have it is ready, and 400 when
     several are (the name alone is ambiguous).

Every placement takes a lease from the pool: pooled work from its group's
providers, direct work (cases 1 and 3 without a group) from the provider
resources of that adapter on that node, or the adapter's own implicit
resource when no provider names it. Both wait in a queue under the same
rules when there is no room, so the Node's gate never sees more than the
Edge admitted.

The placer only chooses and leases; starting the work is the service's
job, and the lease belongs to whoever starts the work.
"""

from collections.abc import Callable, Collection, Iterable

from twisted.internet import defer
from twisted.python.failure import Failure

from iop.edge.config import EdgeConfig
from iop.edge.dispatch import Placement
from iop.edge.errors import ServiceError
from iop.edge.pool import Lease, NoLiveProvider, Overloaded, ProviderPool, ProviderSpec, QueueFull, QueueTimeout
from iop.edge.registry import NodeLink, NodeRegistry
from iop.edge.spec import RunSpec
from iop.edge.tenants import Ticket


class Placer:
    """
    @param config: a callable returning the running
        L{iop.edge.config.EdgeConfig} (it changes on reload).
    @param registry: the L{iop.edge.registry.NodeRegistry}.
    @param pool: the L{iop.edge.pool.ProviderPool}.
    """

    def __init__(self, config: Callable[[], EdgeConfig], registry: NodeRegistry, pool: ProviderPool) -> None:
        self._config = config
        self.registry = registry
        self.pool = pool

    def place(
        self, spec: RunSpec, avoid: Iterable[tuple[str, str]] = (), ticket: Ticket | None = None
    ) -> defer.Deferred[Placement]:
        """
        @param spec: a L{iop.edge.spec.RunSpec}.
        @param avoid: provider resources (keys) not to place on (they
            already failed this work).
        @param ticket: the work's L{iop.edge.tenants.Ticket}, for its place
            in a queue.
        @return: a cancellable Deferred firing with a L{Placement}.
        """
        try:
            leased = self._lease(spec, frozenset(avoid), ticket)
        except ServiceError as e:
            return defer.fail(e)
        placed = leased.addCallback(self._from_lease, spec)
        placed.addErrback(self._pool_failure)
        return placed

    def retries(self, spec: RunSpec) -> int:
        """
        How many times a provider failure of C{spec}'s work may be placed
        again: its model group's C{retries}; none for work sent to an
        adapter by name.
        """
        group = self.pool.group(spec.model) if spec.model else None
        return group.retries if group is not None else 0

    def elsewhere(self, spec: RunSpec, avoid: Collection[tuple[str, str]]) -> bool:
        """
        Whether C{spec}'s model group has a healthy live provider outside
        C{avoid} that could serve it (so that placing it again can succeed;
        an ejected one, which panic mode would give it, does not count).
        """
        if not spec.model or self.pool.group(spec.model) is None:
            return False
        klass = self.pool.classify(spec.model, spec.input_chars())
        return self.pool.has_candidate(spec.model, klass, spec.node, self._acceptor(spec, avoid), panic=False)

    def _lease(self, spec: RunSpec, avoid: frozenset[tuple[str, str]], ticket: Ticket | None) -> defer.Deferred[Lease]:
        model, node_id = spec.model, spec.node
        group = self.pool.group(model) if model else None
        if node_id:
            if self._config().node(node_id) is None:
                raise ServiceError("not_found", f"no node {node_id!r} is configured")
            if group is not None:
                if not any(m.node_id == node_id for m in group.members):
                    raise ServiceError(
                        "not_found",
                        f"model group {model!r} has no provider on node {node_id!r}",
                        code="model_not_found",
                    )
                return self._pooled(spec, avoid, ticket, node_id)
            return self._direct(node_id, spec.adapter or model or "", spec, ticket)
        if group is not None:
            return self._pooled(spec, avoid, ticket)
        return self._direct(self.single_node(spec.adapter or model or ""), spec.adapter or model or "", spec, ticket)

    def _pooled(
        self, spec: RunSpec, avoid: frozenset[tuple[str, str]], ticket: Ticket | None, node_id: str | None = None
    ) -> defer.Deferred[Lease]:
        # Every provider will do (the common case): the pool's index then
        # chooses without scanning the group.
        assert spec.model is not None  # only work naming a model group is pooled
        accept = None if spec.runs and not avoid and not spec.continues else self._acceptor(spec, avoid)
        try:
            klass = self.pool.classify(spec.model, spec.input_chars())
            return self.pool.acquire(spec.model, klass, node_id, accept, ticket)
        except KeyError:
            raise _cannot_serve(f"model group {spec.model!r}", spec) from None

    def single_node(self, adapter: str) -> str:
        """
        The one ready node with the adapter C{adapter}, for work that names
        neither a node nor a model group.

        @raise ServiceError: no configured node has such an adapter (404
            C{model_not_found}: the name means nothing here, however many
            nodes are up), none of those that have it is ready (503), or
            several are (400: the name alone does not say which).
        """
        if not adapter:
            raise ServiceError("invalid", "say which adapter (or model group) should run this")
        having = self._config().nodes_with(adapter)
        if not having:
            raise ServiceError("not_found", f"no model group or adapter is called {adapter!r}", code="model_not_found")
        ready = (self.registry.ready_link(node.id) for node in having)
        links = [link for link in ready if link is not None and not link.draining and _runs(link, adapter)]
        if not links:
            raise ServiceError("unavailable", f"no node with the adapter {adapter!r} is ready", code="unavailable")
        if len(links) > 1:
            raise ServiceError(
                "invalid",
                f"{adapter!r} names no model group, and {len(links)} ready nodes have that adapter:"
                " name a node or a model group",
                code="model_not_found",
            )
        return links[0].node_id

    def _direct(self, node_id: str, adapter: str, spec: RunSpec, ticket: Ticket | None) -> defer.Deferred[Lease]:
        if not adapter:
            raise ServiceError("invalid", "say which adapter (or model group) should run this")
        node = self._config().node(node_id)
        assert node is not None  # a named node is checked, a ready one is configured
        configured = node.adapter(adapter)
        if configured is None:
            raise ServiceError(
                "not_found", f"node {node_id} has no adapter or model group {adapter!r}", code="model_not_found"
            )
        if not spec.serves(configured.type):
            raise _cannot_serve(f"adapter {adapter!r} ({configured.type})", spec)
        try:
            return self.pool.acquire_direct(node_id, adapter, ticket=ticket)
        except KeyError:
            # Configured by a reload the node has not applied (yet, or it
            # refused it): nothing of it to lease.
            raise ServiceError(
                "unavailable",
                f"node {node_id} does not run the adapter {adapter!r}: its configuration refresh is not applied",
                code="unavailable",
            ) from None

    def _from_lease(self, lease: Lease, spec: RunSpec) -> Placement:
        link = self.registry.ready_link(lease.node_id)
        if link is None or link.generation != lease.generation:
            lease.release()
            raise ServiceError("unavailable", f"node {lease.node_id} is no longer connected")
        return Placement(link, lease.adapter, lease.adapter_type, lease.target or spec.target, lease=lease)

    def _acceptor(self, spec: RunSpec, avoid: Collection[tuple[str, str]]) -> Callable[[ProviderSpec], bool]:
        """
        The providers C{spec} may go to: of a type that serves it, not one
        that already failed it, and for a run that continues a cut answer
        only one whose adapter can continue it (C{continuation: true}).
        """

        def accept(provider: ProviderSpec) -> bool:
            if not spec.serves(provider.adapter_type) or provider.key in avoid:
                return False
            return not spec.continues or self.continues(provider)

        return accept

    def continues(self, provider: ProviderSpec) -> bool:
        """
        Whether C{provider}'s adapter continues a partial answer given as a
        final assistant message (its C{continuation: true} option).
        """
        node = self._config().node(provider.node_id)
        adapter = node.adapter(provider.adapter) if node is not None else None
        return adapter is not None and adapter.options.get("continuation") is True

    def _pool_failure(self, failure: Failure) -> Failure:
        # When to come back: from the queue's measured drain rate.
        if failure.check(NoLiveProvider):
            assert isinstance(failure.value, NoLiveProvider)
            raise ServiceError("unavailable", str(failure.value), "unavailable", retry_after=failure.value.retry_after)
        if failure.check(QueueTimeout):
            assert isinstance(failure.value, QueueTimeout)
            raise ServiceError("busy", str(failure.value), "queue_timeout", retry_after=failure.value.retry_after)
        if failure.check(Overloaded):
            assert isinstance(failure.value, Overloaded)
            raise ServiceError("unavailable", str(failure.value), "overloaded", retry_after=failure.value.retry_after)
        if failure.check(QueueFull):
            assert isinstance(failure.value, QueueFull)
            raise ServiceError("busy", str(failure.value), "queue_full", retry_after=failure.value.retry_after)
        return failure


def _runs(link: NodeLink, adapter: str) -> bool:
    """
    Whether C{link}'s Node confirmed it runs C{adapter} (at registration,
    or by applying a refresh).
    """
    return any(running["name"] == adapter for running in link.adapters)


def _cannot_serve(what: str, spec: RunSpec) -> ServiceError:
    """
    A 400 naming the endpoint that C{what} has no provider for.
    """
    endpoint = "/v1" + spec.tunnel.path if spec.tunnel is not None else "normalized runs"
    return ServiceError("invalid", f"{what} has no provider that serves {endpoint}", code="unsupported_endpoint")


def adapter_types(config: EdgeConfig, name: str) -> frozenset[str]:
    """
    The adapter types of the providers that work naming C{name} (as its
    C{model}) may be placed on first, whether up or not: a model group's
    members, else every configured adapter of that name. A surface asks it
    before submitting, to know what the provider placement chooses will
    make of the work (L{RunSpec.tunnels_on}) while the caller still waits
    for nothing.
    """
    group = next((g for g in config.model_groups if g.name == name), None)
    if group is None:
        return frozenset(a.type for node in config.nodes_with(name) for a in node.adapters if a.name == name)
    types = set()
    for member in group.members:
        node = config.node(member.node_id)
        provider = next((p for p in node.providers if p.key == member.key), None) if node is not None else None
        if provider is not None:
            types.add(provider.adapter_type)
    return frozenset(types)
