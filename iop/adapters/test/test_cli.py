"""
Tests for L{iop.adapters.cli} with real child processes (C{sys.executable
-c ...}), because what matters is what happens to real processes: their
output streams, their exit status is read, and a cancelled one is gone.
"""

import errno
import os
import signal
import sys

from twisted.internet import defer, reactor, task
from twisted.internet.error import ProcessTerminated
from twisted.internet.process import Process
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase, TestCase
from zope.interface.verify import verifyObject

from iop.adapters import cli
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


# Starts a child (a sleeping Python; it inherits stdout and stderr unless
# the Popen keyword arguments in {} say otherwise), prints its pid, then
# hangs or exits 0.
LEAVES = (
    "import subprocess, sys, time; "
    "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], {}); "
    "sys.stdout.write(f'{{p.pid}}\\n'); sys.stdout.flush(); {}"
)
SPAWNS_AND_HANGS = LEAVES.format("", "time.sleep(600)")
SPAWNS_AND_EXITS = LEAVES.format("", "pass")
# Its child holds none of its pipes.
SPAWNS_QUIET_AND_EXITS = LEAVES.format("stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL", "pass")
# Its child leaves the process group (a session of its own) with stdout.
SPAWNS_ESCAPED_AND_EXITS = LEAVES.format("start_new_session=True", "pass")


def python(code, **options):
    return dict(options, command=[sys.executable, "-c", code])


def run_input(text="hello world", session_id="", run_id="r1"):
    return RunInput(run_id=run_id, messages=[{"role": "user", "content": text}], session_id=session_id)


def assert_gone(testcase, pid):
    """
    The process no longer exists (it was reaped, so not even a zombie).
    """
    testcase.assertRaises(ProcessLookupError, os.kill, pid, 0)


def _state(pid):
    """
    The state letter of process C{pid} (C{Z} for a zombie), C{None} once
    it is gone.
    """
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0]
    except (ProcessLookupError, FileNotFoundError):
        return None


@defer.inlineCallbacks
def assert_dies(testcase, pid, seconds=2):
    """
    The process (not ours to reap) is gone or a zombie (dead, but not yet
    reaped by init, which may take its time) within C{seconds}: a SIGKILL
    takes effect soon after it is sent, not at once.
    """
    deadline = reactor.seconds() + seconds
    while _state(pid) not in (None, "Z") and reactor.seconds() < deadline:
        yield task.deferLater(reactor, 0.02, lambda: None)
    testcase.assertIn(_state(pid), (None, "Z"), f"pid {pid} is still running")


def kill_at_cleanup(testcase, pid):
    """
    SIGKILL C{pid} when the test ends, should it still be there.
    """

    def kill():
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    testcase.addCleanup(kill)


def within(d, seconds=5):
    """
    C{d}, failed with C{TimeoutError} (and cancelled) unless it fires
    within C{seconds}: a run that never ends fails its test quickly.
    """
    return d.addTimeout(seconds, reactor)


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
    def test_paused_time_is_not_the_commands(self):
        """
        While the caller is not taking the stream (the command blocked on
        its full pipe), timeout_sec does not run: a command whose own time
        is short completes, however long the caller paused.
        """
        code = "import sys; sys.stdout.write('x' * 1_000_000); sys.stdout.flush()"
        adapter = self.adapter(**python(code, timeout_sec=0.5))
        events = PausingEvents()
        d = adapter.execute(run_input(), events)
        yield events.first("delta")
        yield task.deferLater(reactor, 1.0, lambda: None)
        adapter.running["r1"].resumeProducing()
        yield within(d)
        self.assertEqual(events.types()[-1], "complete")
        self.assertEqual(len(events.text()), 1_000_000)

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

    @defer.inlineCallbacks
    def test_nul_in_environment(self):
        """
        A command that cannot be started because its environment holds a
        NUL fails its run with spawn_failed (not an exception).
        """
        events = Events()
        yield self.adapter(**python(UPPER, env={"IOP_X": "a\0b"})).execute(run_input(), events)
        self.assertEqual(events.types(), ["error"])
        assert events.events[0].error is not None
        self.assertEqual(events.events[0].error.code, "spawn_failed")

    @defer.inlineCallbacks
    def test_exec_failure(self):
        """
        A program that is found but cannot be run (here a script without
        a #! line) fails its run with spawn_failed saying why, also with a
        cwd (where Twisted forks rather than posix_spawn()s).
        """
        cwd = self.mktemp()
        os.mkdir(cwd)
        with open(os.path.join(cwd, "tool"), "w") as f:
            f.write("echo hi\n")
        os.chmod(os.path.join(cwd, "tool"), 0o755)
        events = Events()
        yield self.adapter(command=["./tool"], cwd=cwd).execute(run_input(), events)
        error = events.events[-1].error
        assert error is not None
        self.assertEqual(error.code, "spawn_failed")
        self.assertIn(f"[Errno {errno.ENOEXEC}]", error.message)


class ProcessGroupTests(CLITestCase):
    """
    The command leads a process group of its own, which is signalled as a
    whole; its run is over only once that group is gone or killed.
    """

    def leaving_adapter(self, code, **options):
        adapter = self.adapter(**python(code, **dict({"grace_sec": 0.2}, **options)))
        adapter.pipe_grace = 0.2
        return adapter

    @defer.inlineCallbacks
    def leaving(self, adapter, run=None):
        """
        Start a run of a command that prints the pid of the child it left.

        @return: a Deferred firing with C{(execute Deferred, events,
            process, child pid)}.
        """
        d, events, process = yield running(adapter, run or run_input())
        child = int(events.text().split()[0])
        kill_at_cleanup(self, child)
        return d, events, process, child

    @defer.inlineCallbacks
    def test_own_group(self):
        """
        The command is the leader of its own session and process group.
        """
        code = "import os; print(os.getpgid(0) == os.getpid(), os.getsid(0) == os.getpid())"
        events = Events()
        yield self.leaving_adapter(code).execute(run_input(), events)
        self.assertEqual(events.text(), "True True\n")

    @defer.inlineCallbacks
    def test_cancel_kills_the_group(self):
        """
        Cancelling a run ends what its command started too, and the run is
        over (its process and session released) only once it is gone.
        """
        adapter = self.leaving_adapter(SPAWNS_AND_HANGS)
        d, events, process, child = yield self.leaving(adapter)
        d.cancel()
        self.failureResultOf(d, defer.CancelledError)
        yield within(process.when_ended())
        yield assert_dies(self, child)
        self.assertEqual(adapter.running, {})

    @defer.inlineCallbacks
    def test_timeout_kills_the_group(self):
        """
        A timeout ends the whole process group before the terminal.
        """
        adapter = self.leaving_adapter(SPAWNS_AND_HANGS, timeout_sec=0.3)
        d, events, process, child = yield self.leaving(adapter)
        yield within(d)
        yield assert_dies(self, child)
        self.assertEqual(events.events[-1].error.code, "timeout")

    @defer.inlineCallbacks
    def test_timeout_ends_with_the_command(self):
        """
        timeout_sec bounds the command: once it has exited in time, what
        it left holding its pipes is killed after their grace, and the run
        completes rather than timing out.
        """
        adapter = self.leaving_adapter(SPAWNS_AND_EXITS, timeout_sec=0.3)
        adapter.pipe_grace = 0.6
        d, events, process, child = yield self.leaving(adapter)
        yield within(d)
        self.assertEqual(events.types(), ["start", "delta", "complete"])
        yield assert_dies(self, child)

    @defer.inlineCallbacks
    def test_stop_kills_the_group(self):
        """
        Stopping the adapter fires once every run's process group is gone.
        """
        adapter = self.leaving_adapter(SPAWNS_AND_HANGS)
        d, events, process, child = yield self.leaving(adapter)
        yield within(adapter.stop())
        yield assert_dies(self, child)
        yield d
        self.assertEqual(events.events[-1].error.code, "adapter_stopped")

    @defer.inlineCallbacks
    def cancelled_with_stubborn_child(self, adapter, run):
        """
        Start C{run} of a command whose child ignores SIGTERM, cancel it,
        and wait until the command itself is gone while the child lives
        on (until the SIGKILL after grace_sec).

        @return: a Deferred firing with the run's process.
        """
        d, events, process, child = yield self.leaving(adapter, run)
        while "ready\n" not in events.text():
            yield within(events.first("delta"))
        d.cancel()
        self.failureResultOf(d, defer.CancelledError)
        while _state(process.pid) is not None:  # the command itself goes at once
            yield task.deferLater(reactor, 0.01, lambda: None)
        self.assertNotIn(_state(child), (None, "Z"))
        return process

    def stubborn_adapter(self, max_concurrency=2, **options):
        child_code = (
            "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); "
            "time.sleep(60)"
        )
        code = LEAVES.format("", "time.sleep(600)").replace("'import time; time.sleep(60)'", repr(child_code))
        adapter = CLIAdapter("cli", max_concurrency, python(code, grace_sec=1, **options), reactor)
        self.addCleanup(adapter.stop)
        adapter.pipe_grace = 0.2
        return adapter

    @defer.inlineCallbacks
    def starts_once_gone(self, adapter, process, run):
        """
        C{run} waits, with no event, while the stopped C{process}'s group
        lives, and starts once it is gone.

        @return: a Deferred firing with the new run's Deferred.
        """
        again = Events()
        started = again.first("start")
        d = adapter.execute(run, again)
        self.assertEqual((again.events, process.end), ([], None))
        self.assertNotIn(run.run_id, adapter.running)
        yield within(started, 3)
        self.assertIsNotNone(process.end)
        self.assertIn(run.run_id, adapter.running)
        return d

    @defer.inlineCallbacks
    def test_session_waits_for_the_group(self):
        """
        A run continuing the session of a cancelled run whose child lives
        on waits until the SIGKILL after grace_sec ends that group, then
        starts: the tool never runs twice in one session.
        """
        adapter = self.stubborn_adapter(sessions=True)
        process = yield self.cancelled_with_stubborn_child(adapter, run_input(session_id="s1"))
        d = yield self.starts_once_gone(adapter, process, run_input(session_id="s1", run_id="r2"))
        d.cancel()

    @defer.inlineCallbacks
    def test_seat_waits_for_the_group(self):
        """
        With every seat held, one by a cancelled run whose group is still
        going (the Node gave that seat away at the cancel), the next run
        waits for that group before its command starts.
        """
        adapter = self.stubborn_adapter(max_concurrency=1)
        process = yield self.cancelled_with_stubborn_child(adapter, run_input())
        d = yield self.starts_once_gone(adapter, process, run_input(run_id="r2"))
        d.cancel()

    @defer.inlineCallbacks
    def test_cancelled_while_waiting(self):
        """
        A run cancelled while it waits for a stopped run's group fails at
        once and starts nothing, then or later.
        """
        adapter = self.stubborn_adapter(max_concurrency=1)
        process = yield self.cancelled_with_stubborn_child(adapter, run_input())
        waiting = Events()
        d = adapter.execute(run_input(run_id="r2"), waiting)
        d.cancel()
        self.failureResultOf(d, defer.CancelledError)
        yield within(process.when_ended())
        self.assertEqual((waiting.events, adapter.running), ([], {}))

    @defer.inlineCallbacks
    def test_stopped_while_waiting(self):
        """
        A run waiting for a seat when the adapter is stopped ends
        C{adapter_stopped} without starting its command.
        """
        adapter = self.stubborn_adapter(max_concurrency=1)
        yield self.cancelled_with_stubborn_child(adapter, run_input())
        waiting = Events()
        d = adapter.execute(run_input(run_id="r2"), waiting)
        yield within(adapter.stop())
        yield within(d)
        self.assertEqual(waiting.types(), ["error"])
        error = waiting.events[0].error
        assert error is not None
        self.assertEqual(error.code, "adapter_stopped")
        self.assertEqual(adapter.running, {})

    @defer.inlineCallbacks
    def test_exit_with_child_holding_stdout(self):
        """
        A command that exits 0 leaving a child with its stdout completes
        once the pipes' grace is over: the child is killed, the session is
        free again.
        """
        adapter = self.leaving_adapter(SPAWNS_AND_EXITS, sessions=True)
        d, events, process, child = yield self.leaving(adapter, run_input(session_id="s1"))
        yield within(d)
        self.assertEqual(events.types(), ["start", "delta", "complete"])
        yield assert_dies(self, child)
        [listed] = yield adapter.command("session_list", {})
        self.assertFalse(listed["running"])
        again = Events()
        yield within(adapter.execute(run_input(session_id="s1", run_id="r2"), again))
        self.assertEqual(again.types()[-1], "complete")

    @defer.inlineCallbacks
    def test_exit_with_quiet_child(self):
        """
        A child left running without the command's pipes is killed before
        the run ends.
        """
        adapter = self.leaving_adapter(SPAWNS_QUIET_AND_EXITS)
        d, events, process, child = yield self.leaving(adapter)
        yield within(d)
        self.assertEqual(events.types()[-1], "complete")
        yield assert_dies(self, child)

    @defer.inlineCallbacks
    def test_exit_with_escaped_child(self):
        """
        A child that left the process group is out of reach, but the run
        still ends: its pipes are closed after the grace.
        """
        adapter = self.leaving_adapter(SPAWNS_ESCAPED_AND_EXITS)
        d, events, process, child = yield self.leaving(adapter)
        yield within(d)
        self.assertEqual(events.types(), ["start", "delta", "complete"])
        self.assertEqual(adapter.running, {})

    @defer.inlineCallbacks
    def test_paused_output_is_not_cut(self):
        """
        While the caller is not taking the stream, the pipes' grace waits:
        what the command wrote before it exited all arrives once resumed,
        then the child holding stdout is killed and the run completes.
        """
        code = LEAVES.format("", "time.sleep(0.1); print('x' * 30000)")
        adapter = self.leaving_adapter(code)
        events = PausingEvents()
        d = adapter.execute(run_input(), events)
        first = yield events.first("delta")
        child = int(first.text)
        kill_at_cleanup(self, child)
        process = adapter.running["r1"]
        yield task.deferLater(reactor, 2.5 * adapter.pipe_grace, lambda: None)
        self.assertNoResult(d)
        process.resumeProducing()
        yield within(d)
        self.assertEqual(events.text(), f"{child}\n" + "x" * 30000 + "\n")
        self.assertEqual(events.types()[-1], "complete")
        yield assert_dies(self, child)


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
    def test_session_id_not_an_option(self):
        """
        A session id that starts with '-' (a tool whose session flag takes
        an optional value would read it as an option) fails its run with
        invalid_request before the command is started; a '-' further in
        is fine.
        """
        code = "import sys; print(sys.argv[1:])"
        adapter = self.adapter(**python(code, sessions=True, session_arg="--resume"))
        for session_id in ("--dangerously-skip-permissions", "-x"):
            events = Events()
            yield adapter.execute(run_input(session_id=session_id), events)
            self.assertEqual(events.types(), ["error"])
            assert events.events[0].error is not None
            self.assertEqual(events.events[0].error.code, "invalid_request")
        self.assertEqual((yield adapter.command("session_list", {})), [])
        events = Events()
        yield adapter.execute(run_input(session_id="a-b"), events)
        self.assertEqual(events.text(), "['--resume', 'a-b']\n")

    @defer.inlineCallbacks
    def test_session_id_control_characters(self):
        """
        A session id holding a control character (NUL included) fails its
        run with invalid_request: neither an exception nor a started tool.
        """
        adapter = self.adapter(**python("print('ran')", sessions=True))
        for session_id in ("a\0b", "a\nb", "\x1b[2J", "a\x7f", "a\x85"):
            events = Events()
            yield adapter.execute(run_input(session_id=session_id), events)
            self.assertEqual(events.types(), ["error"], session_id)
            assert events.events[0].error is not None
            self.assertEqual(events.events[0].error.code, "invalid_request")

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
    def test_terminated_session_runs_again_once_gone(self):
        """
        A run on a session being terminated waits until the terminated
        process has gone (it may take its time to save its state): the
        tool never has two processes in one session, even with seats
        free.
        """
        saver = (
            "import signal, sys, time\n"
            "def term(*a):\n    time.sleep(0.5); sys.exit(0)\n"
            "signal.signal(signal.SIGTERM, term)\n"
            "print('ready', flush=True); time.sleep(600)\n"
        )
        adapter = self.adapter(**python(saver, sessions=True, grace_sec=3))
        d, events, process = yield running(adapter, run_input(session_id="s1"))
        terminated = adapter.terminate_session("", "s1")
        again = Events()
        started = again.first("start")
        second = adapter.execute(run_input(session_id="s1", run_id="r2"), again)
        yield within(started)
        self.assertIsNotNone(process.end)
        self.assertEqual((yield terminated), {"terminated": True})
        self.assertEqual(events.events[-1].error.code, "session_terminated")
        [listed] = yield adapter.command("session_list", {})
        self.assertEqual((listed["runs"], listed["running"]), (1, True))
        process2 = adapter.running["r2"]
        yield task.deferLater(reactor, 0, lambda: None)  # out of the callbacks that started it
        second.cancel()
        self.failureResultOf(second, defer.CancelledError)
        yield within(process2.when_ended())
        yield d

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


class FakeProcesses(task.Clock):
    """
    A clock that spawns no process: each C{spawnProcess} connects the
    protocol to a L{FakeProcess}, whose process group lives until the test
    ends it (C{os.killpg} is patched to look at these).
    """

    def __init__(self, testcase):
        super().__init__()
        self.processes = []
        self.groups = set()
        testcase.patch(cli, "os", _FakeOS(self))

    def spawnProcess(self, protocol, executable, args, env=None, path=None, childFDs=None, **kwargs):
        process = FakeProcess(self, 1000 + len(self.processes), protocol)
        self.processes.append(process)
        self.groups.add(process.pid)
        protocol.makeConnection(process)
        return process


class _FakeOS:
    """
    L{os} with C{killpg} answering for L{FakeProcesses}' groups.
    """

    def __init__(self, reactor):
        self.reactor = reactor
        self.signals = []

    def __getattr__(self, name):
        return getattr(os, name)

    def killpg(self, pgid, number):
        if pgid not in self.reactor.groups:
            raise ProcessLookupError(pgid)
        self.signals.append((pgid, number))


class FakeProcess:
    def __init__(self, reactor, pid, protocol):
        self.reactor = reactor
        self.pid = pid
        self.protocol = protocol

    def write(self, data):
        pass

    def closeStdin(self):
        pass

    def closeChildFD(self, descriptor):
        pass

    def signalProcess(self, signalID):
        pass

    def pauseProducing(self):
        pass

    def resumeProducing(self):
        pass

    def end(self):
        """
        The command and its whole group are gone (killed by a signal).
        """
        self.reactor.groups.discard(self.pid)
        reason = Failure(ProcessTerminated(signal=signal.SIGTERM))
        self.protocol.processExited(reason)
        self.protocol.processEnded(reason)


class FakeSessionTests(SynchronousTestCase):
    """
    Sessions with fake processes, on a fake clock.
    """

    def test_terminate_with_a_run_waiting(self):
        """
        A run that waits to continue a session (its last run was
        cancelled, and its group is still going) when the session is
        terminated may start once that group is gone; the session is then
        still known (listed, running, and terminable), so no run of it
        starts beside that one.
        """
        clock = FakeProcesses(self)
        adapter = CLIAdapter("cli", 2, python(HANG, sessions=True), clock)
        first = adapter.execute(run_input(session_id="s1"), Events())
        first.cancel()
        self.failureResultOf(first, defer.CancelledError)
        waiting = Events()
        second = adapter.execute(run_input(session_id="s1", run_id="r2"), waiting)
        terminated = adapter.terminate_session("", "s1")
        clock.processes[0].end()
        self.assertEqual(self.successResultOf(terminated), {"terminated": True})
        self.assertEqual(waiting.types(), ["start"])
        [listed] = self.successResultOf(adapter.command("session_list", {}))
        self.assertEqual((listed["session_id"], listed["running"], listed["runs"]), ("s1", True, 1))
        third = Events()
        self.successResultOf(adapter.execute(run_input(session_id="s1", run_id="r3"), third))
        self.assertEqual([e.error and e.error.code for e in third.events], ["session_busy"])
        self.assertEqual(len(clock.processes), 2)
        terminating = adapter.terminate_session("", "s1")
        self.assertNoResult(terminating)
        clock.processes[1].end()
        self.assertEqual(self.successResultOf(terminating), {"terminated": True})
        self.successResultOf(second)
        error = waiting.events[-1].error
        assert error is not None
        self.assertEqual(error.code, "session_terminated")
        self.assertEqual(self.successResultOf(adapter.command("session_list", {})), [])
        self.assertEqual(adapter.running, {})
