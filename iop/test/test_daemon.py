"""
Stop signals shared by both daemons (L{iop.daemon}): the first stops the
reactor so services drain, later ones hurry the drain.
"""

import gc
import signal

from twisted.trial.unittest import SynchronousTestCase

from iop.daemon import freeze_startup_heap, stop_then_hurry
from iop.testing.reactor import RunningReactor, deliver_signal


class StopThenHurryTests(SynchronousTestCase):
    def setUp(self):
        for signum in (signal.SIGTERM, signal.SIGINT):
            self.addCleanup(signal.signal, signum, signal.getsignal(signum))
        self.hurried = []

    def test_first_stops_later_hurry(self):
        """
        The first SIGTERM or SIGINT stops the reactor once; every later one
        calls C{hurry} instead of stopping again.
        """
        reactor = RunningReactor()
        stop_then_hurry(reactor, lambda: self.hurried.append(True))
        deliver_signal(signal.SIGINT)
        self.assertEqual((reactor.stopped, self.hurried), (1, []))
        deliver_signal(signal.SIGTERM)
        deliver_signal(signal.SIGTERM)
        self.assertEqual((reactor.stopped, self.hurried), (1, [True, True]))

    def test_signal_while_already_stopping(self):
        """
        A signal that arrives while the reactor is already stopping (a
        fatal exit in progress) is no error.
        """
        reactor = RunningReactor(stopping=True)
        stop_then_hurry(reactor, lambda: self.hurried.append(True))
        deliver_signal(signal.SIGTERM)
        self.assertEqual((reactor.stopped, self.hurried), (0, []))


class FreezeTests(SynchronousTestCase):
    def test_startup_heap_frozen_once_running(self):
        """
        Once the reactor runs, what exists is moved out of the collector's
        generations (gc.freeze).
        """
        self.addCleanup(gc.unfreeze)
        gc.unfreeze()
        freeze_startup_heap(RunningReactor())
        self.assertGreater(gc.get_freeze_count(), 0)
