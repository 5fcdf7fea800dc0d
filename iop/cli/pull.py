"""
C{iop pull N MODEL}: Ollama's pull on one node, through the node command
C{ollama_pull} (admin key).

The request asks for C{text/event-stream}. An Edge that streams the pull
answers with one event per Ollama progress line (C{status}, and
C{completed}/C{total} in bytes while a layer downloads): those feed a
progress bar per layer. An Edge that does not stream answers with the
command's JSON result once the pull is over: it is shown as is.
"""

import http.client
import json
from collections.abc import Iterable

from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

from iop.cli import sse
from iop.cli.client import FAILED, NOT_FOUND, USAGE, CLIError, expect_object, parse_object
from iop.cli.context import Context


def ollama_adapter(ctx: Context, node_id: str) -> str:
    """
    The node's only C{ollama} adapter, from C{/v1/status}.
    """
    status = expect_object(ctx.client.get_json("/v1/status"), "the Edge's status")
    nodes = {n["id"]: n for n in status.get("nodes", [])}
    if node_id not in nodes:
        raise CLIError(f"no node {node_id!r} is configured", NOT_FOUND)
    names: list[str] = [a["name"] for a in nodes[node_id].get("adapters", []) if a.get("type") == "ollama"]
    if len(names) != 1:
        found = ", ".join(names) or "none"
        raise CLIError(f"node {node_id} has {len(names)} ollama adapters ({found}): name one with --adapter", USAGE)
    return names[0]


def pull(ctx: Context, node_id: str, model: str, adapter: str | None, path: str) -> int:
    adapter = adapter or ollama_adapter(ctx, node_id)
    body = {"command": "ollama_pull", "adapter": adapter, "args": {"model": model}, "stream": True}
    headers = {"accept": "text/event-stream, application/json"}
    # No answer deadline here: a pull takes as long as the download.
    response = ctx.client.request("POST", path, body=body, admin=True, headers=headers, stream=True, timeout=None)
    if response.content_type != "text/event-stream":
        answer = response.json()
        if ctx.args.json:
            ctx.print_json(answer)
        else:
            result = answer.get("result") if isinstance(answer, dict) else answer
            state = result.get("status", "done") if isinstance(result, dict) else "done"
            ctx.out.print(f"pulled {model} on {node_id} ({adapter}): {state}")
        return 0
    try:
        return show_progress(ctx, response.events(), node_id, model)
    except (OSError, http.client.HTTPException) as e:
        raise CLIError(f"the pull's progress stream was cut: {e}", FAILED) from None
    finally:
        response.close()


def show_progress(ctx: Context, events: Iterable[sse.Event], node_id: str, model: str) -> int:
    """
    One bar per layer (keyed by C{digest}) with bytes, speed and time
    left; status lines without sizes are printed above the bars.
    """
    last = None
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=ctx.err, disable=ctx.args.json) as progress:
        tasks = {}
        for event in events:
            if event.data == "[DONE]":
                break
            payload = parse_object(event.data, "a line of the pull's progress stream")
            if ctx.args.json:
                ctx.stdout.write(json.dumps(payload) + "\n")
                ctx.stdout.flush()
            if event.event == "error" or payload.get("error"):
                error = payload.get("error") or payload
                message = error.get("message", error) if isinstance(error, dict) else error
                raise CLIError(f"pull of {model} on {node_id} failed: {message}", FAILED)
            if payload.get("done"):
                result = payload.get("result")
                last = result.get("status", last) if isinstance(result, dict) else last
                break
            status = payload.get("status")
            if payload.get("total"):
                key = payload.get("digest") or status
                if key not in tasks:
                    label = (key or "layer").removeprefix("sha256:")[:12]
                    tasks[key] = progress.add_task(f"pulling {label}", total=payload["total"])
                progress.update(tasks[key], completed=payload.get("completed", 0))
            elif status and status != last:
                progress.console.print(status)
            last = status or last
    if not ctx.args.json:
        ctx.out.print(f"pulled {model} on {node_id}: {last or 'done'}")
    return 0
