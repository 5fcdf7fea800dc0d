"""
Process-level behaviour shared by both daemons.

twistd re-raises SIGTERM/SIGINT after a clean shutdown, so the process
ends "killed by signal" (status 143/130) even though nothing went wrong.
For an operator's process manager a requested stop is a success: once the
reactor runs (its own handlers are installed at startup and would replace
ours), the daemons take those two signals over and stop cleanly with
status 0.
"""

import signal


def on_stop_signals(reactor, stop):
    """
    Once C{reactor} runs, SIGTERM and SIGINT call C{stop(message)} in the
    reactor thread instead of twistd's handlers.
    """

    def handler(signum, frame):
        name = signal.Signals(signum).name
        reactor.callFromThread(stop, f"received {name}, shutting down")

    def install():
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, handler)

    reactor.callWhenRunning(install)


def exit_zero_on_stop_signals(reactor):
    """
    SIGTERM/SIGINT stop the reactor, and the process exits 0.
    """
    on_stop_signals(reactor, lambda message: _stop(reactor))


def _stop(reactor):
    if reactor.running:
        reactor.stop()
