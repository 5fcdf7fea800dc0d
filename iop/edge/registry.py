"""
Which connection owns which Node, and whether it is dispatch-ready.

The registry is the one owner of Node connections and their connection
generations. A generation numbers each accepted registration of a node; it
is internal to the Edge (never on the wire or in config) and is what lets
the Edge ignore anything a stale connection says or suffers.

Rules:
  - a token that matches no node is refused (fatal for the Node);
  - a node that already has a live owner connection refuses a second one
    (retryable: the Node tries again later);
  - only the current owner's first ready makes the node dispatch-ready; a
    repeated ready from it is acknowledged idempotently; a ready from any
    other connection is refused;
  - losing any connection but the current owner changes nothing.
"""

import hmac
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from google.protobuf.message import Message
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from iop.edge.config import NodeSpec, token_digest
from iop.protocols import messages


class RegistrationRefused(Exception):
    """
    A registration or ready that the registry will not accept.

    @ivar code: the wire C{RejectCode} (L{messages.UNKNOWN_TOKEN}, ...).
    """

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


class Wire(Protocol):
    """
    Where a link's messages go (L{iop.protocols.wire.WireProtocol}, or a
    test's fake).
    """

    def send(self, message: Message) -> None: ...

    def close(self, reason: str) -> None: ...


@dataclass(eq=False)
class NodeLink:
    """
    One accepted connection of a node.

    @ivar wire: what to send on (an object with C{send(message)}).
    @ivar wire_version: the wire version the Node declared.
    @ivar draining: the Node said it is shutting down.
    @ivar adapters: what the Node runs: C{[{name, type, max_concurrency}]}
        from its registration, updated when it applies a refresh.
    @ivar reconcile: the background runs the Node reported before its
        ready (C{ReconciledRun}s, wire version 4), until they are taken
        back at activation.
    @ivar refresh: the outcome of the last config refresh pushed on this
        connection (C{state}: pending, applied, refused or unacknowledged,
        and C{reason}), or C{None}.
    @ivar payload: the C{NodeConfigPayload} the Node runs (sent with its
        registration, or the last refresh it applied), which a reload
        compares with the configuration's.
    """

    node_id: str
    generation: int
    wire: Wire
    since: float
    ready: bool = False
    open: bool = True
    wire_version: int = 1
    draining: bool = False
    adapters: list[dict[str, Any]] = field(default_factory=list)
    refresh: dict[str, str] | None = None
    reconcile: list[Message] | None = None
    payload: Message | None = None

    log = Logger()

    def send_quietly(self, message: Message) -> None:
        """
        Send C{message} if the connection still takes it; a failure (the
        link is going away, and its loss is handled elsewhere) is only
        logged.
        """
        try:
            self.wire.send(message)
        except Exception as e:
            self.log.info(
                "{kind} to node {node} not sent: {error}", kind=message.DESCRIPTOR.name, node=self.node_id, error=e
            )


class NodeRegistry:
    log = Logger()

    def __init__(self, nodes: Iterable[NodeSpec], clock: IReactorTime) -> None:
        self.nodes = list(nodes)
        self.clock = clock
        self._owners: dict[str, NodeLink] = {}
        self._generations: dict[str, int] = {}
        self.last_seen: dict[str, float] = {}

    def find_node(self, token: str) -> NodeSpec | None:
        """
        The configured node whose token (or token digest) matches, compared
        in constant time against every node; the token is never logged.
        """
        digest = token_digest(token)
        found = None
        for node in self.nodes:
            if hmac.compare_digest(digest, node.token_digest):
                found = node
        return found

    def register(self, token: str, wire: Wire) -> NodeLink:
        """
        Claim pending ownership of the node the token names.

        @return: the new L{NodeLink} (not yet ready).
        @raise RegistrationRefused: for an unknown token or a node with a live owner.
        """
        node = self.find_node(token)
        if node is None:
            raise RegistrationRefused(messages.UNKNOWN_TOKEN, "unknown token")
        owner = self._owners.get(node.id)
        if owner is not None and owner.open:
            raise RegistrationRefused(messages.DUPLICATE_CONNECTION, f"node {node.id} already has a live connection")
        generation = self._generations.get(node.id, 0) + 1
        self._generations[node.id] = generation
        link = NodeLink(node_id=node.id, generation=generation, wire=wire, since=self.clock.seconds())
        self._owners[node.id] = link
        return link

    def fence(self, link: NodeLink, generation: int) -> None:
        """
        In an Edge cluster: C{link}'s generation becomes its etcd claim's
        revision (which grows across the whole cluster).
        """
        link.generation = generation
        self._generations[link.node_id] = max(generation, self._generations.get(link.node_id, 0))

    def abandon(self, link: NodeLink) -> None:
        """
        Forget a registration that was refused after all (its cluster
        claim failed): the node may register again at once.
        """
        link.open = False
        if self._owners.get(link.node_id) is link:
            del self._owners[link.node_id]

    def mark_ready(self, link: NodeLink | None, node_id: str) -> bool:
        """
        Make C{link} dispatch-ready.

        @return: C{True} on the current owner's first ready, C{False} for a
            repeated one (acknowledged, no effect).
        @raise RegistrationRefused: if C{link} is stale, closed, or names another node.
        """
        if link is None or node_id != link.node_id:
            raise RegistrationRefused(
                messages.REJECT_NONE, f"ready for {node_id!r} does not match this connection's registration"
            )
        if not link.open or self._owners.get(link.node_id) is not link:
            raise RegistrationRefused(
                messages.REJECT_NONE, f"connection generation {link.generation} of node {link.node_id} is stale"
            )
        if link.ready:
            return False
        link.ready = True
        return True

    def lost(self, link: NodeLink) -> bool:
        """
        C{link}'s connection is gone.

        @return: C{True} if it was the current dispatch-ready owner (only
            then must the Edge take the node out of service).
        """
        link.open = False
        self.last_seen[link.node_id] = self.clock.seconds()
        if self._owners.get(link.node_id) is not link:
            return False
        del self._owners[link.node_id]
        return link.ready

    def ready_link(self, node_id: str) -> NodeLink | None:
        link = self._owners.get(node_id)
        if link is not None and link.ready and link.open:
            return link
        return None

    def ready_links(self) -> list[NodeLink]:
        return [link for link in self._owners.values() if link.ready and link.open]

    def links(self) -> list[NodeLink]:
        """
        Every current owner connection, pending or ready.
        """
        return [link for link in self._owners.values() if link.open]

    def owner(self, node_id: str) -> NodeLink | None:
        """
        The current owner connection, pending or ready, if any.
        """
        return self._owners.get(node_id)
