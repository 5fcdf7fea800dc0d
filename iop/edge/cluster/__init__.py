"""
Several Edges as one cluster, coordinated through etcd (docs/cluster.md).

  - L{iop.edge.cluster.etcd}: the etcd v3 client (its JSON gateway, over treq);
  - L{iop.edge.cluster.config}: the C{cluster:} section of C{edge.yaml};
  - L{iop.edge.cluster.membership}: this Edge's lease and membership key,
    node ownership by transaction (fenced by the key's revision), and the
    cluster view every Edge watches;
  - L{iop.edge.cluster.load}: what this Edge publishes about its room;
  - L{iop.edge.cluster.forward}: a request proxied to the owning Edge's
    peer listener.

An Edge without C{cluster} starts none of it (it only reads the section
and knows the L{iop.edge.cluster.load.Forward} answer it never gets).
"""
