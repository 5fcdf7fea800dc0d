"""
Building adapters from their configuration: every option key a type reads
is declared, any other is refused, and checking a configuration (as the
Edge does at load) starts and opens nothing.
"""

import os
import re
from typing import Any

import yaml
from twisted.internet.testing import MemoryReactorClock
from twisted.trial.unittest import SynchronousTestCase

import iop
from iop.adapters.base import AdapterBase
from iop.adapters.interface import AdapterConfigError
from iop.adapters.registry import build_adapter, check_adapter
from iop.run import ADAPTER_TYPES

#: Valid options of each type, every declared key given.
EVERY_OPTION: dict[str, dict[str, Any]] = {
    "echo": {"delay_ms": 5},
    "openai_compat": {
        "base_url": "http://127.0.0.1:8000/v1",
        "api_key": "k",
        "headers": {"X-Team": "a"},
        "drop_headers": ["X-Secret"],
        "connect_timeout_sec": 3,
        "first_byte_timeout_sec": 10,
        "stall_timeout_sec": 10,
        "idle_timeout_sec": 10,
        "continuation": True,
        "usage": "always",
    },
    "cli": {
        "command": ["iop-no-such-command-xyz"],
        "env": {"A": "b"},
        "cwd": "/",
        "timeout_sec": 5,
        "grace_sec": 0,
        "sessions": True,
        "session_arg": "--resume",
    },
}
EVERY_OPTION["vllm"] = dict(EVERY_OPTION["openai_compat"])
EVERY_OPTION["ollama"] = {k: v for k, v in EVERY_OPTION["openai_compat"].items() if k != "usage"}
EVERY_OPTION["ollama"]["base_url"] = "http://127.0.0.1:11434"


def documented_adapters() -> list[dict[str, Any]]:
    """
    Every adapter entry of the YAML examples in docs/backends.md.
    """
    root = os.path.dirname(os.path.dirname(iop.__file__))
    with open(os.path.join(root, "docs", "backends.md"), encoding="utf-8") as f:
        blocks = re.findall(r"```yaml\n(.*?)```", f.read(), re.S)
    found: list[dict[str, Any]] = []
    stack: list[Any] = [yaml.safe_load(_dedent(block)) for block in blocks]
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            if value.get("type") in ADAPTER_TYPES and "name" in value:
                found.append(value)
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
    return found


def _dedent(block: str) -> str:
    indent = min(len(line) - len(line.lstrip()) for line in block.splitlines() if line.strip())
    return "\n".join(line[indent:] for line in block.splitlines())


class DeclaredOptionsTests(SynchronousTestCase):
    def test_every_declared_option_read(self):
        """
        Each type builds with every key it declares given a valid value,
        and reads every key it declares (none is accepted and ignored).
        """
        read: list[str] = []
        option = AdapterBase.option

        def recorded(adapter, key, *args, **kwargs):
            read.append(key)
            return option(adapter, key, *args, **kwargs)

        self.patch(AdapterBase, "option", recorded)
        for type_name, options in EVERY_OPTION.items():
            del read[:]
            adapter: Any = build_adapter("a", type_name, 1, options, MemoryReactorClock())
            self.assertEqual(set(options), type(adapter).OPTIONS, type_name)
            self.assertEqual(set(read), type(adapter).OPTIONS, type_name)

    def test_unknown_key_refused(self):
        """
        A misspelt option key is refused for every type, naming the key and
        the keys the type takes, rather than ignored.
        """
        for type_name, options in EVERY_OPTION.items():
            error = self.assertRaises(
                AdapterConfigError, build_adapter, "a", type_name, 1, dict(options, dleay_ms=3), MemoryReactorClock()
            )
            self.assertEqual(error.key, "dleay_ms")
            self.assertIn("adapters[a].dleay_ms is an unknown key for type " + type_name, str(error))
            self.assertIn("max_concurrency", str(error))

    def test_reading_an_undeclared_key_is_a_bug(self):
        """
        An adapter that reads an option it does not declare fails at once,
        so the declaration cannot drift from what is read.
        """

        class Sloppy(AdapterBase):
            type = "sloppy"

        self.assertRaises(AssertionError, Sloppy("s", 1, {}, None).option, "delay_ms")

    def test_documented_options_accepted(self):
        """
        Every adapter example of docs/backends.md passes the check.
        """
        documented = documented_adapters()
        self.assertEqual({a["type"] for a in documented}, set(ADAPTER_TYPES))
        for adapter in documented:
            options = {k: v for k, v in adapter.items() if k not in AdapterBase.COMMON_KEYS}
            check_adapter(adapter["name"], adapter["type"], adapter.get("max_concurrency", 1), options)


class CheckTests(SynchronousTestCase):
    def test_error_parts(self):
        """
        A bad value is refused naming the key, kept apart from the problem
        (what the Edge re-words as its own path).
        """
        error = self.assertRaises(AdapterConfigError, check_adapter, "echo", "echo", 1, {"delay_ms": "fast"})
        self.assertEqual((error.key, error.problem), ("delay_ms", "has the wrong type: 'fast'"))
        self.assertEqual(str(error), "adapters[echo].delay_ms has the wrong type: 'fast'")

    def test_building_opens_nothing(self):
        """
        Building any type leaves its reactor untouched: no connection,
        listener, timer, reader or trigger (the Edge's check builds them
        all and drops them).
        """
        for type_name, options in EVERY_OPTION.items():
            reactor = MemoryReactorClock()
            build_adapter("a", type_name, 1, options, reactor)
            self.assertEqual(
                (reactor.tcpClients, reactor.tcpServers, reactor.unixClients, reactor.sslClients), ([], [], [], [])
            )
            self.assertEqual((reactor.getDelayedCalls(), reactor.triggers), ([], {}))
            self.assertEqual((reactor.getReaders(), reactor.getWriters()), ([], []))

    def test_not_started(self):
        """
        The check does not start the adapter: a CLI command missing here
        (only the Node can tell) passes, while the Node's start refuses it.
        """
        check_adapter("agent", "cli", 1, {"command": ["iop-no-such-command-xyz"]})
        adapter = build_adapter("agent", "cli", 1, {"command": ["iop-no-such-command-xyz"]}, MemoryReactorClock())
        self.assertRaises(AdapterConfigError, adapter.start)
