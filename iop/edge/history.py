"""
Run history: the runs and tunnels a caller may look at after the fact.

The Edge's run book (L{iop.edge.runs.RunBook}) holds recent work in
memory, its log whole while it is small; every Node keeps the runs it
served in its own store (L{iop.node.store}). L{RunHistory} answers from
the book when it can and asks the Nodes (C{run_get}, C{run_list}) for the
rest, so a run outlives the Edge's memory of it.

A run placed again (before its first byte, or to continue a cut answer)
has had several ids on the wire, perhaps on several Nodes (L{RunBook}
keeps its attempts): it is read back across them, in its caller's
numbering, and listed once, under its own id, as its last attempt has it.
"""

from collections.abc import Callable
from typing import Any

from twisted.internet import defer
from twisted.internet.defer import Deferred
from twisted.logger import Logger
from twisted.python.failure import Failure

from iop.edge.commands import NodeCommands
from iop.edge.config import EdgeConfig
from iop.edge.errors import ServiceError
from iop.edge.registry import NodeRegistry
from iop.edge.runs import (
    QUEUED,
    RUN,
    RUNNING,
    TUNNEL,
    Follower,
    ReadBack,
    RunBook,
    no_such_run,
    read_attempts,
    stored_json,
    visible,
)
from iop.edge.seam import Forward, ICluster
from iop.run import NODE_DISCONNECTED, UNKNOWN_COMMAND, UNKNOWN_RUN


def _truth(run: dict[str, Any]) -> int:
    """
    How much one Edge's view of a run is worth against another's: one
    that saw it end beats one that has it in flight, which beats one that
    ended it only because it lost its Node (which took the run elsewhere).
    """
    if (run.get("error") or {}).get("code") == NODE_DISCONNECTED:
        return 0
    return 1 if run.get("status") in (QUEUED, RUNNING) else 2


def merge_listings(listings: list[dict[str, Any]], limit: int) -> dict[str, Any]:
    """
    One C{GET /v1/runs} answer out of several Edges' (this Edge's first):
    every run once, newest first, at most C{limit}. A run two Edges know
    (the one that lost its Node, the one the Node moved to) is taken from
    the one whose view is worth most (L{_truth}), else from the first. A
    node is C{incomplete} only when no Edge could ask it.
    """
    runs: dict[str, dict[str, Any]] = {}
    incomplete: set[str] | None = None
    for listing in listings:
        for run in listing.get("runs", []):
            seen = runs.get(run["id"])
            if seen is None or _truth(run) > _truth(seen):
                runs[run["id"]] = run
        missing = set(listing.get("incomplete", ()))
        incomplete = missing if incomplete is None else incomplete & missing
    newest = sorted(runs.values(), key=lambda r: r.get("created_at") or 0, reverse=True)[:limit]
    merged: dict[str, Any] = {"runs": newest}
    if incomplete:
        merged["incomplete"] = sorted(incomplete)
    return merged


#: How many answers of one Node (each one frame, at most 16 MiB) one read
#: of a run's events takes at most; a run stored larger is read in part.
RUN_GET_PAGES = 4


class RunHistory:
    """
    @param config: returns the running L{EdgeConfig} (its nodes).
    @param runs: the run book.
    @param registry: which nodes are ready to be asked.
    @param commands: what asks them.
    @param cluster: which Edge holds a node this Edge lost.
    """

    log = Logger()

    def __init__(
        self,
        config: Callable[[], EdgeConfig],
        runs: RunBook,
        registry: NodeRegistry,
        commands: NodeCommands,
        cluster: ICluster,
    ) -> None:
        self._config = config
        self.runs = runs
        self.registry = registry
        self.commands = commands
        self.cluster = cluster

    def held_elsewhere(self, run_id: str) -> Forward | None:
        """
        Where a run this Edge has on record is read now, when that is
        another Edge: the one its Node is connected to, when this Edge
        lost that Node while the run went on (it waits for the Node, or
        ended here as C{node_disconnected}) — the Node kept the run and
        handed it to its new Edge.
        """
        record = self.runs.get(run_id)
        if record is None or record.kind == TUNNEL or not record.node:
            return None
        if record.done and (record.error or {}).get("code") != NODE_DISCONNECTED:
            return None
        return self.cluster.node_target(record.node)

    def node_moved(self, node_id: str) -> None:
        """
        Another Edge has C{node_id} now: the readers following its
        background runs here, which wait for the Node, are let go (their
        streams end without a terminal), to resume with C{Last-Event-ID}
        where the runs are now (L{held_elsewhere}).
        """
        for record in self.runs.records():
            if record.node == node_id and record.background and not record.done and record.followers:
                self.log.info(
                    "run {run_id}: node {node} is at another Edge now; letting its readers go there",
                    run_id=record.id,
                    node=node_id,
                )
                for follower in list(record.followers):
                    record.followers.remove(follower)
                    follower.close()

    def _moved(self, run_id: str, owner: str | None, may_forward: bool) -> Exception | None:
        """
        The failure that sends a read of C{run_id} to the Edge that holds
        it now (L{held_elsewhere}): a L{Forward}, or, for a read another
        Edge forwarded here, C{not_found} (the asker reads the holder's
        answer). C{None} when it is read here.
        """
        forward = self.held_elsewhere(run_id)
        record = self.runs.get(run_id)
        if forward is None or (record is not None and not visible(owner, record.caller)):
            return None
        return forward if may_forward else no_such_run(run_id)

    def get_run(self, run_id: str, owner: str | None = None, may_forward: bool = True) -> "Deferred[dict[str, Any]]":
        """
        One run or tunnel: from the run book while it is in memory (and
        its log whole), else from the store of the Node it ran on.

        @param owner: only work of this caller key's (C{None}: any).
        @param may_forward: whether a run another Edge holds now may be
            answered with a L{Forward} there (else: C{not_found} here).
        @return: a Deferred firing with its JSON object (C{GET
            /v1/runs/{id}}), or failing with a L{ServiceError}
            (C{not_found}, also for another key's run; C{unavailable} when
            its node is offline), or a L{Forward}.
        """
        moved = self._moved(run_id, owner, may_forward)
        if moved is not None:
            return defer.fail(moved)
        record = self.runs.get(run_id)
        if record is not None and not visible(owner, record.caller):
            return defer.fail(no_such_run(run_id))
        if record is not None and (record.complete_log or record.kind == TUNNEL):
            return defer.succeed(record.as_json())
        d = read_attempts(self.fetch_run, run_id, self.runs.attempts(run_id), 0)

        def fetched(back: ReadBack) -> Failure | dict[str, Any]:
            if back.missing and (record is not None or back.rows):
                self.log.warn(
                    "run {run_id}: its whole output could not be read from its nodes: {why}",
                    run_id=run_id,
                    why=back.why_missing(),
                )
            if record is not None:
                if back.partial:
                    return dict(record.as_json(), output_partial=True)
                # The Edge's view is the current one; the Nodes have the
                # whole text.
                return dict(record.as_json(), output=back.output)
            if back.last is None:
                # Without its last attempt there is no telling how the run
                # went: nothing rather than an earlier attempt's status.
                return back.failure()
            if not all(visible(owner, row.get("caller")) for _, row in back.rows):
                raise no_such_run(run_id)
            node_id, row = back.last
            stored = stored_json(node_id, row, run_id)
            started = [r["started_at"] for _, r in back.rows if r.get("started_at") is not None]
            if started:
                stored["created_at"] = min(started)
            if stored["kind"] == RUN:
                stored["output"] = back.output
                if back.partial:
                    stored["output_partial"] = True
            return stored

        return d.addCallback(fetched)

    def list_runs(
        self, node_id: str | None = None, status: str | None = None, limit: int = 50, owner: str | None = None
    ) -> "Deferred[dict[str, Any]]":
        """
        Recent runs and tunnels, newest first: those the Edge has in
        memory (queued ones included) and those in the stores of the ready
        nodes (only C{node_id}'s, when given), only C{owner}'s when given
        (a caller key's name), only of C{status} when given.

        A run is listed once, under the id its caller knows: as the Edge
        holds it (whatever a Node's row of it says), else as the row of
        its last attempt (L{RunBook.listed_as}; rows of earlier attempts
        are left out) — by node, where its last attempt ran. The status
        filter applies to the merged listing.

        @return: a Deferred firing with C{{"runs": [...]}}, plus
            C{"incomplete": [node ids]} naming nodes that could not be
            asked.
        """
        config = self._config()
        if node_id is not None and config.node(node_id) is None:
            return defer.fail(ServiceError("not_found", f"no node {node_id!r} is configured"))
        known: dict[str, dict[str, Any]] = {}
        for record in self.runs.records():
            if (node_id is None or record.node == node_id) and visible(owner, record.caller):
                known[record.id] = record.as_json(output=False)
        nodes = [node_id] if node_id is not None else [n.id for n in config.nodes]
        asked, incomplete = [], []
        for node in nodes:
            if self.registry.ready_link(node) is None:
                incomplete.append(node)
                continue
            args: dict[str, Any] = {"limit": limit}
            if status is not None:
                args["status"] = status
            if owner is not None:
                args["caller"] = owner
            asked.append((node, self.commands.command(node, "run_list", "", args)))

        #: run id -> (rank, listing) of the runs only the nodes have.
        stored: dict[str, tuple[int, dict[str, Any]]] = {}

        def merge(results: list[tuple[bool, Any]]) -> dict[str, Any]:
            for (node, _), (ok, answer) in zip(asked, results, strict=True):
                if not ok:
                    self.log.info("run_list on node {node} failed: {why}", node=node, why=answer.getErrorMessage())
                    incomplete.append(node)
                    continue
                for row in answer.get("runs", []):
                    # (An older node does not filter by caller.)
                    if visible(owner, row.get("caller")):
                        self._merge_row(known, stored, node, row)
            every = list(known.values()) + [run for _, run in stored.values()]
            if status is not None:
                every = [run for run in every if run["status"] == status]
            runs = sorted(every, key=lambda r: r.get("created_at") or 0, reverse=True)[:limit]
            listed: dict[str, Any] = {"runs": runs}
            if incomplete:
                listed["incomplete"] = sorted(incomplete)
            return listed

        return defer.DeferredList([d for _, d in asked], consumeErrors=True).addCallback(merge)

    def _merge_row(
        self,
        known: dict[str, dict[str, Any]],
        stored: dict[str, tuple[int, dict[str, Any]]],
        node_id: str,
        row: dict[str, Any],
    ) -> None:
        """
        Add a Node's row to a listing: under the id its run's caller knows,
        unless the Edge lists that run itself or the row is of an attempt
        before the last (L{RunBook.listed_as}); of two rows of one run, the
        later attempt's, with the earlier start.
        """
        listed = self.runs.listed_as(node_id, row["run_id"])
        if listed is None or listed[0] in known:
            return
        run_id, rank = listed
        run = stored_json(node_id, row, run_id)
        seen = stored.get(run_id)
        if seen is not None:
            starts = [s for s in (seen[1].get("created_at"), run.get("created_at")) if s is not None]
            if rank <= seen[0]:
                rank, run = seen
            if starts:
                run["created_at"] = min(starts)
        stored[run_id] = (rank, run)

    def follow(
        self,
        run_id: str,
        after: int,
        write: Callable[[int, dict[str, Any]], object],
        end: Callable[[], object],
        owner: str | None = None,
        may_forward: bool = True,
    ) -> "Deferred[Follower]":
        """
        Replay a run's events after C{after} and follow it to its terminal
        (see L{RunBook.follow}); only C{owner}'s run when given. A run
        another Edge holds now fails as in L{get_run}.
        """
        moved = self._moved(run_id, owner, may_forward)
        if moved is not None:
            return defer.fail(moved)
        return self.runs.follow(run_id, after, write, end, owner)

    def fetch_run(self, run_id: str, node_id: str | None, after: int) -> "Deferred[tuple[str, dict[str, Any]]]":
        """
        Ask C{node_id} (every ready node, when C{None}) for a run from its
        store (the run book's C{fetch}). @return: a Deferred of
        C{(node_id, answer)}.
        """
        if node_id is not None:
            return self._run_get(node_id, run_id, after)
        nodes = [link.node_id for link in self.registry.ready_links()]
        if not nodes:
            return defer.fail(ServiceError("not_found", f"no run {run_id} (no node is connected to ask)"))
        asks = [self._run_get(node, run_id, after) for node in nodes]

        def first(results: list[tuple[bool, Any]]) -> Any:
            for ok, found in results:
                if ok:
                    return found
            for _ok, failure in results:
                if not failure.check(ServiceError) or failure.value.kind != "not_found":
                    return failure
            raise ServiceError("not_found", f"no run {run_id}", code="run_not_found")

        return defer.DeferredList(asks, consumeErrors=True).addCallback(first)

    def _run_get(self, node_id: str, run_id: str, after: int) -> "Deferred[tuple[str, dict[str, Any]]]":
        """
        Ask C{node_id}'s store for a run: the row and its events after
        C{after}, asked again after the last event given while the Node
        says there are C{more_events} (an answer is one frame), at most
        L{RUN_GET_PAGES} times; the answer then still says
        C{more_events}.
        """
        pages: list[dict[str, Any]] = []

        def ask(after: int, output: bool) -> "Deferred[Any]":
            args = {"run_id": run_id, "after": after}
            if not output:
                # The output is read back only from the start, and only
                # once: the room goes to events.
                args["output"] = False
            return self.commands.command(node_id, "run_get", "", args)

        def page(answer: dict[str, Any]) -> "dict[str, Any] | Deferred[Any]":
            pages.append(answer)
            events = answer.get("events") or []
            with_output = "output" in (answer.get("run") or {})
            # (A first answer the output filled gave no events: asked
            # again without it. Nothing else can come back empty.)
            if answer.get("more_events") and (events or with_output) and len(pages) < RUN_GET_PAGES:
                return ask(events[-1]["seq"] if events else after, False).addCallback(page)
            first = dict(pages[0], events=[e for p in pages for e in p.get("events") or []])
            first.pop("more_events", None)
            if answer.get("more_events"):
                first["more_events"] = True
            return first

        def older_node(failure: Failure) -> Failure:
            code = failure.value.code if isinstance(failure.value, ServiceError) else None
            if code == UNKNOWN_COMMAND:
                raise ServiceError("not_found", f"node {node_id} keeps no run history (an older node)")
            if code == UNKNOWN_RUN:
                raise ServiceError("not_found", f"no run {run_id}", code="run_not_found")
            return failure

        return ask(after, after == 0).addCallback(page).addCallbacks(lambda answer: (node_id, answer), older_node)
