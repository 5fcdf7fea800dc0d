"""
How the command line shows the Edge's JSON to a person: C{rich} tables
built from C{/v1/status} and the run history. Pure functions of the JSON
(and of "now" on the Edge's clock), so they are tested without an Edge.
"""

import time
from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

STATE_STYLES = {"ready": "green", "draining": "yellow", "offline": "red"}
RUN_STYLES = {"complete": "green", "running": "cyan", "queued": "blue", "error": "red", "cancelled": "yellow"}


def age(seconds: float) -> str:
    """
    A duration as an operator reads it: C{42s}, C{4m 12s}, C{2h 05m}, C{3d 4h}.
    """
    seconds = max(0, int(seconds))
    if seconds < 60:
        return f"{seconds}s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m {seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours}h {minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d {hours}h"


def node_state(node: dict[str, Any]) -> str:
    if not node.get("connected"):
        return "offline"
    return "draining" if node.get("draining") else "ready"


def node_since(node: dict[str, Any], now: float) -> str:
    """
    How long the node has been connected, or since it was last seen.
    """
    if node.get("connected") and node.get("connected_since") is not None:
        return f"up {age(now - node['connected_since'])}"
    if node.get("last_seen") is not None:
        return f"last seen {age(now - node['last_seen'])} ago"
    return "never connected"


def nodes_table(nodes: list[dict[str, Any]], now: float) -> Table:
    table = Table(title="Nodes", title_justify="left", expand=False)
    for column in ("node", "state", "since", "in flight", "adapters"):
        table.add_column(column, justify="right" if column == "in flight" else "left")
    for node in nodes:
        state = node_state(node)
        adapters = ", ".join(f"{a['name']} ({a['type']})" for a in node.get("adapters", []))
        table.add_row(
            node["id"],
            Text(state, style=STATE_STYLES[state]),
            node_since(node, now),
            str(node.get("in_flight", 0)),
            adapters,
        )
    return table


def usage_cell(in_use: int, capacity: int) -> Text:
    """
    C{in_use/capacity}, yellow when full, dim when there is no capacity.
    """
    style = "dim" if not capacity else ("yellow" if in_use >= capacity else "")
    return Text(f"{in_use}/{capacity}", style=style)


def providers_table(nodes: list[dict[str, Any]]) -> Table:
    table = Table(title="Providers", title_justify="left")
    for column in ("node", "provider", "adapter", "status", "health", "normal", "long"):
        table.add_column(column, justify="right" if column in ("normal", "long") else "left")
    for node in nodes:
        for provider in node.get("providers", []):
            health = provider.get("health", "")
            table.add_row(
                node["id"],
                provider["id"],
                provider.get("adapter", ""),
                provider.get("status", ""),
                Text(health, style="green" if health == "ok" else "red"),
                usage_cell(provider["in_use"]["normal"], provider["capacity"]["normal"]),
                usage_cell(provider["in_use"]["long"], provider["capacity"]["long"]),
            )
    return table


def groups_table(groups: list[dict[str, Any]]) -> Table:
    table = Table(title="Model groups", title_justify="left")
    table.add_column("model group")
    table.add_column("queued", justify="right")
    for group in groups:
        queued = group.get("queued", 0)
        table.add_row(group["name"], Text(str(queued), style="yellow" if queued else ""))
    return table


def status_view(status: dict[str, Any], now: float) -> Group:
    """
    The whole snapshot as three tables: nodes, providers, model groups.
    """
    nodes = status.get("nodes", [])
    parts = [nodes_table(nodes, now), providers_table(nodes)]
    if status.get("model_groups"):
        parts.append(groups_table(status["model_groups"]))
    return Group(*parts)


def timestamp(value: Any) -> str:
    """
    A run's time as local C{HH:MM:SS} (epoch seconds) or as the Edge wrote it.
    """
    if isinstance(value, int | float):
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(value))
    return str(value) if value else ""


def tokens(usage: dict[str, Any] | None) -> str:
    if not usage:
        return ""
    return f"{usage.get('input_tokens', 0)} in / {usage.get('output_tokens', 0)} out"


def runs_table(runs: list[dict[str, Any]]) -> Table:
    """
    The run list. A run's id and status are never cut or wrapped (the id
    is what C{iop run ID} takes): on a narrow terminal the other columns
    give way.
    """
    table = Table(title="Runs", title_justify="left")
    widest = max((len(str(run.get("id", ""))) for run in runs), default=0)
    table.add_column("run", no_wrap=True, min_width=widest)
    table.add_column("status", no_wrap=True, min_width=len("cancelled"))
    for column in ("node", "adapter", "target", "created", "ended", "tokens"):
        table.add_column(column)
    for run in runs:
        status = run.get("status", "")
        table.add_row(
            run.get("id", ""),
            Text(status, style=RUN_STYLES.get(status, "")),
            run.get("node") or "",
            run.get("adapter") or "",
            run.get("target") or "",
            timestamp(run.get("created_at")),
            timestamp(run.get("ended_at")),
            tokens(run.get("usage")),
        )
    return table


def run_table(run: dict[str, Any]) -> Table:
    """
    One run as field/value rows (its output is printed after it).
    """
    table = Table(show_header=False, title=f"Run {run.get('id', '')}", title_justify="left")
    table.add_column("field", style="bold")
    table.add_column("value")
    for field in ("status", "node", "adapter", "target", "created_at", "ended_at"):
        value = run.get(field)
        if value not in (None, ""):
            table.add_row(field, timestamp(value) if field.endswith("_at") else str(value))
    if run.get("usage"):
        table.add_row("tokens", tokens(run["usage"]))
    error = run.get("error")
    if error:
        text = f"{error.get('code', '')}: {error.get('message', '')}" if isinstance(error, dict) else str(error)
        table.add_row("error", Text(text, style="red"))
    return table
