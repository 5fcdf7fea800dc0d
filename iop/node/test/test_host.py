"""
The adapter host: keep, rebuild, retire; all-or-nothing application.
"""

from twisted.internet import defer
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from iop.node.host import AdapterHost, AdapterSetupError
from iop.node.metrics import NodeMetrics
from iop.node.test.held import HeldStarts
from iop.testing.node import ManualAdapter, adapter_config, build, hosted, manual


class HostTests(SynchronousTestCase):
    def setUp(self):
        self.host = AdapterHost(Clock(), build)

    def test_retired_adapter_stops_when_idle(self):
        """
        An adapter removed while it has work in flight keeps running that
        work and is stopped once its gate is idle.
        """
        self.successResultOf(self.host.apply([adapter_config("a")]))
        a = hosted(self.host, "a")
        slot = a.gate.acquire()
        assert slot is not None
        self.successResultOf(self.host.apply([]))
        self.assertIsNone(self.host.get("a"))
        adapter = a.adapter
        assert isinstance(adapter, ManualAdapter)
        self.assertEqual(adapter.stopped, 0)
        slot.release()
        self.assertEqual(adapter.stopped, 1)

    def test_in_flight_gauge_across_a_rebuild(self):
        """
        While a rebuilt adapter's old instance finishes its work, the
        adapter's in-flight gauge counts the work of both instances: the
        old one going idle does not set it to 0 under the new one's.
        """
        metrics = NodeMetrics()
        host = AdapterHost(Clock(), build, metrics)
        self.successResultOf(host.apply([adapter_config("a")]))
        old = hosted(host, "a").gate.acquire()
        assert old is not None
        self.successResultOf(host.apply([adapter_config("a", delay=1)]))  # other options: rebuilt
        new = hosted(host, "a").gate
        new.acquire()
        new.acquire()
        self.assertEqual(metrics.value("iop_node_in_flight", {"adapter": "a"}), 3)
        old.release()
        self.assertEqual(metrics.value("iop_node_in_flight", {"adapter": "a"}), 2)

    def test_all_or_nothing(self):
        """
        If one adapter fails to start, the ones started in the same apply
        are stopped and the previous set stays in place.
        """
        self.successResultOf(self.host.apply([adapter_config("old")]))
        started: list[ManualAdapter] = []

        def flaky(name, *args):
            adapter = build(name, *args)
            assert isinstance(adapter, ManualAdapter)
            if name == "bad":
                self.patch(adapter, "start", lambda: defer.fail(RuntimeError("port in use")))
            started.append(adapter)
            return adapter

        self.host.build = flaky
        failure = self.failureResultOf(
            self.host.apply([adapter_config("old"), adapter_config("new"), adapter_config("bad")]), AdapterSetupError
        )
        self.assertIn("adapter bad: start failed: port in use", str(failure.value))
        self.assertEqual([h.name for h in self.host.all()], ["old"])
        self.assertEqual(started[0].stopped, 1)

    def test_cancelled_apply_leaves_the_host_as_it_was(self):
        """
        Cancelling an apply while a start hangs (a session's configure
        deadline) fails it with C{CancelledError}, stops what it built (the
        started adapter and the abandoned one) without waiting, keeps the
        previous set, and frees the host: the next apply of the same
        configuration builds and starts each adapter once, and the
        in-flight gauge counts only the new instances' work.
        """
        metrics = NodeMetrics()
        starts = HeldStarts("slow")
        host = AdapterHost(Clock(), starts, metrics)
        self.successResultOf(host.apply([adapter_config("old")]))
        configs = [adapter_config("old"), adapter_config("fast"), adapter_config("slow"), adapter_config("later")]
        d = host.apply(configs)
        self.assertEqual(host.starting, ("slow", "later"))
        d.cancel()
        self.failureResultOf(d, defer.CancelledError)
        self.assertEqual(host.starting, ())
        self.assertEqual([h.name for h in host.all()], ["old"])
        self.assertEqual(
            [(a.started, a.stopped) for a in (starts.instance("fast"), starts.instance("slow"))], [(1, 1), (1, 1)]
        )
        self.assertEqual(starts.instance("later").started, 0)  # built, never started: nothing to stop
        self.assertEqual(starts.instance("old").stopped, 0)

        self.successResultOf(host.apply(configs))
        self.assertEqual(sorted(h.name for h in host.all()), ["fast", "later", "old", "slow"])
        self.assertIs(hosted(host, "slow").adapter, starts.instance("slow", 1))
        self.assertEqual([len(starts.built[name]) for name in ("old", "fast", "slow", "later")], [1, 2, 2, 2])
        hosted(host, "slow").gate.acquire()
        self.assertEqual(metrics.value("iop_node_in_flight", {"adapter": "slow"}), 1)

    def test_bad_options_json(self):
        """
        options_json that is not a JSON object is a setup error naming the
        adapter.
        """
        config = adapter_config("a")
        config.options_json = "[1]"
        failure = self.failureResultOf(self.host.apply([config]), AdapterSetupError)
        self.assertIn("adapter a: options_json", str(failure.value))

    def test_stop(self):
        """
        stop() stops every adapter.
        """
        self.successResultOf(self.host.apply([adapter_config("a"), adapter_config("b")]))
        adapters = [manual(self.host, h.name) for h in self.host.all()]

        self.successResultOf(self.host.stop())
        self.assertEqual([a.stopped for a in adapters], [1, 1])
        self.assertEqual(self.host.all(), [])


class RealAdapterTests(SynchronousTestCase):
    def test_missing_cli_command_refused(self):
        """
        A configuration (a refresh, or the one sent at registration) with a
        CLI adapter whose command is not on this node is refused naming the
        key, and the running set stays as it was: it is not reported
        applied.
        """
        from iop.adapters.registry import build_adapter

        host = AdapterHost(Clock(), build_adapter)
        self.successResultOf(host.apply([adapter_config("echo", type="echo")]))
        missing = adapter_config("tool", type="cli", command=["iop-no-such-command-xyz"])
        failure = self.failureResultOf(host.apply([adapter_config("echo", type="echo"), missing]), AdapterSetupError)
        self.assertIn("adapters[tool].command", str(failure.value))
        self.assertEqual([h.name for h in host.all()], ["echo"])
