"""
Flow control reaching the provider: an adapter hands the Node a producer
of its response body (through C{register_producer} on its sink or emit);
pausing it stops reading the provider, and the idle timeout with it, since
the silence is then the Node's own; resuming reads on.
"""

from twisted.internet import defer
from twisted.internet.task import Clock

from iop.adapters.interface import TunnelInput
from iop.adapters.test.providers import Events, Script, chunk, moment, sse
from iop.adapters.test.test_openai_compat import SSE_HEADERS, OpenAICompatTestCase, run_input
from iop.testing.tunnels import TunnelRecorder


class FlowEvents(Events):
    def __init__(self):
        super().__init__()
        self.producers = []

    def register_producer(self, producer):
        self.producers.append(producer)


class FlowSink(TunnelRecorder):
    def __init__(self):
        super().__init__()
        self.producers = []

    def register_producer(self, producer):
        self.producers.append(producer)


class PauseTests(OpenAICompatTestCase):
    @defer.inlineCallbacks
    def paused_run(self, first_chunk, **options):
        """
        A normalized run whose provider sent C{first_chunk} and holds its
        connection open, its body's producer paused after the first delta.
        @return: C{(script, adapter, events, run's Deferred, producer)}.
        """
        script = Script(headers=SSE_HEADERS, chunks=sse(first_chunk, done=False), hold=True)
        adapter = self.adapter(script, **options)
        adapter.clock = Clock()
        events = FlowEvents()
        first = events.first("delta")
        d = adapter.execute(run_input(), events)
        yield first
        yield moment()
        (producer,) = events.producers
        producer.pauseProducing()
        return script, adapter, events, d, producer

    @defer.inlineCallbacks
    def test_paused_run_does_not_time_out(self):
        """
        A normalized run hands over its body's producer; while it is
        paused, a provider silent for longer than idle_timeout_sec is not
        timed out; resumed, the idle timer runs again (and the run, which
        had begun, ends C{incomplete}).
        """
        script, adapter, events, d, producer = yield self.paused_run(chunk(content="first"), idle_timeout_sec=30)
        adapter.clock.advance(300)
        self.assertEqual(events.types(), ["start", "delta"])
        producer.resumeProducing()
        adapter.clock.advance(30)
        yield d
        assert events.events[-1].error is not None
        self.assertEqual((events.events[-1].error.code, events.events[-1].error.deadline), ("incomplete", "idle"))

    @defer.inlineCallbacks
    def test_tunnel_hands_over_its_producer(self):
        """
        A tunnel registers its body's producer with the sink; pausing and
        resuming it leaves the relayed bytes whole.
        """
        script = Script(headers=SSE_HEADERS, chunks=sse(chunk(content="a"), chunk(content="b")))
        adapter = self.adapter(script)
        sink = FlowSink()
        request = TunnelInput(tunnel_id="t1", method="POST", path="/chat/completions", headers=[], body=b"{}")
        d = adapter.tunnel(request, sink)
        yield sink.first_body
        (producer,) = sink.producers
        producer.pauseProducing()
        producer.resumeProducing()
        yield d
        self.assertEqual(b"".join(sink.bodies), b"".join(sse(chunk(content="a"), chunk(content="b"))))

    @defer.inlineCallbacks
    def test_grace_after_the_answer_waits_for_reading(self):
        """
        The grace after a whole answer (its finish reason seen) bounds the
        provider's silence, not a slow caller's: paused past it, the usage
        chunk that waits unread is still read once the caller takes more,
        and the run completes with it.
        """
        usage = {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}
        script, adapter, events, d, producer = yield self.paused_run(chunk(content="hi", finish="stop"))
        script.write(*sse(chunk(usage=usage)))
        yield moment()
        adapter.clock.advance(3)
        self.assertNoResult(d)
        producer.resumeProducing()
        yield moment()
        adapter.clock.advance(3)
        yield d
        last = events.events[-1]
        self.assertEqual((last.type, last.usage.output_tokens if last.usage else None), ("complete", 7))
