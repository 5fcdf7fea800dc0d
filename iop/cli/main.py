"""
C{iop}: the operator's command line for an Edge.

  iop status [--watch]              nodes, providers, queues as tables
  iop nodes                         the nodes table
  iop runs [--node N] [--status S]  recent runs (GET /v1/runs)
  iop run ID [--follow]             one run; --follow streams the rest of it
  iop chat MODEL "prompt"           a streamed chat completion, printed as it comes
  iop node N command NAME           a node command (admin key)
  iop pull N MODEL                  Ollama pull on node N, with a progress bar
  iop events                        tail the Edge's events feed (admin key)
  iop token-hash [TOKEN]            the SHA-256 form of a token or key, for edge.yaml

Global options (before or after the command): C{--edge URL}, C{--key},
C{--admin-key}, C{--json}, C{--timeout}; the first three default to
C{IOP_EDGE}, C{IOP_API_KEY} and C{IOP_ADMIN_KEY}. Each failure is one line
on stderr and an exit status from L{iop.cli.client.EXIT_CODES}.
"""

import argparse
import getpass
import hashlib
import json
import math
import os
import sys
import time
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TextIO

from rich.console import Group
from rich.live import Live
from rich.text import Text

from iop.cli import render
from iop.cli.client import (
    DEFAULT_EDGE,
    EXIT_CODES,
    FAILED,
    OK,
    UNREACHABLE,
    USAGE,
    CLIError,
    EdgeClient,
    excerpt,
    expect_object,
)
from iop.cli.context import Context
from iop.cli.pull import pull
from iop.cli.streams import chat, follow_run, tail_events

#: C{iop} stopped by Ctrl-C.
INTERRUPTED = 130


# -- reading the status


def fetch_status(ctx: Context) -> tuple[dict[str, Any], float]:
    response = ctx.client.request("GET", "/v1/status")
    now = response.edge_time() or time.time()
    return expect_object(response.json(), "the Edge's status"), now


def cmd_status(ctx: Context) -> int:
    if ctx.args.watch:
        return watch(ctx)
    status, now = fetch_status(ctx)
    if ctx.args.json:
        ctx.print_json(status)
    else:
        ctx.out.print(render.status_view(status, now))
    return OK


def watch(ctx: Context) -> int:
    """
    Redraw the status every C{--interval} seconds until Ctrl-C. An Edge
    that stops answering is shown and retried; a refused key ends it.
    With C{--json}, one snapshot per line instead. Not on a terminal (a
    pipe, a log file), each view is printed after the last: a redraw in
    place would only show at the end.
    """
    interval = ctx.args.interval
    try:
        if ctx.args.json:
            while True:
                status, _ = fetch_status(ctx)
                ctx.stdout.write(json.dumps(status) + "\n")
                ctx.stdout.flush()
                time.sleep(interval)
        if not ctx.out.is_terminal:
            while True:
                ctx.out.print(watch_view(ctx, interval))
                ctx.stdout.flush()
                time.sleep(interval)
        with Live(console=ctx.out, auto_refresh=False, transient=False) as live:
            while True:
                live.update(watch_view(ctx, interval), refresh=True)
                time.sleep(interval)
    except KeyboardInterrupt:
        return OK


def watch_view(ctx: Context, interval: float) -> Group:
    """
    One view of C{--watch}: a header with the time, then the status, or
    why the Edge did not answer (it is asked again).
    """
    stamp = time.strftime("%H:%M:%S")
    header = Text(f"{ctx.client.base_url}  {stamp}  (every {interval:g}s, Ctrl-C to stop)", style="dim")
    try:
        status, now = fetch_status(ctx)
    except CLIError as e:
        if e.exit_code != UNREACHABLE:
            raise
        return Group(header, Text(f"{e.message} (retrying)", style="red"))
    return Group(header, render.status_view(status, now))


def cmd_nodes(ctx: Context) -> int:
    status, now = fetch_status(ctx)
    if ctx.args.json:
        ctx.print_json(status.get("nodes", []))
    else:
        ctx.out.print(render.nodes_table(status.get("nodes", []), now))
    return OK


# -- run history


def run_list(data: Any) -> list[dict[str, Any]]:
    """
    The runs of a C{GET /v1/runs} answer: a list, or an object holding one
    under C{runs} or C{data}.

    @raise CLIError: anything else, or runs that are not objects (a bad
        answer, L{FAILED}).
    """
    runs = data
    if isinstance(data, dict):
        runs = next((data[key] for key in ("runs", "data") if isinstance(data.get(key), list)), [])
    if not isinstance(runs, list) or not all(isinstance(run, dict) for run in runs):
        raise CLIError(f"the Edge's run history is not a list of runs: {excerpt(json.dumps(data))}", FAILED)
    return runs


def cmd_runs(ctx: Context) -> int:
    args = ctx.args
    data = ctx.client.get_json("/v1/runs", params={"node": args.node, "status": args.status, "limit": args.limit})
    runs = run_list(data)
    if ctx.args.json:
        ctx.print_json(data)
    else:
        ctx.out.print(render.runs_table(runs))
    missing = data.get("incomplete") if isinstance(data, dict) else None
    if missing:
        # (The Edge could not ask these nodes: their stored runs are not in the list.)
        ctx.err.print(
            f"not listed: the runs stored on {', '.join(map(str, missing))} (not reachable now)", style="yellow"
        )
    return OK


def run_path(run_id: str) -> str:
    """
    @raise CLIError: for an empty id (L{USAGE}): it would name the list.
    """
    if not run_id.strip():
        raise CLIError("a run id is required (see iop runs)", USAGE)
    return "/v1/runs/" + urllib.parse.quote(run_id, safe="")


def cmd_run(ctx: Context) -> int:
    if ctx.args.follow:
        return follow_run(ctx, run_path(ctx.args.run_id))
    run = expect_object(ctx.client.get_json(run_path(ctx.args.run_id)), "the run")
    if ctx.args.json:
        ctx.print_json(run)
        return OK
    ctx.out.print(render.run_table(run))
    if run.get("output"):
        ctx.stdout.write(run["output"] + "\n")
    if run.get("output_partial"):
        ctx.err.print("the output above is partial: part of it could not be read from its nodes", style="yellow")
    return OK


# -- work


def cmd_chat(ctx: Context) -> int:
    prompt = ctx.args.prompt
    if prompt == "-":
        prompt = sys.stdin.read()
    messages = []
    if ctx.args.system:
        messages.append({"role": "system", "content": ctx.args.system})
    messages.append({"role": "user", "content": prompt})
    return chat(ctx, ctx.args.model, messages)


def parse_args_json(text: str | None) -> dict[str, Any]:
    try:
        value = json.loads(text) if text else {}
    except ValueError as e:
        raise CLIError(f"--args is not valid JSON: {e}", USAGE) from None
    if not isinstance(value, dict):
        raise CLIError('--args must be a JSON object, e.g. \'{"model": "llama3.2"}\'', USAGE)
    return value


def node_path(node: str) -> str:
    return f"/v1/nodes/{urllib.parse.quote(node, safe='')}/commands"


def cmd_node(ctx: Context) -> int:
    args = ctx.args
    body = {"command": args.name, "args": parse_args_json(args.args)}
    if args.adapter:
        body["adapter"] = args.adapter
    answer = ctx.client.post_json(node_path(args.node), body, admin=True)
    if args.json:
        ctx.print_json(answer)
    else:
        ctx.out.print_json(data=answer.get("result") if isinstance(answer, dict) else answer)
    return OK


def cmd_pull(ctx: Context) -> int:
    return pull(ctx, ctx.args.node, ctx.args.model, ctx.args.adapter, node_path(ctx.args.node))


def cmd_events(ctx: Context) -> int:
    return tail_events(ctx, {"type": ctx.args.type, "node": ctx.args.node})


def cmd_token_hash(ctx: Context) -> int:
    token = ctx.args.token
    if token is None:
        token = getpass.getpass("token or key: ") if sys.stdin.isatty() else sys.stdin.read().rstrip("\r\n")
    if not token:
        raise CLIError("no token given", USAGE)
    digest = hashlib.sha256(token.encode("utf-8")).hexdigest()
    if ctx.args.json:
        ctx.print_json({"sha256": digest})
    else:
        ctx.stdout.write(digest + "\n")
    return OK


# -- arguments


def seconds(text: str) -> float:
    """
    An argparse type for C{--timeout} and C{--interval}: a positive, finite
    number of seconds. Zero, negative, C{nan} or C{inf} would reach the
    socket or C{time.sleep} as a ValueError/OverflowError traceback (or,
    for C{--interval 0}, ask the Edge in a busy loop).
    """
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return value


def add_globals(parser: argparse.ArgumentParser, environ: Mapping[str, str], suppress: bool) -> None:
    """
    The global options, on the main parser (with their defaults) and on
    every subcommand (defaults suppressed, so either position works).
    """

    def default(value: object) -> object:
        return argparse.SUPPRESS if suppress else value

    group = parser.add_argument_group("Edge and keys")
    group.add_argument(
        "--edge",
        metavar="URL",
        default=default(environ.get("IOP_EDGE") or DEFAULT_EDGE),
        help=f"the Edge's HTTP address (IOP_EDGE; default {DEFAULT_EDGE})",
    )
    group.add_argument(
        "--key", metavar="KEY", default=default(environ.get("IOP_API_KEY")), help="caller key (IOP_API_KEY)"
    )
    group.add_argument(
        "--admin-key",
        metavar="KEY",
        default=default(environ.get("IOP_ADMIN_KEY")),
        help="admin key for node commands, pull and events (IOP_ADMIN_KEY)",
    )
    group.add_argument("--json", action="store_true", default=default(False), help="print JSON for scripts")
    group.add_argument(
        "--timeout", type=seconds, metavar="SEC", default=default(30.0), help="connect and answer timeout (30)"
    )


#: A command: its exit status from the L{Context}.
Handler = Callable[[Context], int]


def command(
    name: str,
    handler: Handler,
    help: str,
    environ: Mapping[str, str],
    subparsers: "argparse._SubParsersAction[argparse.ArgumentParser]",
) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(name, help=help, description=help)
    add_globals(parser, environ, suppress=True)
    parser.set_defaults(handler=handler)
    return parser


def build_parser(environ: Mapping[str, str]) -> argparse.ArgumentParser:
    epilog = "exit status: " + "; ".join(f"{code} {meaning}" for code, meaning in sorted(EXIT_CODES.items()))
    parser = argparse.ArgumentParser(
        prog="iop", description="Operate an iop Edge and its Nodes.", epilog=epilog + f"; {INTERRUPTED} interrupted"
    )
    add_globals(parser, environ, suppress=False)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = command("status", cmd_status, "nodes, providers and queues at a glance", environ, sub)
    p.add_argument("--watch", "-w", action="store_true", help="redraw until Ctrl-C")
    p.add_argument("--interval", type=seconds, default=2.0, metavar="SEC", help="--watch refresh period (2)")

    command("nodes", cmd_nodes, "every configured node and its connection", environ, sub)

    p = command("runs", cmd_runs, "recent runs", environ, sub)
    p.add_argument("--node", help="only this node's runs")
    p.add_argument("--status", help="only runs with this status (queued, running, complete, error, cancelled)")
    p.add_argument("--limit", type=int, help="at most this many")

    p = command("run", cmd_run, "one run; --follow streams it to its end", environ, sub)
    p.add_argument("run_id", metavar="ID")
    p.add_argument("--follow", "-f", action="store_true", help="stream the run's events, resuming if cut")

    p = command("chat", cmd_chat, "stream a chat completion", environ, sub)
    p.add_argument("model", metavar="MODEL", help="a model group or adapter name")
    p.add_argument("prompt", metavar="PROMPT", help='the user message ("-" reads stdin)')
    p.add_argument("--system", help="a system message")
    p.add_argument("--usage", action="store_true", help="print token usage on stderr at the end")

    p = command("node", cmd_node, "run a node command (admin key)", environ, sub)
    p.add_argument("node", metavar="N", help="node id")
    p.add_argument("verb", choices=["command"], help="command")
    p.add_argument("name", metavar="NAME", help="capabilities, transport_status, usage_status, ollama_list, ...")
    p.add_argument("--adapter", help="the adapter the command is for")
    p.add_argument("--args", metavar="JSON", help="the command's arguments, a JSON object")

    p = command("pull", cmd_pull, "pull an Ollama model on a node, with progress (admin key)", environ, sub)
    p.add_argument("node", metavar="N", help="node id")
    p.add_argument("model", metavar="MODEL", help="e.g. llama3.2:3b")
    p.add_argument("--adapter", help="the node's ollama adapter (default: its only one)")

    p = command("events", cmd_events, "tail the Edge's events feed (admin key)", environ, sub)
    p.add_argument("--type", help="only events of this type")
    p.add_argument("--node", help="only this node's events")

    p = command("token-hash", cmd_token_hash, "print a token's SHA-256 for edge.yaml (token_sha256)", environ, sub)
    p.add_argument("token", nargs="?", metavar="TOKEN", help="the token (default: read from stdin, not echoed)")
    return parser


def main(
    argv: Sequence[str] | None = None,
    environ: Mapping[str, str] | None = None,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
) -> int:
    """
    Run one command. @return: the exit status (the console script passes
    it to C{sys.exit}).
    """
    environ = os.environ if environ is None else environ
    stdout = sys.stdout if stdout is None else stdout
    stderr = sys.stderr if stderr is None else stderr
    args = build_parser(environ).parse_args(argv)
    try:
        client = EdgeClient(args.edge, args.key, args.admin_key, timeout=args.timeout)
        handler: Handler = args.handler
        return handler(Context(args, client, stdout, stderr))
    except CLIError as e:
        stderr.write(f"iop {args.command}: {e.message}\n")
        return e.exit_code
    except KeyboardInterrupt:
        stderr.write("\n")
        return INTERRUPTED
    except BrokenPipeError:
        # `iop runs | head`: the reader left; nothing more to say.
        return OK
