"""
Whose a logical session is: the caller key whose run first used it
(docs/edge.md, "Isolation").

A session id is chosen by the caller (or printed by the tool), so another
key could guess it: run on it (a command-line tool resumes the
conversation it names, context and all) or end it. The Node is the one
that runs the session, and the one place every Edge of a cluster reaches
for it, so the Node decides: L{SessionOwners} maps C{(adapter,
session_id)} to the name of the caller key that owns it. A run on another
key's session is refused before its adapter sees it (C{session_owned}),
and another key's C{TERMINATE_SESSION} is answered as for a session that
does not exist. The id the tool sees is never changed: a tool that
resumes C{--resume <uuid>} needs it as it is.

An empty caller (a request from an Edge older than owners, or an admin
key's terminate) neither claims a session nor is refused one.

The owners outlive a restart: before the Node says it is ready (and so
before any run or terminate can reach it), the map is filled from the
run store, where every run that reached its adapter is a row with its
adapter, session id and caller (L{iop.node.store.RunStore.session_owners}).
So the map holds a session for as long as the store keeps one of its
runs (C{store.retention}), plus the sessions first used since the start;
a session whose every run was pruned is free again.
"""

from collections.abc import Iterable

from twisted.internet import defer
from twisted.internet.defer import Deferred
from twisted.logger import Logger
from twisted.python.failure import Failure

from iop.run import CAPACITY_EXCEEDED, INVALID_REQUEST, NODE_DRAINING, SESSION_OWNED, UNKNOWN_ADAPTER

#: The codes of a run the Node refused before its adapter saw it: such a
#: run never used its session, so its stored row claims nothing. (Left
#: out, a prune of the owner's older runs could give the session to a key
#: whose runs on it were refused.)
NEVER_RAN = (NODE_DRAINING, UNKNOWN_ADAPTER, CAPACITY_EXCEEDED, INVALID_REQUEST, SESSION_OWNED)

#: A session's first stored use: C{(adapter, session_id, caller)}.
Use = tuple[str, str, str]


class SessionOwners:
    """
    The owner of every session this Node knows, by C{(adapter,
    session_id)}.
    """

    log = Logger()

    def __init__(self) -> None:
        self._owners: dict[tuple[str, str], str] = {}
        #: Who waits for the L{load} while it is under way, else C{None}.
        self._waiting: list[Deferred[None]] | None = None

    def claim(self, adapter: str, session_id: str, caller: str) -> bool:
        """
        A run of C{caller} on C{session_id}: whether it may use it (a free
        session becomes C{caller}'s). An empty caller may, and claims
        nothing.
        """
        if not caller:
            return True
        return self._owners.setdefault((adapter, session_id), caller) == caller

    def owned_by(self, adapter: str, session_id: str, caller: str) -> bool:
        """
        Whether C{caller} may end C{session_id}: its own session, or any
        when C{caller} is empty (an admin key). Ending it does not free
        it: the tool's own store may still hold the conversation.
        """
        return not caller or self._owners.get((adapter, session_id)) == caller

    def load(self, uses: "Deferred[list[Use]]") -> None:
        """
        Fill the map from the store's first use of each session (it names
        the session's owner), once C{uses} fires.
        Should the store fail to answer, that is logged and the map holds
        only the sessions used from now on.
        """

        def fill(rows: Iterable[Use]) -> None:
            for adapter, session_id, caller in rows:
                self._owners.setdefault((adapter, session_id), caller)
            self.log.info("session owners: {count} session(s) from the run store", count=len(self._owners))

        def unreadable(failure: Failure) -> None:
            self.log.failure("session owners could not be read from the run store", failure)

        def done(_: None) -> None:
            waiting, self._waiting = self._waiting or [], None
            for waiter in waiting:
                waiter.callback(None)

        self._waiting = []
        uses.addCallbacks(fill, unreadable).addCallback(done)

    def loaded(self) -> Deferred[None]:
        """
        A Deferred firing once the L{load} is done (at once when none is
        under way): what the Node waits for before it takes work.
        """
        if self._waiting is None:
            return defer.succeed(None)
        waiter: Deferred[None] = Deferred()
        self._waiting.append(waiter)
        return waiter
