"""
The C{cluster:} section of C{edge.yaml} (and C{listen.peer}).

  cluster:
    etcd: ["http://10.0.0.5:2379", "http://10.0.0.6:2379"]
    edge_id: edge-a            # unique in the cluster
    advertise: "http://10.0.0.1:7180"   # where other Edges reach listen.peer
    prefix: /iop/              # every key the cluster writes starts with it
    lease_ttl_sec: 5           # membership and ownership lease
    relist_sec: 30             # the view is listed again this often
    secret: "shared by every Edge of the cluster"

Without the section the Edge runs alone, exactly as before.
"""

import math
import re
from dataclasses import dataclass, field

from iop.config import Section

#: What an edge id may be: it is part of etcd keys and log lines.
_EDGE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")

#: The shortest lease: keep-alives go every third of it, and a shorter one
#: would expire on a single slow round trip.
MIN_LEASE_TTL_SEC = 2

#: How often the view is listed again by default (a silent watch is found
#: within it; each listing reads the whole prefix).
RELIST_SEC = 30.0


@dataclass(frozen=True)
class ClusterSpec:
    etcd: tuple[str, ...]
    edge_id: str
    advertise: str
    secret: str = field(repr=False)
    prefix: str = "/iop/"
    lease_ttl_sec: int = 5
    relist_sec: float = RELIST_SEC


def parse_cluster(section: Section, listen: Section) -> ClusterSpec:
    """
    @param section: the C{cluster} L{iop.config.Section}.
    @param listen: the C{listen} section (C{peer} is required with a cluster).
    @raise ConfigError: naming the key.
    """
    section.unknown({"etcd", "edge_id", "advertise", "prefix", "lease_ttl_sec", "relist_sec", "secret"})
    endpoints = section.get("etcd", (list, str))
    if isinstance(endpoints, str):
        endpoints = [endpoints]
    if not endpoints:
        raise section.error("etcd", "must list at least one etcd endpoint")
    for i, endpoint in enumerate(endpoints):
        if not isinstance(endpoint, str) or not endpoint.startswith(("http://", "https://")):
            raise section.error(f"etcd[{i}]", f"must be an http:// or https:// URL, got {endpoint!r}")
    edge_id = section.get("edge_id", str)
    if not _EDGE_ID.match(edge_id):
        raise section.error("edge_id", "must be 1-63 letters, digits, '.', '_' or '-', starting with a letter or digit")
    advertise = section.get("advertise", str)
    if not advertise.startswith(("http://", "https://")):
        raise section.error("advertise", f"must be the http:// URL of this Edge's listen.peer, got {advertise!r}")
    prefix = section.get("prefix", str, "/iop/")
    if not prefix:
        raise section.error("prefix", "must not be empty")
    if not prefix.endswith("/"):
        prefix += "/"
    ttl = section.get("lease_ttl_sec", int, 5)
    if ttl < MIN_LEASE_TTL_SEC:
        raise section.error("lease_ttl_sec", f"must be at least {MIN_LEASE_TTL_SEC}")
    relist = section.number("relist_sec", RELIST_SEC, positive=True)
    if not math.isfinite(relist):
        raise section.error("relist_sec", f"must be a finite number of seconds, got {relist!r}")
    if "secret" not in section.data:
        raise section.error("secret", "required: other Edges authenticate with it on listen.peer")
    secret = section.data["secret"]
    if not isinstance(secret, str) or len(secret) < 16:
        raise section.error("secret", "must be a string of at least 16 characters")
    if listen.data.get("peer") is None:
        raise listen.error("peer", "required with cluster: the endpoint other Edges forward requests to")
    return ClusterSpec(
        etcd=tuple(e.rstrip("/") for e in endpoints),
        edge_id=edge_id,
        advertise=advertise.rstrip("/"),
        secret=secret,
        prefix=prefix,
        lease_ttl_sec=ttl,
        relist_sec=float(relist),
    )
