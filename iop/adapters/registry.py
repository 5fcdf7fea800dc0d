"""
Adapter types by name, and building an adapter instance from its config.

Types are named by dotted path so that importing the registry does not
import every back end's dependencies.
"""

from twisted.python.reflect import namedAny

from iop.adapters.interface import AdapterConfigError

ADAPTER_TYPES = {
    "echo": "iop.adapters.echo.EchoAdapter",
    "openai_compat": "iop.adapters.openai_compat.OpenAICompatAdapter",
    "vllm": "iop.adapters.vllm.VLLMAdapter",
    "ollama": "iop.adapters.ollama.OllamaAdapter",
    "cli": "iop.adapters.cli.CLIAdapter",
}

#: Types whose back end speaks OpenAI-compatible HTTP: the Edge sends their
#: OpenAI-surface requests as raw provider tunnels.
TUNNEL_TYPES = frozenset({"openai_compat", "vllm"})


def build_adapter(name, type, max_concurrency, options, reactor):
    """
    Build one adapter instance.

    @raise AdapterConfigError: for an unknown type or a bad option.
    """
    if type not in ADAPTER_TYPES:
        known = ", ".join(sorted(ADAPTER_TYPES))
        raise AdapterConfigError(f"adapters[{name}].type {type!r} is unknown (known: {known})")
    return namedAny(ADAPTER_TYPES[type])(name, max_concurrency, options, reactor)
