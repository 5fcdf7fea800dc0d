"""
The capacity gate and slots.
"""

from twisted.trial.unittest import SynchronousTestCase

from iop.node.gate import CapacityGate


class GateTests(SynchronousTestCase):
    def test_limit(self):
        """
        The gate hands out at most C{limit} slots and refuses beyond.
        """
        gate = CapacityGate(2)
        a, b = gate.acquire(), gate.acquire()
        self.assertIsNone(gate.acquire())
        a.release()
        self.assertIsNotNone(gate.acquire())
        self.assertEqual(gate.inUse, 2)
        del b

    def test_releaseIdempotent(self):
        """
        Releasing a slot twice frees it once: the count never goes negative.
        """
        gate = CapacityGate(1)
        slot = gate.acquire()
        slot.release()
        slot.release()
        self.assertEqual(gate.inUse, 0)

    def test_whenIdleAndOnChange(self):
        """
        whenIdle fires when the last slot is released; onChange sees every
        count.
        """
        seen = []
        gate = CapacityGate(2, seen.append)
        self.successResultOf(gate.whenIdle())
        a, b = gate.acquire(), gate.acquire()
        idle = gate.whenIdle()
        a.release()
        self.assertNoResult(idle)
        b.release()
        self.successResultOf(idle)
        self.assertEqual(seen, [1, 2, 1, 0])
