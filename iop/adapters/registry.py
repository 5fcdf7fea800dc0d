"""
Adapter types by name, and building an adapter instance from its config.

The catalogue of types (L{iop.run.ADAPTER_TYPES}) names each class by
dotted path, so that importing it does not import every back end.

The Node builds its adapters with L{build_adapter}; the Edge checks every
adapter of C{edge.yaml} with the same code at load (L{check_adapter}), so
that a bad option stops the Edge at start instead of every Node it is sent
to. This is the one module of L{iop.adapters} the Edge imports (only its
configuration does: docs/architecture.md).
"""

import builtins
from typing import Any, cast

from twisted.internet.interfaces import IReactorTime
from twisted.internet.testing import MemoryReactorClock
from twisted.python.reflect import namedAny

from iop.adapters.base import AdapterBase
from iop.adapters.interface import AdapterConfigError, IAdapter
from iop.run import ADAPTER_TYPES

#: The keys of an adapter's entry that are not options (L{AdapterBase}).
COMMON_KEYS = AdapterBase.COMMON_KEYS


def build_adapter(
    name: str, type: str, max_concurrency: int, options: dict[str, Any] | None, reactor: IReactorTime
) -> IAdapter:
    """
    Build one adapter instance.

    @raise AdapterConfigError: for an unknown type, an option key the type
        does not declare (L{AdapterBase.OPTIONS}: a misspelt key must not
        pass silently), or a bad option value.
    """
    if type not in ADAPTER_TYPES:
        known = ", ".join(sorted(ADAPTER_TYPES))
        raise AdapterConfigError(name, "type", f"{type!r} is unknown (known: {known})")
    adapter_type: builtins.type[AdapterBase] = namedAny(ADAPTER_TYPES[type])
    unknown = sorted(set(options or {}) - adapter_type.OPTIONS)
    if unknown:
        expected = ", ".join(sorted(adapter_type.OPTIONS | COMMON_KEYS))
        raise AdapterConfigError(name, unknown[0], f"is an unknown key for type {type} (expected one of: {expected})")
    # (Every type implements IAdapter; AdapterBase alone does not say so.)
    return cast(IAdapter, adapter_type(name, max_concurrency, options, reactor))


def check_adapter(name: str, type: str, max_concurrency: int, options: dict[str, Any] | None) -> None:
    """
    Refuse what L{build_adapter} would refuse on a Node, without one: the
    adapter is built on a reactor of memory and dropped. Building only
    reads options (L{AdapterBase}), so nothing is started or opened; what
    only the Node can tell (a CLI command missing there) is for its
    C{start}.

    @raise AdapterConfigError: as L{build_adapter}.
    """
    build_adapter(name, type, max_concurrency, options, MemoryReactorClock())


__all__ = ["COMMON_KEYS", "AdapterConfigError", "build_adapter", "check_adapter"]
