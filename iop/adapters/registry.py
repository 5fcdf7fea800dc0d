"""
Adapter types by name, and building an adapter instance from its config.

The catalogue of types (L{iop.run.ADAPTER_TYPES}) names each class by
dotted path, so that importing it does not import every back end.
"""

from typing import Any

from twisted.internet.interfaces import IReactorTime
from twisted.python.reflect import namedAny

from iop.adapters.interface import AdapterConfigError, IAdapter
from iop.run import ADAPTER_TYPES


def build_adapter(
    name: str, type: str, max_concurrency: int, options: dict[str, Any] | None, reactor: IReactorTime
) -> IAdapter:
    """
    Build one adapter instance.

    @raise AdapterConfigError: for an unknown type or a bad option.
    """
    if type not in ADAPTER_TYPES:
        known = ", ".join(sorted(ADAPTER_TYPES))
        raise AdapterConfigError(f"adapters[{name}].type {type!r} is unknown (known: {known})")
    adapter: IAdapter = namedAny(ADAPTER_TYPES[type])(name, max_concurrency, options, reactor)
    return adapter
