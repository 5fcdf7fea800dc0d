"""
Defaults shared by every adapter: no tunnel, no sessions, no extra
commands, and nothing to start or stop.
"""

from twisted.internet import defer

from iop.adapters.interface import AdapterConfigError, Capabilities, NotSupported


class AdapterBase:
    """
    Subclasses set C{type} and override what they support.

    @ivar options: the adapter's type-specific configuration keys.
    """

    #: The adapter type name (a key of L{iop.run.ADAPTER_TYPES}).
    type: str = ""

    def __init__(self, name, max_concurrency, options, reactor):
        if not isinstance(max_concurrency, int) or max_concurrency < 1:
            raise AdapterConfigError(f"adapters[{name}].max_concurrency must be a positive integer")
        self.name = name
        self.max_concurrency = max_concurrency
        self.options = dict(options or {})
        self.reactor = reactor

    def option(self, key, default=None, kind=None, required=False):
        """
        One type-specific option, checked; errors name the key.
        """
        if key not in self.options:
            if required:
                raise AdapterConfigError(f"adapters[{self.name}].{key} is required for type {self.type}")
            return default
        value = self.options[key]
        if kind is not None and not isinstance(value, kind):
            raise AdapterConfigError(f"adapters[{self.name}].{key} has the wrong type: {value!r}")
        return value

    def capabilities(self):
        return Capabilities(max_concurrency=self.max_concurrency)

    def start(self):
        return defer.succeed(None)

    def stop(self):
        return defer.succeed(None)

    def tunnel(self, request, sink):
        raise NotSupported(f"adapter {self.name} ({self.type}) has no raw provider tunnel")

    def terminate_session(self, target, session_id):
        raise NotSupported(f"adapter {self.name} ({self.type}) does not support sessions")

    def command(self, name, args, progress=None):
        raise NotSupported(f"adapter {self.name} ({self.type}) has no command {name!r}")
