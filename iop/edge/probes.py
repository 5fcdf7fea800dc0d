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

from iop.edge.errors import ServiceError
from iop.run import NOT_SUPPORTED, UNKNOWN_COMMAND

#: The Node command that probes an adapter's back end.
PROBE_COMMAND = "probe"


def probe_provider(service, spec):
    """
    Probe the back end of the provider resource C{spec} (a
    L{iop.edge.pool.ProviderSpec}) through its Node.

    @param service: the L{iop.edge.service.EdgeService} (its C{command}).
    @return: a Deferred firing with C{True} (it answers), C{False} (it
        does not, or its Node could not be asked) or C{None} (it cannot be
        probed); see L{iop.edge.pool.ProviderPool}'s C{prober}.
    """
    d = service.command(spec.node_id, PROBE_COMMAND, spec.adapter)

    def answered(result):
        passed = not isinstance(result, dict) or result.get("ok", True) is not False
        service.bus.publish(
            "provider",
            {"event": "probe", "node": spec.node_id, "provider": spec.provider_id, "passed": passed},
        )
        return passed

    def failed(failure):
        if failure.check(ServiceError) and failure.value.code in (UNKNOWN_COMMAND, NOT_SUPPORTED):
            return None
        return answered({"ok": False})

    return d.addCallbacks(answered, failed)
