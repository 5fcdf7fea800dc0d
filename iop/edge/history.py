"""
Run history: the runs and tunnels a caller may look at after the fact.

The Edge's run book (L{iop.edge.runs.RunBook}) holds recent work in
memory, its log whole while it is small; every Node keeps the runs it
served in its own store (L{iop.node.store}). L{RunHistory} answers from
the book when it can and asks the Nodes (C{run_get}, C{run_list}) for the
rest, so a run outlives the Edge's memory of it.
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
from iop.edge.runs import TUNNEL, Follower, RunBook, no_such_run, stored_json, visible
from iop.run import UNKNOWN_COMMAND, UNKNOWN_RUN


class RunHistory:
    """
    @param config: returns the running L{EdgeConfig} (its nodes).
    @param runs: the run book.
    @param registry: which nodes are ready to be asked.
    @param commands: what asks them.
    """

    log = Logger()

    def __init__(
        self, config: Callable[[], EdgeConfig], runs: RunBook, registry: NodeRegistry, commands: NodeCommands
    ) -> None:
        self._config = config
        self.runs = runs
        self.registry = registry
        self.commands = commands

    def get_run(self, run_id: str, owner: str | None = None) -> "Deferred[dict[str, Any]]":
        """
        One run or tunnel: from the run book while it is in memory (and
        its log whole), else from the store of the Node it ran on.

        @param owner: only work of this caller key's (C{None}: any).
        @return: a Deferred firing with its JSON object (C{GET
            /v1/runs/{id}}), or failing with a L{ServiceError}
            (C{not_found}, also for another key's run; C{unavailable} when
            its node is offline).
        """
        record = self.runs.get(run_id)
        if record is not None and not visible(owner, record.caller):
            return defer.fail(no_such_run(run_id))
        if record is not None and (record.complete_log or record.kind == TUNNEL):
            return defer.succeed(record.as_json())
        node_id, wire_id = self.runs.locate(run_id)
        d = self.fetch_run(wire_id, node_id, 0)

        def fetched(found: tuple[str, dict[str, Any]]) -> dict[str, Any]:
            node_id, answer = found
            stored = stored_json(node_id, answer["run"], run_id)
            if record is None:
                if not visible(owner, stored["key"]):
                    raise no_such_run(run_id)
                return stored
            # The Edge's view is the current one; the Node has the whole text.
            return dict(record.as_json(), output=stored.get("output", ""))

        def failed(failure: Failure) -> Failure | dict[str, Any]:
            if record is None:
                return failure
            self.log.warn(
                "run {run_id}: its whole output could not be read from node {node}: {why}",
                run_id=run_id,
                node=record.node,
                why=failure.getErrorMessage(),
            )
            return dict(record.as_json(), output_partial=True)

        return d.addCallbacks(fetched, failed)

    def list_runs(
        self, node_id: str | None = None, status: str | None = None, limit: int = 50, owner: str | None = None
    ) -> "Deferred[dict[str, Any]]":
        """
        Recent runs and tunnels, newest first: those the Edge has in
        memory (queued ones included) and those in the stores of the ready
        nodes (only C{node_id}'s, when given), only C{owner}'s when given
        (a caller key's name).

        @return: a Deferred firing with C{{"runs": [...]}}, plus
            C{"incomplete": [node ids]} naming nodes that could not be
            asked.
        """
        config = self._config()
        if node_id is not None and config.node(node_id) is None:
            return defer.fail(ServiceError("not_found", f"no node {node_id!r} is configured"))
        known = {}
        for record in self.runs.records():
            if (
                (node_id is None or record.node == node_id)
                and (status is None or record.status == status)
                and visible(owner, record.caller)
            ):
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

        def merge(results: list[tuple[bool, Any]]) -> dict[str, Any]:
            for (node, _), (ok, answer) in zip(asked, results, strict=True):
                if not ok:
                    self.log.info("run_list on node {node} failed: {why}", node=node, why=answer.getErrorMessage())
                    incomplete.append(node)
                    continue
                for row in answer.get("runs", []):
                    # (An older node does not filter by caller.)
                    if visible(owner, row.get("caller")):
                        known.setdefault(row["run_id"], stored_json(node, row))
            runs = sorted(known.values(), key=lambda r: r.get("created_at") or 0, reverse=True)[:limit]
            listed: dict[str, Any] = {"runs": runs}
            if incomplete:
                listed["incomplete"] = sorted(incomplete)
            return listed

        return defer.DeferredList([d for _, d in asked], consumeErrors=True).addCallback(merge)

    def follow(
        self,
        run_id: str,
        after: int,
        write: Callable[[int, dict[str, Any]], object],
        end: Callable[[], object],
        owner: str | None = None,
    ) -> "Deferred[Follower]":
        """
        Replay a run's events after C{after} and follow it to its terminal
        (see L{RunBook.follow}); only C{owner}'s run when given.
        """
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
        d = self.commands.command(node_id, "run_get", "", {"run_id": run_id, "after": after})

        def older_node(failure: Failure) -> Failure:
            code = failure.value.code if isinstance(failure.value, ServiceError) else None
            if code == UNKNOWN_COMMAND:
                raise ServiceError("not_found", f"node {node_id} keeps no run history (an older node)")
            if code == UNKNOWN_RUN:
                raise ServiceError("not_found", f"no run {run_id}", code="run_not_found")
            return failure

        return d.addCallbacks(lambda answer: (node_id, answer), older_node)
