"""
Tests for L{iop.adapters.cli} with real child processes (C{sys.executable
-c ...}), because what matters is what happens to real processes: their
output streams, their exit status is read, and a cancelled one is gone.
"""

import os
import sys

from twisted.internet import defer, reactor
from twisted.internet.process import Process
from twisted.trial.unittest import SynchronousTestCase, TestCase
from zope.interface.verify import verifyObject

from iop.adapters.cli import CLIAdapter
from iop.adapters.interface import AdapterConfigError, IAdapter, NotSupported, RunInput
from iop.adapters.test.providers import Events
from iop.adapters.test.test_echo import PausingEvents

UPPER = "import sys; sys.stdout.write(sys.stdin.read().upper())"
# Prints its arguments, then hangs until killed.
HANG = "import sys, time; print(' '.join(sys.argv[1:]), flush=True); time.sleep(600)"
# Ignores SIGTERM, so only SIGKILL ends it.
STUBBORN = (
    "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "print('ready', flush=True); time.sleep(600)"
)


def python(code, **options):
    return dict(options, command=[sys.executable, "-c", code])


def run_input(text="hello world", session_id="", run_id="r1"):
    return RunInput(run_id=run_id, messages=[{"role": "user", "content": text}], session_id=session_id)


def assert_gone(testcase, pid):
    """
    The process no longer exists (it was reaped, so not even a zombie).
    """
    testcase.assertRaises(ProcessLookupError, os.kill, pid, 0)


@defer.inlineCallbacks
def running(adapter, run):
    """
    Start C{run} on C{adapter} and wait for its first delta.

    @return: a Deferred firing with C{(execute Deferred, events, process)}.
    """
    events = Events()
    first = events.first("delta")
    d = adapter.execute(run, events)
    yield first
    return d, events, adapter.running[run.run_id]


class CLITestCase(TestCase):
    def adapter(self, **options):
        adapter = CLIAdapter("cli", 2, options, reactor)
        self.addCleanup(adapter.stop)
        return adapter


class RunTests(CLITestCase):
    @defer.inlineCallbacks
    def test_stdin_to_deltas(self):
        """
        The last user message goes to stdin; stdout comes back as deltas
        between start and complete; no usage is invented.
        """
        events = Events()
        run = RunInput(
            "r1",
            messages=[
                {"role": "user", "content": "old"},
                {"role": "assistant", "content": "x"},
                {"role": "user", "content": "h\u00e9llo"},
            ],
        )
        yield self.adapter(**python(UPPER)).execute(run, events)
        self.assertEqual(events.types()[0], "start")
        self.assertEqual(events.types()[-1], "complete")
        self.assertEqual(set(events.types()[1:-1]), {"delta"})
        self.assertEqual(events.text(), "H\u00c9LLO")
        self.assertIsNone(events.events[-1].usage)

    @defer.inlineCallbacks
    def test_paused_by_flow_control(self):
        """
        The process is its stream's producer: paused, its output pipe is
        no longer read (so a slow caller blocks the process rather than
        filling the Node's memory); resumed, every byte arrives.
        """
        events = PausingEvents()
        code = "import sys; sys.stdout.write('x' * 1_000_000); sys.stdout.flush()"
        adapter = self.adapter(**python(code))
        d = adapter.execute(run_input(), events)
        yield events.first("delta")
        process = adapter.running["r1"]
        self.assertIs(events.producer, process)
        transport = process.transport
        assert isinstance(transport, Process)
        readers = set(reactor.getReaders())
        self.assertFalse(readers & set(transport.pipes.values()))
        process.resumeProducing()
        yield d
        self.assertEqual(events.text(), "x" * 1_000_000)
        self.assertEqual(events.types()[-1], "complete")

    @defer.inlineCallbacks
    def test_env_and_cwd(self):
        """
        env is merged over the Node's environment and cwd is the working
        directory.
        """
        cwd = self.mktemp()
        os.mkdir(cwd)
        code = "import os; print(os.environ['IOP_X'], bool(os.environ.get('PATH')), os.getcwd())"
        events = Events()
        yield self.adapter(**python(code, env={"IOP_X": "42"}, cwd=cwd)).execute(run_input(), events)
        self.assertEqual(events.text(), f"42 True {os.path.realpath(cwd)}\n")

    @defer.inlineCallbacks
    def test_exit_status(self):
        """
        A non-zero exit is an exit_status error whose status is the exit
        code and whose message carries the tail of stderr.
        """
        code = "import sys; sys.stderr.write('x' * 5000 + 'the real reason'); sys.exit(3)"
        events = Events()
        yield self.adapter(**python(code)).execute(run_input(), events)
        self.assertEqual(events.types(), ["start", "error"])
        error = events.events[-1].error
        assert error is not None
        self.assertEqual((error.code, error.status), ("exit_status", 3))
        self.assertIn("the real reason", error.message)
        self.assertLess(len(error.message), 2200)

    @defer.inlineCallbacks
    def test_command_not_found(self):
        """
        A command that does not exist ends the run with spawn_failed.
        """
        events = Events()
        yield self.adapter(command=["iop-no-such-command-xyz"]).execute(run_input(), events)
        self.assertEqual(events.types(), ["error"])
        assert events.events[0].error is not None
        self.assertEqual(events.events[0].error.code, "spawn_failed")

    def test_start_refuses_a_missing_command(self):
        """
        An adapter whose command is not an executable program here does
        not start (the configuration naming it is refused, naming the
        key); one that is found starts.
        """
        for command in (["iop-no-such-command-xyz"], ["./iop-no-such-command-xyz"], ["/etc/passwd"]):
            failure = self.failureResultOf(defer.maybeDeferred(self.adapter(command=command).start))
            self.assertIn("adapters[cli].command", str(failure.value))
        self.successResultOf(self.adapter(command=[sys.executable, "-c", "pass"]).start())
        self.successResultOf(self.adapter(command=["python3"]).start())

    @defer.inlineCallbacks
    def test_cancel_kills(self):
        """
        Cancelling fails the Deferred with CancelledError at once, emits no
        terminal, and the process is gone afterwards.
        """
        adapter = self.adapter(**python(HANG))
        d, events, process = yield running(adapter, run_input())
        d.cancel()
        yield self.assertFailure(d, defer.CancelledError)
        yield process.when_ended()
        assert_gone(self, process.pid)
        self.assertEqual(events.types(), ["start", "delta"])
        self.assertEqual(adapter.running, {})

    @defer.inlineCallbacks
    def test_cancel_escalates(self):
        """
        A process that ignores SIGTERM is killed with SIGKILL after
        grace_sec.
        """
        adapter = self.adapter(**python(STUBBORN, grace_sec=0.2))
        d, events, process = yield running(adapter, run_input())
        d.cancel()
        self.failureResultOf(d, defer.CancelledError)
        reason = yield process.when_ended()
        self.assertEqual(reason.signal, 9)
        assert_gone(self, process.pid)

    @defer.inlineCallbacks
    def test_timeout(self):
        """
        A run longer than timeout_sec is killed and ends with a timeout
        error; output before it is kept.
        """
        adapter = self.adapter(**python(HANG, timeout_sec=0.3))
        events = Events()
        yield adapter.execute(run_input(), events)
        self.assertEqual(events.types(), ["start", "delta", "error"])
        assert events.events[-1].error is not None
        self.assertEqual(events.events[-1].error.code, "timeout")

    @defer.inlineCallbacks
    def test_stop(self):
        """
        Stopping the adapter stops running processes and fires once they
        are gone; their runs end with adapter_stopped.
        """
        adapter = CLIAdapter("cli", 2, python(HANG), reactor)
        d, events, process = yield running(adapter, run_input())
        pid = process.pid
        yield adapter.stop()
        assert_gone(self, pid)
        yield d
        self.assertEqual(events.events[-1].error.code, "adapter_stopped")


class SessionTests(CLITestCase):
    def test_capabilities(self):
        """
        sessions: true declares sessions and the session_list command.
        """
        adapter = CLIAdapter("cli", 1, python(UPPER, sessions=True), reactor)
        self.assertTrue(verifyObject(IAdapter, adapter))
        self.assertTrue(adapter.capabilities().sessions)
        self.assertFalse(CLIAdapter("cli", 1, python(UPPER), reactor).capabilities().sessions)

    @defer.inlineCallbacks
    def test_session_args_and_list(self):
        """
        With sessions on, a run with a session id gets [session_arg, id]
        appended, and the session is listed with its run count afterwards.
        """
        code = "import sys; print(' '.join(sys.argv[1:]))"
        adapter = self.adapter(**python(code, sessions=True, session_arg="--resume"))
        events = Events()
        yield adapter.execute(run_input(session_id="s1"), events)
        yield adapter.execute(run_input(session_id="s1", run_id="r2"), events)
        self.assertEqual(events.text(), "--resume s1\n--resume s1\n")
        [listed] = yield adapter.command("session_list", {})
        self.assertEqual((listed["session_id"], listed["runs"], listed["running"]), ("s1", 2, False))

    @defer.inlineCallbacks
    def test_terminate(self):
        """
        terminate_session kills the session's running process, fires with
        terminated=True once it is gone, ends the run with a
        session_terminated error, and forgets the session.
        """
        adapter = self.adapter(**python(HANG, sessions=True))
        d, events, process = yield running(adapter, run_input(session_id="s1"))
        pid = process.pid
        result = yield adapter.terminate_session("", "s1")
        self.assertEqual(result, {"terminated": True})
        assert_gone(self, pid)
        yield d
        self.assertEqual(events.events[-1].error.code, "session_terminated")
        self.assertEqual((yield adapter.command("session_list", {})), [])
        self.assertEqual((yield adapter.terminate_session("", "s1")), {"terminated": False})

    @defer.inlineCallbacks
    def test_busy_session(self):
        """
        A second run on a session whose process is still running is
        refused with session_busy rather than run concurrently.
        """
        adapter = self.adapter(**python(HANG, sessions=True))
        first = Events()
        started = first.first("delta")
        d = adapter.execute(run_input(session_id="s1"), first)
        yield started
        second = Events()
        yield adapter.execute(run_input(session_id="s1", run_id="r2"), second)
        assert second.events[0].error is not None
        self.assertEqual(second.events[0].error.code, "session_busy")
        d.cancel()
        self.failureResultOf(d, defer.CancelledError)


class ConfigTests(SynchronousTestCase):
    def test_no_sessions(self):
        """
        Without sessions, terminate_session and session_list raise
        NotSupported.
        """
        adapter = CLIAdapter("cli", 1, {"command": ["true"]}, reactor)
        self.assertRaises(NotSupported, adapter.terminate_session, "", "s1")
        self.assertRaises(NotSupported, adapter.command, "session_list", {})

    def test_bad_options(self):
        """
        command is required and must be a non-empty list of strings;
        timeout_sec must be positive; errors name the key.
        """
        for options, key in [
            ({}, "command"),
            ({"command": "echo hi"}, "command"),
            ({"command": []}, "command"),
            ({"command": ["echo"], "timeout_sec": 0}, "timeout_sec"),
            ({"command": ["echo"], "env": {"A": 1}}, "env"),
        ]:
            error = self.assertRaises(AdapterConfigError, CLIAdapter, "c", 1, options, reactor)
            self.assertIn(f"adapters[c].{key}", str(error))
