"""
Tests for L{iop.adapters.echo}, the built-in back end whose output is
known exactly.
"""

from typing import Any

from twisted.internet import task
from twisted.internet.interfaces import IPushProducer
from twisted.trial.unittest import SynchronousTestCase
from zope.interface.verify import verifyObject

from iop.adapters.echo import EchoAdapter, words
from iop.adapters.interface import AdapterConfigError, IAdapter, NotSupported, RunInput
from iop.adapters.registry import build_adapter
from iop.adapters.test.providers import Events
from iop.run import Usage


def run_input(text):
    return RunInput("r1", messages=[{"role": "user", "content": text}])


class PausingEvents(Events):
    """
    An C{emit} that takes a producer, as the Node's does, and pauses it
    after the first delta, as a slow caller's flow control would.

    @ivar producer: the registered producer (unset until then).
    """

    producer: IPushProducer

    def register_producer(self, producer):
        self.producer = producer

    def __call__(self, event):
        if event.type == "delta" and "delta" not in self.types():
            self.producer.pauseProducing()
        super().__call__(event)


class EchoTests(SynchronousTestCase):
    def test_deltas_equal_input(self):
        """
        The concatenated deltas equal the input exactly, whitespace
        included, one delta per word, between start and complete.
        """
        text = "  Hello,  wide\tworld \n again "
        events = Events()
        self.successResultOf(EchoAdapter("echo", 1, {}, task.Clock()).execute(run_input(text), events))
        self.assertEqual(events.text(), text)
        deltas = [e.text for e in events.events if e.type == "delta"]
        self.assertEqual(deltas, words(text))
        self.assertEqual(len([d for d in deltas if d.strip()]), 4)
        self.assertEqual(events.types(), ["start"] + ["delta"] * len(deltas) + ["complete"])

    def test_usage(self):
        """
        Usage counts input words and output deltas; no breakdown is made up.
        """
        events = Events()
        self.successResultOf(EchoAdapter("echo", 1, {}, task.Clock()).execute(run_input("a b c"), events))
        self.assertEqual(events.events[-1].usage, Usage(input_tokens=3, output_tokens=3))

    def test_delay(self):
        """
        With delay_ms, each delta waits that long on the adapter's clock.
        """
        clock = task.Clock()
        events = Events()
        d = EchoAdapter("echo", 1, {"delay_ms": 100}, clock).execute(run_input("one two"), events)
        self.assertEqual(events.types(), ["start"])
        clock.advance(0.099)
        self.assertEqual(events.types(), ["start"])
        clock.advance(0.001)
        self.assertEqual(events.text(), "one ")
        self.assertNoResult(d)
        clock.advance(0.1)
        self.assertEqual(events.text(), "one two")
        self.successResultOf(d)
        self.assertEqual(events.types()[-1], "complete")

    def test_cancel(self):
        """
        Cancelling a delayed echo stops it: no more deltas, no terminal.
        """
        clock = task.Clock()
        events = Events()
        d = EchoAdapter("echo", 1, {"delay_ms": 100}, clock).execute(run_input("one two"), events)
        d.cancel()
        self.failureResultOf(d)
        clock.advance(1)
        self.assertEqual(events.types(), ["start"])

    def test_interface_and_registry(self):
        """
        The registry builds an echo adapter that provides IAdapter and has
        neither sessions nor tunnels.
        """
        adapter = build_adapter("e", "echo", 3, {}, task.Clock())
        self.assertTrue(verifyObject(IAdapter, adapter))
        self.assertEqual(adapter.capabilities().max_concurrency, 3)
        self.assertRaises(NotSupported, adapter.terminate_session, "", "s")
        self.assertRaises(NotSupported, adapter.tunnel, None, None)
        self.assertRaises(AdapterConfigError, EchoAdapter, "e", 1, {"delay_ms": -1}, task.Clock())


class RegistryTests(SynchronousTestCase):
    def test_all_types_build(self):
        """
        Every registered type name builds its class with valid options, and
        an unknown type is a config error naming the adapter.
        """
        clock = task.Clock()
        options: dict[str, dict[str, Any]] = {
            "openai_compat": {"base_url": "http://127.0.0.1:8000/v1"},
            "vllm": {"base_url": "http://127.0.0.1:8000/v1"},
            "ollama": {"base_url": "http://127.0.0.1:11434"},
            "cli": {"command": ["cat"]},
            "echo": {},
        }
        for type_name, opts in options.items():
            adapter = build_adapter("a", type_name, 1, opts, clock)
            self.assertEqual(adapter.type, type_name)
            self.assertTrue(verifyObject(IAdapter, adapter))
        error = self.assertRaises(AdapterConfigError, build_adapter, "a", "nope", 1, {}, clock)
        self.assertIn("adapters[a].type", str(error))

    def test_paused_by_flow_control(self):
        """
        While its stream's flow control pauses it, echo makes no more
        deltas (a slow reader does not make the Node hold the answer);
        resumed, it goes on to the end.
        """
        events = PausingEvents()
        d = EchoAdapter("echo", 1, {}, task.Clock()).execute(run_input("one two three"), events)
        self.assertEqual(events.text(), "one ")
        self.assertNoResult(d)
        events.producer.resumeProducing()
        self.successResultOf(d)
        self.assertEqual(events.text(), "one two three")
        self.assertEqual(events.types()[-1], "complete")

    def test_cancelled_while_paused(self):
        """
        A run cancelled while paused ends at once, and a later resume
        (the Node abandoning the stream) changes nothing.
        """
        events = PausingEvents()
        d = EchoAdapter("echo", 1, {}, task.Clock()).execute(run_input("one two three"), events)
        d.cancel()
        self.failureResultOf(d)
        events.producer.stopProducing()
        self.assertEqual(events.text(), "one ")
