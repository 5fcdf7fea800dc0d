"""
The Edge's status snapshot and model list, read from the objects that own
the state (config, registry, pool, in-flight table); nothing here keeps a
copy.
"""

from typing import Any

from iop.edge.config import EdgeConfig
from iop.edge.inflight import Inflight
from iop.edge.pool import ProviderPool
from iop.edge.registry import NodeRegistry


def snapshot(config: EdgeConfig, registry: NodeRegistry, pool: ProviderPool, inflight: Inflight) -> dict[str, Any]:
    """
    Every configured node (connected or not) with its providers, every
    model group with its queue length, and the length of each line of
    direct work that ever had a waiter.
    """
    state = pool.snapshot()
    providers_by_node: dict[str, list[dict[str, Any]]] = {}
    for provider in state["providers"]:
        providers_by_node.setdefault(provider["node"], []).append(provider)
    nodes = []
    for node in config.nodes:
        link = registry.ready_link(node.id)
        configured = [{"name": a.name, "type": a.type, "max_concurrency": a.max_concurrency} for a in node.adapters]
        entry: dict[str, Any] = {
            "id": node.id,
            "connected": link is not None,
            # What the node actually runs while connected (a refused
            # refresh leaves it on its previous adapters).
            "adapters": link.adapters if link is not None else configured,
            "providers": providers_by_node.get(node.id, []),
            "in_flight": inflight.on_node(node.id),
        }
        if link is not None:
            entry["connected_since"] = link.since
            if link.draining:
                entry["draining"] = True
            if link.refresh is not None:
                entry["config_refresh"] = dict(link.refresh)
        elif node.id in registry.last_seen:
            entry["last_seen"] = registry.last_seen[node.id]
        nodes.append(entry)
    return {"nodes": nodes, "model_groups": state["model_groups"], "direct_queues": state["direct_queues"]}


def seen_by(status: dict[str, Any], sees_all: bool) -> dict[str, Any]:
    """
    C{status} as a caller that C{sees_all} (an admin key, or an open API)
    or not sees it: for a caller key that is not an admin's, a provider's
    C{last_error} is cut to its code. The text after the code is the
    provider's own words, which can quote another key's request (a
    validation error echoing a field) or name the provider's address;
    the code still tells the caller why work is being turned away.
    Changes the snapshot in place (each one is built fresh) and returns it.
    """
    if sees_all:
        return status
    for node in status["nodes"]:
        for provider in node["providers"]:
            if "last_error" in provider:
                provider["last_error"] = provider["last_error"].split(":", 1)[0]
    return status


def model_names(config: EdgeConfig, registry: NodeRegistry) -> list[str]:
    """
    What the OpenAI surface can serve as C{model}: the model groups, and
    each adapter that exactly one ready node runs (with more, an adapter
    name alone does not say which node: L{iop.edge.placement}). What a
    node runs is what it confirmed (C{link.adapters}), not what a reload
    has just pushed to it and it may yet refuse.
    """
    names = [group.name for group in config.model_groups]
    ready: dict[str, int] = {}
    for link in registry.ready_links():
        if config.node(link.node_id) is not None and not link.draining:
            for adapter in link.adapters:
                ready[adapter["name"]] = ready.get(adapter["name"], 0) + 1
    names += [name for name, nodes in ready.items() if nodes == 1 and name not in names]
    return names
