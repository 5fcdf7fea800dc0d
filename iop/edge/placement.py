"""
Where a piece of work goes: a model group's provider (through the pool,
with a lease, maybe after waiting in its queue), an explicit node, or the
single ready node.

The placer only chooses and leases; starting the work is the service's
job, and the lease it returns belongs to whoever starts the work.
"""

from twisted.internet import defer

from iop.edge.dispatch import Placement
from iop.edge.errors import ServiceError
from iop.edge.pool import NoLiveProvider, QueueFull, QueueTimeout


class Placer:
    """
    @param config: the Edge's running L{iop.edge.config.EdgeConfig}
        (read through C{config()}, which follows reloads).
    @param registry: the L{iop.edge.registry.NodeRegistry}.
    @param pool: the L{iop.edge.pool.ProviderPool}.
    """

    def __init__(self, config, registry, pool):
        self._config = config
        self.registry = registry
        self.pool = pool

    def place(self, spec):
        """
        @param spec: a L{iop.edge.spec.RunSpec}.
        @return: a cancellable Deferred firing with a L{Placement}.
        """
        model = spec.model
        if model is not None and self.pool.group(model) is not None:
            klass = self.pool.classify(model, spec.input_chars())
            d = self.pool.acquire(model, klass)
            d.addCallback(self._from_lease)
            d.addErrback(self._pool_failure)
            return d
        try:
            return defer.succeed(self.direct(spec.adapter or model or "", spec.node, spec.target))
        except ServiceError as e:
            return defer.fail(e)

    def _from_lease(self, lease):
        link = self.registry.ready_link(lease.node_id)
        if link is None or link.generation != lease.generation:
            lease.release()
            raise ServiceError("unavailable", f"node {lease.node_id} is no longer connected")
        return Placement(link, lease.adapter, lease.adapter_type, lease.target, lease=lease)

    def _pool_failure(self, failure):
        if failure.check(NoLiveProvider):
            raise ServiceError("unavailable", str(failure.value), code="unavailable")
        if failure.check(QueueTimeout):
            raise ServiceError("busy", str(failure.value), code="queue_timeout")
        if failure.check(QueueFull):
            raise ServiceError("busy", str(failure.value), code="queue_full")
        return failure

    def direct(self, adapter, node_id, target=""):
        """
        Place on an adapter by name: on C{node_id}, or on the single ready
        node when none is named.

        @raise ServiceError: no such node or adapter, or no single node.
        """
        config = self._config()
        if not adapter:
            raise ServiceError("invalid", "say which adapter (or model group) should run this")
        if node_id:
            if config.node(node_id) is None:
                raise ServiceError("not_found", f"no node {node_id!r} is configured")
            link = self.registry.ready_link(node_id)
            if link is None:
                raise ServiceError("unavailable", f"node {node_id} is not connected")
            if link.draining:
                raise ServiceError("unavailable", f"node {node_id} is shutting down", code="node_draining")
        else:
            links = [link for link in self.registry.ready_links() if not link.draining]
            if len(links) != 1:
                raise ServiceError(
                    "unavailable" if not links else "invalid",
                    f"{adapter!r} names no model group, and {len(links)} nodes are ready: name a node",
                )
            link = links[0]
        spec = config.node(link.node_id).adapter(adapter)
        if spec is None:
            raise ServiceError("not_found", f"node {link.node_id} has no adapter or model group {adapter!r}")
        return Placement(link, spec.name, spec.type, target)
