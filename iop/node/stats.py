"""
Per-adapter totals for the C{usage_status} node command.

Tokens are summed exactly as providers reported them (runs' terminal usage
and tunnels' usage observations); nothing is estimated. The book lives as
long as the process, across reconnects.
"""

from typing import Any

from iop.run import CANCELLED, COMPLETE, ERROR, Usage


class UsageBook:
    def __init__(self) -> None:
        self._adapters: dict[str, dict[str, Any]] = {}

    def _entry(self, adapter: str) -> dict[str, Any]:
        return self._adapters.setdefault(
            adapter,
            {
                "input_tokens": 0,
                "output_tokens": 0,
                "runs": {COMPLETE: 0, ERROR: 0, CANCELLED: 0},
                "tunnels": 0,
            },
        )

    def usage(self, adapter: str, usage: Usage) -> None:
        """
        Add one reported L{iop.run.Usage}.
        """
        entry = self._entry(adapter)
        entry["input_tokens"] += usage.input_tokens
        entry["output_tokens"] += usage.output_tokens
        for name in ("reasoning_tokens", "cached_input_tokens"):
            value = getattr(usage, name)
            if value is not None:
                entry[name] = entry.get(name, 0) + value

    def run_ended(self, adapter: str, status: str) -> None:
        runs = self._entry(adapter)["runs"]
        runs[status] = runs.get(status, 0) + 1

    def tunnel_ended(self, adapter: str) -> None:
        self._entry(adapter)["tunnels"] += 1

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """
        A JSON-able copy: C{{adapter: {input_tokens, output_tokens, runs:
        {complete, error, cancelled}, tunnels}}}.
        """
        return {name: {**entry, "runs": dict(entry["runs"])} for name, entry in sorted(self._adapters.items())}
