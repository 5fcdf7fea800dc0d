"""
The Edge's status snapshot and model list, read from the objects that own
the state (config, registry, pool, in-flight table); nothing here keeps a
copy.
"""


def snapshot(config, registry, pool, inflight):
    """
    Every configured node (connected or not) with its providers, and every
    model group with its queue length.
    """
    state = pool.snapshot()
    providers_by_node = {}
    for provider in state["providers"]:
        providers_by_node.setdefault(provider["node"], []).append(provider)
    nodes = []
    for node in config.nodes:
        link = registry.ready_link(node.id)
        entry = {
            "id": node.id,
            "connected": link is not None,
            "adapters": [{"name": a.name, "type": a.type, "max_concurrency": a.max_concurrency} for a in node.adapters],
            "providers": providers_by_node.get(node.id, []),
            "in_flight": inflight.on_node(node.id),
        }
        if link is not None:
            entry["connected_since"] = link.since
            if link.draining:
                entry["draining"] = True
        elif node.id in registry.last_seen:
            entry["last_seen"] = registry.last_seen[node.id]
        nodes.append(entry)
    return {"nodes": nodes, "model_groups": state["model_groups"]}


def model_names(config, registry):
    """
    What callers can name as C{model}: model groups, then the adapters of
    ready nodes.
    """
    names = [group.name for group in config.model_groups]
    for link in registry.ready_links():
        for adapter in config.node(link.node_id).adapters:
            if adapter.name not in names:
                names.append(adapter.name)
    return names
