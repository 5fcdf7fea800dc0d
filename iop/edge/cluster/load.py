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
from iop.edge.pool import CLASSES, ModelGroupSpec, ProviderPool, ProviderSpec
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


#: The states of an Edge that new work is sent to.
TAKES_WORK = ("up",)

#: The states of an Edge that still serves what it holds (its nodes, the
#: runs on them): a draining Edge does until its nodes leave it.
SERVES = ("up", "draining")


def _peer_url(membership: ClusterView, edge_id: str | None, states: tuple[str, ...] = TAKES_WORK) -> str | None:
    """
    Where to forward to C{edge_id} (its C{advertise} URL) if it is another
    Edge, in one of C{states} (by default: up, not draining) and
    reachable; else C{None}.
    """
    info = membership.edges.get(edge_id) if edge_id is not None else None
    if edge_id == membership.edge_id or not info or info.get("state") not in states:
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


def node_target(
    membership: ClusterView, registry: NodeRegistry, node_id: str, states: tuple[str, ...] = SERVES
) -> Forward | None:
    """
    Where a request about C{node_id} goes: here (C{None}) while it is
    connected here, or when no other Edge in one of C{states} owns it;
    else its owner. By default an owner that is up or draining: what is
    on the node already (its runs, their readers and cancels, its
    commands) is there while the owner drains; new work for it
    (L{forward_target}) goes only to an owner that is up.
    """
    if registry.ready_link(node_id) is not None:
        return None
    owner = membership.owner(node_id)
    url = _peer_url(membership, owner, states)
    if owner is None or url is None:
        return None
    return Forward(owner, url, f"node {node_id} is connected there")


def group_owner(membership: ClusterView, group: ModelGroupSpec) -> tuple[str, str] | None:
    """
    The other Edge (up, not draining) that owns the most of C{group}'s
    nodes (ties: the lower id), whether or not it has published room for
    them yet.

    @return: C{(edge_id, url)} or C{None} when no other Edge owns one.
    """
    owned: dict[str, int] = {}
    for node_id in dict.fromkeys(member.node_id for member in group.members):
        owner = membership.owner(node_id)
        if owner is not None and _peer_url(membership, owner) is not None:
            owned[owner] = owned.get(owner, 0) + 1
    if not owned:
        return None
    edge_id = min(owned, key=lambda edge: (-owned[edge], edge))
    url = _peer_url(membership, edge_id)
    assert url is not None  # (counted only with one)
    return edge_id, url


def forward_target(
    membership: ClusterView, registry: NodeRegistry, pool: ProviderPool, spec: RunSpec
) -> Forward | None:
    """
    Where a request that may be forwarded should go: C{None} to place it
    here, or a L{Forward}.

      - an explicit node connected to another Edge: that Edge;
      - a model group with room here: here;
      - else the other Edge with the most room, if any has room;
      - else, only if no provider here could serve it after a wait: the
        other Edge with the shortest queue, or, before any other Edge
        published room for the group, the one that owns its nodes (to
        wait there rather than fail here).
    """
    if spec.node:
        return node_target(membership, registry, spec.node, TAKES_WORK)
    group = pool.group(spec.model) if spec.model else None
    if group is None:
        return None
    klass = pool.classify(group.name, spec.input_chars())

    def accept(provider: ProviderSpec) -> bool:
        return spec.serves(provider.adapter_type)

    if pool.has_room(group.name, klass, accept):
        return None
    best = choose_peer(membership, group.name, klass)
    if best is not None and best[0] > 0:
        room, edge_id, url = best
        return Forward(edge_id, url, f"model group {group.name!r} has no room here and {room} free there")
    if pool.has_candidate(group.name, klass, None, accept):
        return None
    if best is not None:
        _, edge_id, url = best
        return Forward(edge_id, url, f"model group {group.name!r} has no live provider here")
    owner = group_owner(membership, group)
    if owner is None:
        return None
    edge_id, url = owner
    return Forward(edge_id, url, f"model group {group.name!r} has its nodes there")
