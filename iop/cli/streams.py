"""
The command line's streaming commands: a chat completion printed as it
arrives, a run followed (and resumed with C{Last-Event-ID} when the
connection is cut), and the events feed tailed.

Answers go to stdout as plain text (so they pipe); reasoning, usage and
errors go to stderr. A chunk or run event that is not a JSON object ends
the command with one L{FAILED} line rather than being skipped: a skipped
one could silently drop part of the answer. (The events feed, which only
shows what it reads, prints such a line as it is.)
"""

import http.client
import json
import time
from typing import Any, TextIO

from iop.cli.client import FAILED, UNREACHABLE, CLIError, parse_object
from iop.cli.context import Context

TERMINALS = ("complete", "error", "cancelled")
SSE_ACCEPT = {"accept": "text/event-stream"}

#: How often C{iop run --follow} reconnects after a cut before giving up.
RESUME_ATTEMPTS = 5
RESUME_DELAY_SEC = 1.0


def write(stream: TextIO, text: str) -> None:
    stream.write(text)
    stream.flush()


class Reasoning:
    """
    Reasoning text, dim on stderr as it comes, ended with its own line
    break before the answer (or the end) so that the two never run into
    one line on a terminal.
    """

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.open = False

    def write(self, text: str | None) -> None:
        if text:
            self.ctx.err.print(text, style="dim", end="")
            self.open = True

    def end(self) -> None:
        if self.open:
            self.ctx.err.print("")
            self.open = False


def chat(ctx: Context, model: str, messages: list[dict[str, Any]]) -> int:
    """
    C{POST /v1/chat/completions} with C{stream: true}: the content of each
    chunk is printed at once. With C{--json}, one document at the end:
    C{model}, C{text}, C{finish_reason}, C{usage}.
    """
    body = {"model": model, "messages": messages, "stream": True, "stream_options": {"include_usage": True}}
    response = ctx.client.request(
        "POST", "/v1/chat/completions", body=body, headers=SSE_ACCEPT, stream=True, timeout=None
    )
    parts, usage, finish = [], None, None
    thinking = Reasoning(ctx)
    try:
        for event in response.events():
            if event.data == "[DONE]":
                break
            chunk = parse_object(event.data, "a chunk of the completion stream")
            if "error" in chunk:
                raise CLIError(f"the completion failed: {error_text(chunk['error'])}", FAILED)
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                if not ctx.args.json:
                    thinking.write(delta.get("reasoning_content") or delta.get("reasoning"))
                content = delta.get("content")
                if content:
                    parts.append(content)
                    if not ctx.args.json:
                        thinking.end()
                        write(ctx.stdout, content)
                finish = choice.get("finish_reason") or finish
    except (OSError, http.client.HTTPException) as e:
        raise CLIError(f"the stream was cut: {e}", FAILED) from None
    finally:
        response.close()
    if ctx.args.json:
        ctx.print_json({"model": model, "text": "".join(parts), "finish_reason": finish, "usage": usage})
        return 0
    thinking.end()
    write(ctx.stdout, "\n")
    if ctx.args.usage and usage:
        ctx.err.print(
            f"usage: {usage.get('prompt_tokens', 0)} prompt + {usage.get('completion_tokens', 0)} completion tokens",
            style="dim",
        )
    return 0


def follow_run(ctx: Context, path: str) -> int:
    """
    C{GET <run>/events}: the run's events from the start, then live until
    its terminal. A cut connection is resumed from the last C{id:} seen
    (C{Last-Event-ID}), so nothing is printed twice or missed.

    @return: 0 when the run completes, L{FAILED} when it ends in error or
        is cancelled.
    """
    last_id, attempts = None, 0
    thinking = Reasoning(ctx)
    while True:
        headers = dict(SSE_ACCEPT)
        if last_id is not None:
            headers["last-event-id"] = last_id
        try:
            response = ctx.client.request("GET", path + "/events", headers=headers, stream=True)
        except CLIError as e:
            if e.exit_code != UNREACHABLE or last_id is None or attempts >= RESUME_ATTEMPTS:
                raise
        else:
            try:
                for event in response.events():
                    if event.id is not None:
                        last_id = event.id
                    payload = parse_object(event.data, "an event of the run's stream")
                    attempts = 0
                    terminal = show_run_event(ctx, payload, thinking)
                    if terminal is not None:
                        return terminal
            except (OSError, http.client.HTTPException):
                pass
            finally:
                response.close()
        attempts += 1
        if attempts > RESUME_ATTEMPTS:
            raise CLIError("the run's event stream keeps ending before its terminal event", FAILED)
        time.sleep(RESUME_DELAY_SEC)


def show_run_event(ctx: Context, payload: dict[str, Any], thinking: Reasoning) -> int | None:
    """
    Print one native run event (reasoning through C{thinking}, a
    L{Reasoning}). @return: the exit status on a terminal, else C{None}.
    """
    kind = payload.get("type")
    if ctx.args.json:
        write(ctx.stdout, json.dumps(payload) + "\n")
    elif kind == "delta":
        thinking.end()
        write(ctx.stdout, payload.get("text", ""))
    elif kind == "reasoning_delta":
        thinking.write(payload.get("text", ""))
    if kind not in TERMINALS:
        return None
    if not ctx.args.json:
        thinking.end()
        write(ctx.stdout, "\n")
    if kind == "complete":
        return 0
    error = payload.get("error")
    if isinstance(error, dict) and error:
        reason = f"{error.get('code', '')}: {error.get('message', '')}"
    else:
        reason = error_text(error)
    ctx.err.print(f"run {payload.get('run_id', '')} ended {kind}: {reason}", style="red")
    return FAILED


def error_text(error: Any) -> str:
    """
    An C{error} field as words: the C{message} of an object, or the field
    itself when a provider sends a bare string.
    """
    if isinstance(error, dict):
        error = error.get("message") or error
    return str(error) if error else "no reason given"


def describe(payload: dict[str, Any]) -> str:
    """
    One event of the feed as C{key=value} words, the identifying ones first.
    """
    first = ("type", "event", "node", "run_id", "tunnel_id", "reason")
    keys = [k for k in first if k in payload] + [k for k in payload if k not in first]
    words = []
    for key in keys:
        value = payload[key]
        if isinstance(value, dict | list):
            value = json.dumps(value, separators=(",", ":"))
        words.append(f"{key}={value}")
    return " ".join(words)


def tail_events(ctx: Context, params: dict[str, str | None]) -> int:
    """
    C{GET /v1/events} (admin key): one line per event until Ctrl-C or the
    Edge ends the stream; raw JSON lines with C{--json}.
    """
    response = ctx.client.request("GET", "/v1/events", params=params, headers=SSE_ACCEPT, admin=True, stream=True)
    try:
        for event in response.events():
            if ctx.args.json:
                write(ctx.stdout, event.data + "\n")
                continue
            try:
                payload = json.loads(event.data)
            except ValueError:
                payload = {"data": event.data}
            if not isinstance(payload, dict):
                payload = {"data": payload}
            name = event.event or payload.get("topic", "")
            write(ctx.stdout, f"{time.strftime('%H:%M:%S')} {name} {describe(payload)}".replace("  ", " ") + "\n")
    except (OSError, http.client.HTTPException) as e:
        raise CLIError(f"the events feed was cut: {e}", FAILED) from None
    finally:
        response.close()
    return 0
