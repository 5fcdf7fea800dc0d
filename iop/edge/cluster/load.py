"""
Where capacity is in the cluster: what this Edge publishes about the room
of its providers, and which Edge a request that finds no room here goes
to.

Each Edge publishes, under its lease at C{load/<edge_id>}, one small
document (looked at every L{iop.edge.cluster.membership.PUBLISH_INTERVAL_SEC}
and written only when it changed): per model group with a live provider
here, the free slots per request class (C{room}), the classes it has a
live provider for (C{live}) and its queue length (C{queued}). Only the
owning Edge leases a node's capacity; this is a hint for choosing where
to send a request, never a lease.
"""

from typing import Any, Protocol

from iop.edge.config import EdgeConfig
from iop.edge.pool import CLASSES, ProviderPool, ProviderSpec
from iop.edge.registry import NodeRegistry
from iop.edge.seam import Forward
from iop.edge.spec import RunSpec


class ClusterView(Protocol):
    """
    What this Edge sees of the cluster (L{iop.edge.cluster.membership.Membership}).
    """

    @property
    def edge_id(self) -> str: ...

    @property
    def edges(self) -> dict[str, dict[str, Any]]: ...

    @property
    def loads(self) -> dict[str, dict[str, Any]]: ...

    def owner(self, node_id: str) -> str | None: ...


def local_load(config: EdgeConfig, pool: ProviderPool) -> dict[str, Any]:
    """
    This Edge's room per model group, from the pool's snapshot.
    """
    state = pool.snapshot()
    providers = {(p["node"], p["id"]): p for p in state["providers"]}
    queued = {g["name"]: g["queued"] for g in state["model_groups"]}
    groups: dict[str, dict[str, Any]] = {}
    for group in config.model_groups:
        room = dict.fromkeys(CLASSES, 0)
        live: set[str] = set()
        for member in group.members:
            provider = providers.get((member.node_id, member.provider_id))
            if provider is None or provider["status"] != "available" or provider["health"] != "ok":
                continue
            for klass in CLASSES:
                capacity = provider["capacity"][klass]
                if capacity > 0:
                    live.add(klass)
                    room[klass] += max(capacity - provider["in_use"][klass], 0)
        if live or queued.get(group.name):
            groups[group.name] = {
                "room": room,
                "live": [k for k in CLASSES if k in live],
                "queued": queued.get(group.name, 0),
            }
    return {"groups": groups}


def _peer_url(membership: ClusterView, edge_id: str | None) -> str | None:
    """
    Where to forward to C{edge_id} (its C{advertise} URL) if it is another
    Edge, up (not draining) and reachable; else C{None}.
    """
    info = membership.edges.get(edge_id) if edge_id is not None else None
    if edge_id == membership.edge_id or not info or info.get("state") != "up":
        return None
    return info.get("advertise") or None


def choose_peer(membership: ClusterView, group: str, klass: str) -> tuple[int, str, str] | None:
    """
    The other Edge (up, not draining) that is best placed to serve a
    request of class C{klass} for C{group}: the most room, then the
    shortest queue.

    @return: C{(room, edge_id, url)} or C{None} when no other Edge has a
        live provider for it.
    """
    best: tuple[tuple[int, int, str], str, str] | None = None
    for edge_id, document in membership.loads.items():
        url = _peer_url(membership, edge_id)
        if url is None:
            continue
        entry = document.get("groups", {}).get(group)
        if not isinstance(entry, dict) or klass not in entry.get("live", ()):
            continue
        room = entry.get("room", {}).get(klass, 0)
        rank = (room, -entry.get("queued", 0), edge_id)
        if best is None or rank > best[0]:
            best = (rank, edge_id, url)
    if best is None:
        return None
    return best[0][0], best[1], best[2]


def forward_target(
    membership: ClusterView, registry: NodeRegistry, pool: ProviderPool, spec: RunSpec
) -> Forward | None:
    """
    Where a request that may be forwarded should go: C{None} to place it
    here, or a L{Forward}.

      - an explicit node connected to another Edge: that Edge;
      - a model group with room here: here;
      - else the other Edge with the most room, if any has room;
      - else (nobody has room) the other Edge with the shortest queue,
        only if no provider here could serve it after a wait.
    """
    if spec.node:
        if registry.ready_link(spec.node) is not None:
            return None
        owner = membership.owner(spec.node)
        url = _peer_url(membership, owner)
        if owner is None or url is None:
            return None
        return Forward(owner, url, f"node {spec.node} is connected there")
    if not spec.model or pool.group(spec.model) is None:
        return None
    klass = pool.classify(spec.model, spec.input_chars())

    def accept(provider: ProviderSpec) -> bool:
        return spec.serves(provider.adapter_type)

    if pool.has_room(spec.model, klass, accept):
        return None
    best = choose_peer(membership, spec.model, klass)
    if best is None:
        return None
    room, edge_id, url = best
    if room > 0:
        return Forward(edge_id, url, f"model group {spec.model!r} has no room here and {room} free there")
    if not pool.has_candidate(spec.model, klass, None, accept):
        return Forward(edge_id, url, f"model group {spec.model!r} has no live provider here")
    return None
