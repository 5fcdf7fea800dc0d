"""
The Edge's configuration, C{edge.yaml}: listeners, every Node it knows,
their adapters and providers, and the model groups callers address.

The Edge owns the configuration of every Node: a Node brings only its
token, and receives its adapters in L{iop.protocols.messages.node_config}.
So each adapter is checked here with the Node's own build
(L{iop.adapters.registry.check_adapter}), and each listen endpoint parsed:
a mistake stops the Edge at start, naming its key.
"""

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from twisted.internet.endpoints import serverFromString
from twisted.internet.testing import MemoryReactor

from iop.adapters.registry import COMMON_KEYS, AdapterConfigError, check_adapter
from iop.config import ConfigError, Section, load_yaml
from iop.edge.cluster.config import ClusterSpec, parse_cluster
from iop.edge.keys import KeySpec, parse_key, parse_keys
from iop.edge.limits import Limits, parse_limits
from iop.edge.nodetls import NodeTLSSpec, parse_node_tls
from iop.edge.pool import GroupMember, HealthPolicy, ModelGroupSpec, ProviderSpec
from iop.edge.tracing import TracingSpec, parse_tracing
from iop.logs import parse_log_format
from iop.run import ADAPTER_TYPES

#: Node command timeouts: short for questions, long for a model pull.
DEFAULT_COMMAND_TIMEOUTS: dict[str | None, float] = {None: 10.0, "ollama_pull": 3600.0}


@dataclass(frozen=True)
class AdapterSpec:
    name: str
    type: str
    max_concurrency: int
    options: dict[str, Any]


@dataclass(frozen=True)
class NodeSpec:
    """
    One configured Node. Exactly one of C{token} / C{token_sha256} is set;
    L{token_digest} is what registration compares against.
    """

    id: str
    token_digest: bytes
    adapters: tuple[AdapterSpec, ...]
    providers: tuple[ProviderSpec, ...]

    def adapter(self, name: str) -> AdapterSpec | None:
        for adapter in self.adapters:
            if adapter.name == name:
                return adapter
        return None

    def implicit_resources(self) -> tuple[ProviderSpec, ...]:
        """
        A resource for each adapter no provider names, with the adapter's
        whole C{max_concurrency} as C{normal} capacity; its id is the
        adapter's name.
        """
        named = {p.adapter for p in self.providers}
        return tuple(
            ProviderSpec(self.id, a.name, a.name, a.type, a.max_concurrency, 0, implicit=True)
            for a in self.adapters
            if a.name not in named
        )


@dataclass(frozen=True)
class RunLogSpec:
    """
    C{run_log}: what the Edge keeps of runs in memory for replay (docs in
    L{iop.edge.runs}); beyond it, the Nodes' stores answer.

    @ivar max_bytes: events kept per run (the oldest go first).
    @ivar max_age_sec: how long a finished run stays in memory.
    @ivar max_runs: how many finished runs stay in memory at most.
    """

    max_bytes: int = 1024 * 1024
    max_age_sec: float = 600.0
    max_runs: int = 1000


@dataclass(frozen=True)
class ManholeSpec:
    """
    The operator console: where it listens (checked to be loopback), its
    users with their authorized SSH public keys (C{{name: (key, ...)}},
    OpenSSH form), and where its host key is kept.
    """

    listen: str
    users: dict[str, tuple[bytes, ...]]
    host_key: str = ".iop-manhole/host_key"


@dataclass
class EdgeConfig:
    listen_nodes: str
    listen_http: str
    metrics: bool = True
    heartbeat_interval: float = 2.0
    heartbeat_timeout: float = 5.0
    nodes: list[NodeSpec] = field(default_factory=list)
    model_groups: list[ModelGroupSpec] = field(default_factory=list)
    api_keys: tuple[KeySpec, ...] = ()
    admin_keys: tuple[KeySpec, ...] = ()
    #: The key C{/metrics} requires, if any.
    metrics_key: KeySpec | None = None
    #: A separate endpoint for C{/metrics} (then not on the HTTP port).
    listen_metrics: str | None = None
    manhole: ManholeSpec | None = None
    run_grace_sec: float = 10.0
    #: How long a stopping Edge lets work in flight finish before ending it.
    shutdown_grace_sec: float = 30.0
    #: How long work sent to an adapter by name may wait for room.
    direct_queue_timeout_sec: float = 30.0
    #: How long the Edge waits for a node command's answer, by command;
    #: the key C{None} holds the default for the others.
    command_timeouts: dict[str | None, float] = field(default_factory=lambda: dict(DEFAULT_COMMAND_TIMEOUTS))
    #: When a failing provider is ejected, and for how long.
    health: HealthPolicy = field(default_factory=HealthPolicy)
    #: One structured log line per HTTP request (off: none).
    access_log: bool = True

    def command_timeout(self, command: str | None) -> float:
        return self.command_timeouts.get(command, self.command_timeouts[None])

    #: C{text} (twistd's lines) or C{json} (one JSON object per line).
    log_format: str = "text"
    #: What the Edge keeps of runs in memory.
    run_log: RunLogSpec = RunLogSpec()
    #: How long a background run whose Node's link was lost waits for the
    #: Node to come back and report it.
    reattach_timeout_sec: float = 120.0
    #: How long a Node connection may take to have its registration
    #: accepted before it is closed.
    register_timeout_sec: float = 10.0
    #: What strangers can make the Edge spend (C{limits:}).
    limits: Limits = field(default_factory=Limits)
    #: Mutual TLS on the Node port (C{node_tls:}), if configured.
    node_tls: NodeTLSSpec | None = None
    #: Membership of an Edge cluster (C{cluster:}, docs/cluster.md), if any.
    cluster: ClusterSpec | None = None
    #: Where other Edges of the cluster forward requests (C{listen.peer}).
    listen_peer: str | None = None
    #: OpenTelemetry spans of caller requests (C{tracing:}), if configured.
    tracing: TracingSpec | None = None

    def node(self, node_id: str) -> NodeSpec | None:
        """
        The configured node C{node_id}, from an index of C{nodes} (asked
        per request: a request must not cost a scan of the fleet). The
        index is made again when C{nodes} is another list, or grew or
        shrank.
        """
        found: NodeSpec | None = self._index()[0].get(node_id)
        return found

    def nodes_with(self, adapter: str) -> tuple[NodeSpec, ...]:
        """
        The configured nodes with an adapter named C{adapter}, in
        configuration order (from the same index as L{node}).
        """
        return self._index()[1].get(adapter, ())

    def _index(self) -> tuple[dict[str, NodeSpec], dict[str, tuple[NodeSpec, ...]]]:
        """
        The nodes by id and by adapter name, made again when C{nodes} is
        another list, or grew or shrank.
        """
        cached = self.__dict__.get("_node_index")
        if cached is not None and cached[0] is self.nodes and cached[1] == len(self.nodes):
            index: tuple[dict[str, NodeSpec], dict[str, tuple[NodeSpec, ...]]] = cached[2]
            return index
        by_adapter: dict[str, list[NodeSpec]] = {}
        for node in self.nodes:
            for adapter in node.adapters:
                by_adapter.setdefault(adapter.name, []).append(node)
        index = ({node.id: node for node in self.nodes}, {k: tuple(v) for k, v in by_adapter.items()})
        self.__dict__["_node_index"] = (self.nodes, len(self.nodes), index)
        return index

    def providers(self) -> list[ProviderSpec]:
        """
        Every provider resource of every node, in configuration order: the
        configured providers, then one implicit resource for each adapter
        that no provider names (so direct work on it holds a lease too).
        """
        return [provider for node in self.nodes for provider in node.providers + node.implicit_resources()]


def token_digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8")).digest()


#: What C{token_sha256} must not be: an empty token's digest would let
#: anyone who sends an empty token register as the node.
_EMPTY_TOKEN_DIGEST = token_digest("")


def load(path: str) -> EdgeConfig:
    """
    Read and validate C{edge.yaml}.

    @raise ConfigError: naming the file and key of the first problem.
    """
    return parse(load_yaml(path))


def parse(top: Section) -> EdgeConfig:
    top.unknown(
        {
            "listen",
            "heartbeat",
            "nodes",
            "model_groups",
            "api_keys",
            "admin_keys",
            "metrics_key",
            "manhole",
            "metrics",
            "run_grace_sec",
            "shutdown_grace_sec",
            "direct_queue_timeout_sec",
            "commands",
            "health",
            "access_log",
            "log_format",
            "run_log",
            "reattach_timeout_sec",
            "register_timeout_sec",
            "limits",
            "node_tls",
            "cluster",
            "tracing",
        }
    )
    listen = top.section("listen")
    listen.unknown({"nodes", "http", "metrics", "peer"})
    heartbeat = top.section("heartbeat", None)
    heartbeat.unknown({"interval_sec", "timeout_sec"})
    config = EdgeConfig(
        listen_nodes=listen.get("nodes", str),
        listen_http=listen.get("http", str),
        listen_metrics=listen.get("metrics", str, None),
        metrics=top.get("metrics", bool, True),
        heartbeat_interval=heartbeat.number("interval_sec", 2.0, positive=True),
        heartbeat_timeout=heartbeat.number("timeout_sec", 5.0, positive=True),
        api_keys=parse_keys(top, "api_keys"),
        admin_keys=parse_keys(top, "admin_keys"),
        metrics_key=parse_key(top, "metrics_key"),
        run_grace_sec=top.number("run_grace_sec", 10.0, positive=True),
        shutdown_grace_sec=top.number("shutdown_grace_sec", 30.0, minimum=0),
        direct_queue_timeout_sec=top.number("direct_queue_timeout_sec", 30.0, positive=True),
        access_log=top.get("access_log", bool, True),
        log_format=parse_log_format(top),
        register_timeout_sec=top.number("register_timeout_sec", 10.0, positive=True),
        limits=parse_limits(top.section("limits", None)),
    )
    if config.heartbeat_timeout <= config.heartbeat_interval:
        raise heartbeat.error("timeout_sec", "must be longer than interval_sec")
    config.nodes = [_node(section) for section in top.sections("nodes")]
    _unique(top, "nodes", [node.id for node in config.nodes])
    _unique(top, "nodes", [node.token_digest for node in config.nodes], what="token")
    group_sections = top.sections("model_groups", [])
    config.model_groups = [_group(section, config) for section in group_sections]
    _unique(top, "model_groups", [group.name for group in config.model_groups], what="name")
    _check_fallbacks(config.model_groups, group_sections)
    _check_key_names(top, config)
    if "manhole" in top.data:
        config.manhole = _manhole(top.section("manhole"))
    config.command_timeouts = _command_timeouts(top.section("commands", None))
    config.health = _health(top.section("health", None))
    config.run_log = _run_log(top.section("run_log", None))
    config.reattach_timeout_sec = float(top.number("reattach_timeout_sec", 120.0, positive=True))
    config.tracing = parse_tracing(top.section("tracing", None))
    if top.data.get("node_tls") is not None:
        config.node_tls = parse_node_tls(top.section("node_tls"), listen)
    if top.data.get("cluster") is not None:
        config.cluster = parse_cluster(top.section("cluster"), listen)
        config.listen_peer = listen.get("peer", str)
    elif listen.data.get("peer") is not None:
        raise listen.error("peer", "only means something with cluster (an Edge cluster on etcd)")
    # Last: what node_tls and cluster say of them is more to the point.
    for name in ("nodes", "http", "metrics", "peer"):
        _server_endpoint(listen, name, listen.data.get(name))
    return config


def _run_log(section: Section) -> RunLogSpec:
    """
    C{run_log: {max_bytes: 1048576, max_age_sec: 600, max_runs: 1000}}.
    """
    section.unknown({"max_bytes", "max_age_sec", "max_runs"})
    default = RunLogSpec()
    max_bytes = section.get("max_bytes", int, default.max_bytes)
    if max_bytes < 1024:
        raise section.error("max_bytes", f"must be at least 1024, got {max_bytes!r}")
    max_runs = section.get("max_runs", int, default.max_runs)
    if max_runs < 0:
        raise section.error("max_runs", f"must not be negative, got {max_runs!r}")
    return RunLogSpec(
        max_bytes=max_bytes,
        max_age_sec=float(section.number("max_age_sec", default.max_age_sec, minimum=0)),
        max_runs=max_runs,
    )


def _health(section: Section) -> HealthPolicy:
    """
    C{health: {failures_to_eject: 3, cooldown_sec: 30, max_cooldown_sec: 300,
    probe_interval_sec: 5}}.
    """
    section.unknown({"failures_to_eject", "cooldown_sec", "max_cooldown_sec", "probe_interval_sec"})
    failures = section.get("failures_to_eject", int, 3)
    if failures < 1:
        raise section.error("failures_to_eject", "must be at least 1")
    cooldown = section.number("cooldown_sec", 30.0, positive=True)
    cap = section.number("max_cooldown_sec", max(300.0, cooldown), positive=True)
    if cap < cooldown:
        raise section.error("max_cooldown_sec", "must not be below cooldown_sec")
    probe = section.number("probe_interval_sec", HealthPolicy.probe_interval_sec, minimum=0)
    return HealthPolicy(
        failures_to_eject=failures, cooldown_sec=cooldown, max_cooldown_sec=cap, probe_interval_sec=float(probe)
    )


def _command_timeouts(section: Section) -> dict[str | None, float]:
    """
    C{commands: {timeout_sec: 10, timeouts: {ollama_pull: 3600}}}.
    """
    section.unknown({"timeout_sec", "timeouts"})
    timeouts = dict(DEFAULT_COMMAND_TIMEOUTS)
    timeouts[None] = section.number("timeout_sec", DEFAULT_COMMAND_TIMEOUTS[None], positive=True)
    per_command = section.section("timeouts", None)
    for name in per_command.data:
        timeouts[name] = per_command.number(name, positive=True)
    return timeouts


def _unique(section: Section, name: str, values: list[str] | list[bytes], what: str = "id") -> None:
    seen: set[str | bytes] = set()
    for value in values:
        if value in seen:
            shown = value if isinstance(value, str) else "(hidden)"
            raise section.error(name, f"duplicate {what} {shown}")
        seen.add(value)


def _node(section: Section) -> NodeSpec:
    section.unknown({"id", "token", "token_sha256", "adapters", "providers"})
    node_id = section.get("id", str)
    has_plain, has_hash = "token" in section.data, "token_sha256" in section.data
    if has_plain == has_hash:
        raise section.error("token", "exactly one of token or token_sha256 is required")
    if has_plain:
        token = section.get("token", str)
        if not token.strip():
            # node.yaml refuses such a token: only a stranger could send it.
            raise section.error("token", "must not be empty")
        digest = token_digest(token)
    else:
        hexdigest = section.get("token_sha256", str)
        try:
            digest = bytes.fromhex(hexdigest)
        except ValueError:
            digest = b""
        if len(digest) != 32:
            raise section.error("token_sha256", "must be 64 hexadecimal digits")
        if digest == _EMPTY_TOKEN_DIGEST:
            raise section.error("token_sha256", "is the SHA-256 of the empty token (no Node can send that one)")
    adapters = tuple(_adapter(a) for a in section.sections("adapters"))
    _unique(section, "adapters", [a.name for a in adapters], what="name")
    by_name = {a.name: a for a in adapters}
    provider_sections = section.sections("providers", [])
    declared = [_provider(p, node_id, by_name) for p in provider_sections]
    _unique(section, "providers", [d[0] for d in declared])
    providers = _fill_capacity(node_id, declared, provider_sections)
    return NodeSpec(id=node_id, token_digest=digest, adapters=adapters, providers=providers)


#: The largest C{max_concurrency} the wire carries (a uint32).
MAX_UINT32 = 2**32 - 1


def _adapter(section: Section) -> AdapterSpec:
    name = section.get("name", str)
    kind = section.get("type", str)
    if kind not in ADAPTER_TYPES:
        raise section.error("type", f"unknown adapter type {kind!r} (known: {', '.join(sorted(ADAPTER_TYPES))})")
    concurrency = section.get("max_concurrency", int, 1)
    if not 1 <= concurrency <= MAX_UINT32:
        raise section.error("max_concurrency", f"must be from 1 to {MAX_UINT32}")
    options = {k: v for k, v in section.data.items() if k not in COMMON_KEYS}
    try:
        # As the Node gets them: JSON (where a YAML key such as 123, a
        # number, is a string, so the keys sort when the payload is made).
        sent = json.loads(json.dumps(options))
    except (TypeError, ValueError) as e:
        raise section.error("options", f"not representable as JSON: {e}") from None
    try:
        # The Node's own build, on the options as the Node gets them: a bad
        # or unknown option stops the Edge at start, not every Node it is
        # sent to (which could only refuse it and exit).
        check_adapter(name, kind, concurrency, sent)
    except AdapterConfigError as e:
        raise section.error(e.key, e.problem) from None
    return AdapterSpec(name=name, type=kind, max_concurrency=concurrency, options=sent)


def _server_endpoint(section: Section, name: str, description: str | None) -> None:
    """
    Parse the server endpoint string at C{name} (when given) as the Edge
    will when it listens, without listening: a mistake stops the Edge at
    load naming the key, not in a traceback from building its listeners.
    """
    if description is None:
        return
    try:
        serverFromString(MemoryReactor(), description)
    except Exception as e:
        raise section.error(name, f"not a valid server endpoint string ({e})") from None


def _provider(
    section: Section, node_id: str, adapters: dict[str, AdapterSpec]
) -> tuple[str, AdapterSpec, int | None, int]:
    """
    One provider as declared. A C{normal} capacity left out is C{None}
    here: L{_fill_capacity} gives it what its adapter has left.
    """
    section.unknown({"id", "adapter", "capacity"})
    provider_id = section.get("id", str)
    adapter_name = section.get("adapter", str, provider_id)
    if adapter_name not in adapters:
        raise section.error("adapter", f"names no adapter of node {node_id}: {adapter_name!r}")
    if provider_id in adapters and provider_id != adapter_name:
        raise section.error("id", f"{provider_id!r} is the name of another adapter of node {node_id}")
    capacity = section.section("capacity", None)
    capacity.unknown({"normal", "long"})
    adapter = adapters[adapter_name]
    normal = capacity.get("normal", int, None)
    long = capacity.get("long", int, 0)
    if (normal is not None and normal < 0) or long < 0:
        raise capacity.error("long" if long < 0 else "normal", "must not be negative")
    return (provider_id, adapter, normal, long)


def _fill_capacity(
    node_id: str, declared: list[tuple[str, AdapterSpec, int | None, int]], sections: list[Section]
) -> tuple[ProviderSpec, ...]:
    """
    Give each provider its capacity, and check that the providers of one
    adapter never promise more than it takes: for every adapter, the sum of
    C{normal + long} over the providers naming it must not exceed its
    C{max_concurrency} (the Node's gate would refuse the rest). A provider
    without C{normal} takes what the adapter's other providers leave (and
    follows the adapter's C{max_concurrency} on a reload); at most one
    provider per adapter may leave it out.
    """
    providers = []
    promised: dict[str, int] = {}
    for (provider_id, adapter, normal, long), section in zip(declared, sections, strict=True):
        siblings = [d for d in declared if d[1] is adapter]
        if normal is None:
            if sum(1 for d in siblings if d[2] is None) > 1:
                raise section.error(
                    "capacity",
                    f"several providers of adapter {adapter.name} leave capacity.normal out: give each its own",
                )
            others = sum(d[3] + (d[2] or 0) for d in siblings if d[0] != provider_id)
            taken = max(adapter.max_concurrency - others - long, 0)
        else:
            taken = normal
        promised[adapter.name] = promised.get(adapter.name, 0) + taken + long
        if promised[adapter.name] > adapter.max_concurrency:
            raise section.error(
                "capacity",
                f"providers of adapter {adapter.name} promise {promised[adapter.name]} slots (normal + long),"
                f" more than its max_concurrency of {adapter.max_concurrency}",
            )
        providers.append(
            ProviderSpec(
                node_id=node_id,
                provider_id=provider_id,
                adapter=adapter.name,
                adapter_type=adapter.type,
                capacity_normal=taken,
                capacity_long=long,
                follows_adapter=normal is None,
            )
        )
    return tuple(providers)


def _group(section: Section, config: EdgeConfig) -> ModelGroupSpec:
    section.unknown(
        {
            "name",
            "providers",
            "queue_timeout_sec",
            "max_queue",
            "long_threshold_chars",
            "retries",
            "fallbacks",
            "context_fallbacks",
        }
    )
    members: list[GroupMember] = []
    for member in section.sections("providers"):
        member.unknown({"node", "provider", "target", "priority"})
        node_id = member.get("node", str)
        provider_id = member.get("provider", str)
        node = config.node(node_id)
        if node is None:
            raise member.error("node", f"names no configured node: {node_id!r}")
        if not any(p.provider_id == provider_id for p in node.providers):
            raise member.error("provider", f"node {node_id} has no provider {provider_id!r}")
        if any(m.node_id == node_id and m.provider_id == provider_id for m in members):
            # The pool keeps one member per provider: a second listing
            # (another target or priority) would be silently dropped.
            raise ConfigError(f"{member.source}: {member.path}: lists provider {node_id}/{provider_id} twice")
        priority = member.get("priority", int, 0)
        if priority < 0:
            raise member.error("priority", f"must not be negative, got {priority!r}")
        members.append(
            GroupMember(
                node_id=node_id, provider_id=provider_id, target=member.get("target", str, ""), priority=priority
            )
        )
    if not members:
        raise section.error("providers", "must list at least one provider")
    max_queue = section.get("max_queue", int, None)
    if max_queue is not None and max_queue < 0:
        raise section.error("max_queue", "must not be negative")
    threshold = section.get("long_threshold_chars", int, None)
    retries = section.get("retries", int, 1)
    if retries < 0:
        raise section.error("retries", "must not be negative")
    return ModelGroupSpec(
        name=section.get("name", str),
        members=tuple(members),
        queue_timeout_sec=section.number("queue_timeout_sec", 30.0, positive=True),
        max_queue=max_queue,
        long_threshold_chars=threshold,
        retries=retries,
        fallbacks=_group_names(section, "fallbacks"),
        context_fallbacks=_group_names(section, "context_fallbacks"),
    )


def _group_names(section: Section, name: str) -> tuple[str, ...]:
    """
    A list of model group names (C{fallbacks}, C{context_fallbacks}),
    without repeats.
    """
    names = section.get(name, list, [])
    for i, value in enumerate(names):
        if not isinstance(value, str) or not value:
            raise section.error(f"{name}[{i}]", f"must be the name of a model group, got {value!r}")
    _unique(section, name, names, what="model group")
    return tuple(names)


def _check_key_names(top: Section, config: EdgeConfig) -> None:
    """
    An admin key and another caller key may not share a name: a name owns
    runs and sessions, and the caller key would own the admin's. (The same
    key in both lists is one owner, and fine.)
    """
    callers = {spec.name: spec.digest for spec in config.api_keys}
    for i, spec in enumerate(config.admin_keys):
        if callers.get(spec.name, spec.digest) != spec.digest:
            raise top.error(
                f"admin_keys[{i}].name",
                f"{spec.name!r} is also the name of another key in api_keys (a name owns runs and sessions)",
            )


def _check_fallbacks(groups: list[ModelGroupSpec], sections: list[Section]) -> None:
    """
    Every C{fallbacks} and C{context_fallbacks} entry names another
    configured model group, and following either never leads back to the
    group it started from.
    """
    by_name = {group.name: group for group in groups}
    for field_name in ("fallbacks", "context_fallbacks"):
        for group, section in zip(groups, sections, strict=True):
            for i, name in enumerate(getattr(group, field_name)):
                if name == group.name:
                    raise section.error(f"{field_name}[{i}]", f"a model group cannot fall back to itself ({name!r})")
                if name not in by_name:
                    raise section.error(f"{field_name}[{i}]", f"names no configured model group: {name!r}")
            cycle = _cycle(group.name, by_name, field_name)
            if cycle:
                raise section.error(field_name, f"falls back in a circle: {' -> '.join(cycle)}")


def _cycle(start: str, by_name: dict[str, ModelGroupSpec], field_name: str) -> tuple[str, ...] | None:
    """
    A path of C{field_name} links from C{start} back to it, or C{None}.
    """
    stack: list[tuple[str, tuple[str, ...]]] = [(start, (start,))]
    seen: set[str] = set()
    while stack:
        name, path = stack.pop()
        for step in getattr(by_name[name], field_name):
            if step == start:
                return (*path, step)
            if step not in seen:
                seen.add(step)
                stack.append((step, (*path, step)))
    return None


def _manhole(section: Section) -> ManholeSpec:
    from iop.edge.endpoints import EndpointError, loopback_interface
    from iop.edge.sshkeys import BadKey, parse_public_key, read_authorized_keys

    section.unknown({"listen", "users", "host_key"})
    listen = section.get("listen", str, "tcp:7122:interface=127.0.0.1")
    try:
        loopback_interface(listen)
    except EndpointError as e:
        raise section.error("listen", f"the console must be bound to a loopback address: {e}") from None
    _server_endpoint(section, "listen", listen)
    users = section.section("users")
    if not users.data:
        raise section.error("users", "must define at least one user: the console is never open")
    keys: dict[str, tuple[bytes, ...]] = {}
    for name, value in users.data.items():
        if isinstance(value, str):
            # One public key line, the shortest way to name a user's key.
            try:
                keys[name] = (parse_public_key(value),)
            except BadKey:
                raise users.error(
                    name,
                    "must be one SSH public key line (ssh-ed25519 AAAA...) or {authorized_keys: a file in"
                    " OpenSSH authorized_keys format, or a list of public keys}; this string is not a public key",
                ) from None
            continue
        if not isinstance(value, dict):
            raise users.error(
                name, "must be one SSH public key line or {authorized_keys: a file or a list of public keys}"
            )
        user = users.section(name)
        user.unknown({"authorized_keys"})
        given = user.get("authorized_keys", (str, list))
        try:
            if isinstance(given, str):
                keys[name] = read_authorized_keys(given)
            else:
                if not given:
                    raise user.error("authorized_keys", "must list at least one key")
                for i, line in enumerate(given):
                    if not isinstance(line, str):
                        raise user.error(f"authorized_keys[{i}]", "must be a string")
                keys[name] = tuple(parse_public_key(line) for line in given)
        except BadKey as e:
            raise user.error("authorized_keys", str(e)) from None
    return ManholeSpec(listen=listen, users=keys, host_key=section.get("host_key", str, ManholeSpec.host_key))


__all__ = ["ConfigError", "EdgeConfig", "NodeSpec", "AdapterSpec", "load", "parse", "token_digest"]
