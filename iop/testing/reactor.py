"""
A stand-in for a running reactor, for code that installs signal handlers
once the reactor runs and stops it on a signal (L{iop.daemon}).
"""

from twisted.internet.error import ReactorNotRunning


class RunningReactor:
    """
    Just enough of a running reactor for L{iop.daemon} signal handling.
    """

    running = True

    def __init__(self, stopping=False):
        self.stopped = 0
        #: Like a reactor already shutting down (still "running"): stop() raises.
        self.stopping = stopping

    def callFromThread(self, f, *args):
        f(*args)

    def callWhenRunning(self, f, *args):
        f(*args)

    def stop(self):
        if self.stopping:
            raise ReactorNotRunning("already stopping")
        self.stopped += 1
