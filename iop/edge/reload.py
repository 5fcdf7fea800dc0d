"""
What a configuration reload may change while the Edge runs.

On SIGHUP the Edge re-reads C{edge.yaml}. The adapters of configured nodes
(their options, concurrency, new or removed adapters without providers)
are applied at once (with the capacity of a provider that takes it from
its adapter's C{max_concurrency}): each ready Node whose adapters changed is pushed a
C{ConfigRefresh}. Caller and admin keys (C{api_keys}, C{admin_keys}) apply
from the next request: the HTTP surfaces read them from the running
configuration. Everything else — listeners, the metrics key, heartbeat,
the set of nodes and their tokens, providers and model groups — is owned
by running objects (listening ports, the registry, the pool), so a reload
that changes any of it is refused as a whole, naming what needs a restart.
"""

from dataclasses import fields, replace

from iop.config import ConfigError
from iop.edge.config import EdgeConfig
from iop.edge.pool import ProviderSpec

_NODE_FIELDS_NEEDING_RESTART = ("id", "token_digest", "providers")

#: Top-level fields a reload applies (C{nodes} only in their adapters).
RELOADABLE = ("nodes", "api_keys", "admin_keys")

#: The edge.yaml keys of the fields not named as their key.
_YAML_KEYS = {
    "listen_nodes": "listen.nodes",
    "listen_http": "listen.http",
    "listen_metrics": "listen.metrics",
    "listen_peer": "listen.peer",
    "heartbeat_interval": "heartbeat.interval_sec",
    "heartbeat_timeout": "heartbeat.timeout_sec",
    "command_timeouts": "commands",
}


def changed_nodes(old: EdgeConfig, new: EdgeConfig) -> list[str]:
    """
    The ids of nodes whose adapters differ between C{old} and C{new}.

    @raise ConfigError: if anything but node adapters or keys changed.
    """
    for field in fields(old):
        if field.name not in RELOADABLE and getattr(old, field.name) != getattr(new, field.name):
            key = _YAML_KEYS.get(field.name, field.name)
            raise ConfigError(f"{key} changed: restart the Edge to apply it (nothing was reloaded)")
    if [n.id for n in old.nodes] != [n.id for n in new.nodes]:
        raise ConfigError("nodes were added, removed or reordered: restart the Edge to apply it (nothing was reloaded)")
    changed = []
    for before, after in zip(old.nodes, new.nodes, strict=True):
        for name in _NODE_FIELDS_NEEDING_RESTART:
            if _as_declared(getattr(before, name)) != _as_declared(getattr(after, name)):
                shown = "token" if name == "token_digest" else name
                raise ConfigError(
                    f"nodes[{before.id}].{shown} changed: restart the Edge to apply it (nothing was reloaded)"
                )
        if before.adapters != after.adapters:
            changed.append(after.id)
    return changed


def _as_declared(value: object) -> object:
    """
    A node's field as the operator wrote it: a provider without
    C{capacity.normal} has it from its adapter's C{max_concurrency}, which
    a reload may change (L{iop.edge.links.NodeLinks} resizes it).
    """
    if isinstance(value, tuple) and all(isinstance(p, ProviderSpec) for p in value):
        return tuple(replace(p, capacity_normal=0) if p.follows_adapter else p for p in value)
    return value
