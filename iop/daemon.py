"""
Process-level behaviour shared by both daemons.

twistd re-raises SIGTERM/SIGINT after a clean shutdown, so the process
ends "killed by signal" (status -15) even though nothing went wrong. For an
operator's process manager a requested stop is a success: the daemons
replace those two handlers, once the reactor is running, with ones that
stop the reactor the same way but leave the exit status 0.
"""

import signal


def exit_zero_on_stop_signals(reactor):
    """
    Arrange for SIGTERM and SIGINT to shut down cleanly with status 0.
    """

    def stop(signum, frame):
        reactor.callFromThread(_stop, reactor)

    def install():
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, stop)

    reactor.callWhenRunning(install)


def _stop(reactor):
    if reactor.running:
        reactor.stop()
