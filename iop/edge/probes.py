"""
Probing the back end of an ejected provider, so that it returns as soon
as it answers again instead of after a whole cooldown.

A probe is the Node command C{probe} on the provider's adapter: the Node
sends its back end a cheap request (C{GET /models}, C{/api/tags}) with a
short timeout and answers C{{"ok": true}}, or C{{"ok": false, "reason":
...}} (or fails the command) when the back end does not answer. A Node or
adapter without the command (C{unknown_command}, C{not_supported}) is not
probed again: its provider waits for its cooldown.
"""

from collections.abc import Callable
from typing import Any

from twisted.internet.defer import Deferred
from twisted.python.failure import Failure

from iop.edge.bus import EventBus
from iop.edge.errors import ServiceError
from iop.edge.pool import ProviderSpec
from iop.run import NOT_SUPPORTED, PROBE_COMMAND, UNKNOWN_COMMAND

#: How the Edge runs a node command: C{command(node_id, command, adapter)}
#: (L{iop.edge.commands.NodeCommands.command}).
Command = Callable[[str, str, str], "Deferred[Any]"]


def probe_provider(command: Command, bus: EventBus, spec: ProviderSpec) -> "Deferred[bool | None]":
    """
    Probe the back end of the provider resource C{spec} through its Node
    (C{command}), and publish the outcome on C{bus} (a C{provider}
    C{probe} event).

    @return: a Deferred firing with C{True} (it answers), C{False} (it
        does not, or its Node could not be asked) or C{None} (it cannot be
        probed); see L{iop.edge.pool.ProviderPool}'s C{prober}.
    """
    d = command(spec.node_id, PROBE_COMMAND, spec.adapter)

    def answered(result: Any) -> bool:
        passed = not isinstance(result, dict) or result.get("ok", True) is not False
        bus.publish(
            "provider", {"event": "probe", "node": spec.node_id, "provider": spec.provider_id, "passed": passed}
        )
        return passed

    def failed(failure: Failure) -> bool | None:
        if isinstance(failure.value, ServiceError) and failure.value.code in (UNKNOWN_COMMAND, NOT_SUPPORTED):
            return None
        return answered({"ok": False})

    return d.addCallbacks(answered, failed)
