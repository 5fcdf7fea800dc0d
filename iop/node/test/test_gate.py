"""
The capacity gate and slots.
"""

from twisted.trial.unittest import SynchronousTestCase

from iop.node.gate import CapacityGate, Slot


def take(gate: CapacityGate) -> Slot:
    slot = gate.acquire()
    assert slot is not None, "the gate is full"
    return slot


class GateTests(SynchronousTestCase):
    def test_limit(self):
        """
        The gate hands out at most C{limit} slots and refuses beyond.
        """
        gate = CapacityGate(2)
        a, b = take(gate), take(gate)
        self.assertIsNone(gate.acquire())
        a.release()
        self.assertIsNotNone(gate.acquire())
        self.assertEqual(gate.in_use, 2)
        del b

    def test_release_idempotent(self):
        """
        Releasing a slot twice frees it once: the count never goes negative.
        """
        gate = CapacityGate(1)
        slot = take(gate)
        slot.release()
        slot.release()
        self.assertEqual(gate.in_use, 0)

    def test_when_idle_and_on_change(self):
        """
        when_idle fires when the last slot is released; on_change sees every
        count.
        """
        seen: list[int] = []
        gate = CapacityGate(2, seen.append)
        self.successResultOf(gate.when_idle())
        a, b = take(gate), take(gate)
        idle = gate.when_idle()
        a.release()
        self.assertNoResult(idle)
        b.release()
        self.successResultOf(idle)
        self.assertEqual(seen, [1, 2, 1, 0])
