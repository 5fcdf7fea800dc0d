"""
The built-in C{echo} back end: streams the last user message back.

It makes a fresh install work with no model at all, and gives tests a back
end whose output is known exactly: the concatenated deltas equal the input,
one delta per word with its trailing whitespace (emitted in one turn
without C{delay_ms}, they reach the wire as one: L{iop.node.joined}).
"""

import re
from collections.abc import Generator
from typing import Any

from twisted.internet import defer, task
from twisted.internet.interfaces import IReactorTime
from zope.interface import implementer

from iop.adapters.base import AdapterBase, OutputGate
from iop.adapters.interface import AdapterConfigError, Emit, IAdapter, RunInput
from iop.run import COMPLETE, DELTA, START, RunEventData, Usage

_WORD = re.compile(r"\S+\s*|\s+")


def words(text: str) -> list[str]:
    """
    Split C{text} into pieces that concatenate back to it exactly.
    """
    return _WORD.findall(text)


@implementer(IAdapter)
class EchoAdapter(AdapterBase):
    """
    Options: C{delay_ms} (default 0), the pause before each delta. Its
    deltas wait while the stream's flow control pauses it (L{OutputGate}).
    """

    type = "echo"
    OPTIONS = AdapterBase.OPTIONS | {"delay_ms"}

    def __init__(self, name: str, max_concurrency: int, options: dict[str, Any] | None, reactor: IReactorTime) -> None:
        super().__init__(name, max_concurrency, options, reactor)
        delay = self.option("delay_ms", 0, (int, float))
        if delay < 0:
            raise AdapterConfigError(name, "delay_ms", "must not be negative")
        self.delay = delay / 1000.0

    @defer.inlineCallbacks
    def execute(self, run: RunInput, emit: Emit) -> Generator["defer.Deferred[Any]", Any, None]:
        text = run.last_user_text()
        if not isinstance(text, str):
            # The same failure as splitting it into words would be.
            raise TypeError(f"echo takes text content, not {type(text).__name__}")
        pieces = words(text)
        gate = OutputGate.registered(emit)
        emit(RunEventData(START))
        for piece in pieces:
            if self.delay:
                yield task.deferLater(self.reactor, self.delay, lambda: None)
            if gate.paused:
                yield gate.wait()
            emit(RunEventData(DELTA, text=piece))
        usage = Usage(input_tokens=len(text.split()), output_tokens=len(pieces))
        emit(RunEventData(COMPLETE, usage=usage, finish_reason="stop"))
