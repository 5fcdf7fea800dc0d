"""
The C{cli} back end: a local command-line program as a model.

Each run spawns C{command} with C{reactor.spawnProcess}, writes the last
user message to its stdin and closes it, and streams its stdout back as
C{delta} events. The exit status decides the terminal: 0 is C{complete},
anything else C{error} with the tail of stderr, because the end of stderr
is where command-line tools say what went wrong.

The command runs in a process group (and session) of its own, and a run
is over only when that group is: stopping a run is always SIGTERM to the
whole group, then SIGKILL after C{grace_sec}, which gives agents a chance
to save their state and guarantees that the tool and everything it
started are gone even if they ignore SIGTERM. A tool that exits while
processes it started still hold its stdout or stderr (or still run) does
not hold its run for ever: they get C{pipe_grace} seconds, then the group
is killed and the pipes closed.

A stopped run fails at once (its Deferred is cancelled), so the Node
gives its seat to the next run while the group may still be dying. That
run waits for the group (at most C{grace_sec}, or the pipes' grace)
before its own command starts, when it would otherwise be one process
too many, or when it continues the stopped run's session: the tool never
has two processes in one session, nor more than C{max_concurrency}.

With C{sessions: true}, runs that carry a C{session_id} get
C{[session_arg, session_id]} appended to the command line, so that tools
with their own conversation store (C{--session}, C{--resume}) continue the
conversation; the adapter tracks those logical sessions so that one can
be listed and terminated. A session id that starts with C{-} (it would be
read as an option) or holds a control character fails its run with
C{invalid_request} before anything is started.
"""

import codecs
import os
import shutil
import signal
import sys
import unicodedata
from collections.abc import Mapping
from typing import Any, cast, overload
from typing import Protocol as Shape

from twisted.internet import defer
from twisted.internet.error import ProcessExitedAlready
from twisted.internet.interfaces import IDelayedCall, IPushProducer, IReactorTime
from twisted.internet.protocol import ProcessProtocol
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

from iop.adapters.base import AdapterBase, register_output
from iop.adapters.interface import AdapterConfigError, Capabilities, Emit, IAdapter, Progress, RunInput
from iop.run import (
    ADAPTER_STOPPED,
    COMPLETE,
    DELTA,
    ERROR,
    EXIT_STATUS,
    INVALID_REQUEST,
    SESSION_BUSY,
    SESSION_TERMINATED,
    SPAWN_FAILED,
    START,
    TIMEOUT,
    RunEventData,
    RunFailure,
)

#: How much of stderr an C{exit_status} error carries.
STDERR_TAIL = 2048


def _text(content: object) -> str:
    """
    A message's text: a string, or the text parts of OpenAI-style content.
    """
    if isinstance(content, list):
        return "".join(
            part.get("text", "") for part in content if isinstance(part, dict) and part.get("type") == "text"
        )
    return content if isinstance(content, str) else ""


class _ProcessTransport(Shape):
    """
    What a run's process asks of its transport: Twisted's C{Process}, an
    L{IProcessTransport} that also stops and starts reading its pipes
    (which L{IProcessTransport} does not declare).
    """

    pid: int | None

    def write(self, data: bytes) -> None: ...

    def closeStdin(self) -> None: ...

    def closeChildFD(self, descriptor: int) -> None: ...

    def signalProcess(self, signalID: str | int) -> None: ...

    def pauseProducing(self) -> None: ...

    def resumeProducing(self) -> None: ...


#: What the command's process runs first (with the Node's own Python, in
#: isolated mode, without C{site}: about 15 ms): it makes itself the leader
#: of a new session, hence of a new process group (C{os.setsid}), then
#: replaces itself by the command (C{os.execv}: same pid). Twisted's
#: C{spawnProcess} cannot do that itself, and C{setsid(1)} is not on every
#: system. Before the C{exec} it puts back what Python's start changed and
#: the command must not inherit: C{SIGPIPE} and C{SIGXFSZ} ignored, and
#: C{LC_CTYPE} (PEP 538's locale coercion sets it under the C locale;
#: C{argv[1]} is C{"="} and its value as the command is to see it, or empty
#: when it is unset). Should C{setsid} or C{exec} fail, it says why on file
#: descriptor 3 and exits 127 (the run fails C{spawn_failed}); that
#: descriptor is close-on-exec, so the command never sees it. C{argv[2]} is
#: the program, the rest the command's argv.
_LAUNCHER = """\
import os, sys, _signal
try:
    os.set_inheritable(3, False)
    os.setsid()
    _signal.signal(_signal.SIGPIPE, _signal.SIG_DFL)
    _signal.signal(_signal.SIGXFSZ, _signal.SIG_DFL)
    if sys.argv[1]:
        os.environ["LC_CTYPE"] = sys.argv[1][1:]
    else:
        os.environ.pop("LC_CTYPE", None)
    os.execv(sys.argv[2], sys.argv[3:])
except BaseException as e:
    os.write(3, (str(e) or type(e).__name__).encode("utf-8", "backslashreplace"))
    os._exit(127)
"""
#: The launcher's descriptor for a failure to start the command.
_LAUNCH_FD = 3
#: How often a run whose command has exited looks whether what it left in
#: its process group is gone.
_GROUP_POLL_SEC = 0.05


def _launcher_argv(executable: str, argv: list[str], env: Mapping[str, str]) -> list[str]:
    """
    The argument list that runs C{argv} (the program C{executable}) with
    the environment C{env} through L{_LAUNCHER}.
    """
    lc_ctype = "=" + env["LC_CTYPE"] if "LC_CTYPE" in env else ""
    return [sys.executable, "-I", "-S", "-X", "utf8", "-c", _LAUNCHER, lc_ctype, executable, *argv]


def _session_id_problem(session_id: str) -> str | None:
    """
    Why C{session_id} cannot be put on a command line after C{session_arg},
    or C{None} when it can: an id starting with C{-} would be read as an
    option by a tool whose session flag takes an optional value, and a
    control character (NUL included) has no place in an argument.
    """
    if session_id.startswith("-"):
        return "it starts with '-'"
    if any(unicodedata.category(c) == "Cc" for c in session_id):
        return "it contains a control character"
    return None


@implementer(IPushProducer)
class _RunProcess(ProcessProtocol):
    """
    One run's process: feeds stdin, turns stdout into C{delta} events,
    keeps the tail of stderr. It is its stream's producer: while the
    caller is not taking the stream its pipes are not read, so the
    process blocks on a full pipe instead of the Node buffering its output.

    The command leads its own process group (L{_LAUNCHER}), and the run
    is over only once that group is gone or killed: signals go to the
    whole group; once the command itself has exited, what it left gets
    C{pipe_grace} seconds to close the pipes and go, then the group is
    killed and the pipes closed. Only then do L{when_ended}'s waiters fire.

    C{timeout} (seconds, or C{None}) bounds the command itself: it runs
    from the start until the command exits, and not while the caller is
    not taking the stream (the command is blocked on its full pipe then,
    which is the caller's time, not the tool's).

    @ivar outcome: why the adapter stopped it (C{cancelled}, C{timeout},
        C{terminated}, C{stopped}), or C{None}.
    @ivar end: once the run is over, why the command ended
        (C{ProcessDone} or C{ProcessTerminated}), else C{None}.
    @ivar launch_error: why the command could not be started, as the
        launcher said it (empty: it was, or has not been yet).
    """

    log = Logger()

    def __init__(
        self, emit: Emit, stdin: bytes, clock: IReactorTime, grace: float, pipe_grace: float, timeout: float | None
    ) -> None:
        self.emit = emit
        self.stdin = stdin
        self.clock = clock
        self.grace = grace
        self.pipe_grace = pipe_grace
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self.stderr = bytearray()
        self.launch_error = bytearray()
        self.outcome: str | None = None
        self.end: BaseException | None = None
        self._waiters: list[defer.Deferred[BaseException]] = []
        self.pid: int | None = None
        #: Whether the command itself has exited (and been reaped).
        self._exited = False
        #: Once the command has exited and every pipe is closed, why it ended.
        self._closed: BaseException | None = None
        #: Whether its group was seen empty after it exited (never signal
        #: that id again: it could name another group by now), or killed.
        self._group_gone = False
        self._killed = False
        self._paused = False
        self._kill_call: IDelayedCall | None = None
        self._linger_call: IDelayedCall | None = None
        self._poll_call: IDelayedCall | None = None
        self._timeout_call: IDelayedCall | None = None
        #: The rest of C{timeout} while paused (C{None}: not paused, or no
        #: timeout left to run).
        self._timeout_left = timeout

    @property
    def _process(self) -> _ProcessTransport:
        # spawnProcess connects the protocol before it returns, so every
        # use of the transport comes after connectionMade.
        assert self.transport is not None
        return cast(_ProcessTransport, self.transport)

    def connectionMade(self) -> None:
        self.pid = self._process.pid
        self._process.write(self.stdin)
        self._process.closeStdin()
        self._run_timeout()
        register_output(self.emit, self)

    def _run_timeout(self) -> None:
        if self._timeout_left is not None and not self._exited:
            self._timeout_call = self.clock.callLater(self._timeout_left, self.stop, "timeout")
        self._timeout_left = None

    def _hold_timeout(self) -> None:
        call, self._timeout_call = self._timeout_call, None
        if call is not None and call.active():
            self._timeout_left = max(0.0, call.getTime() - self.clock.seconds())
            call.cancel()

    def pauseProducing(self) -> None:
        self._paused = True
        self._hold_timeout()
        self._process.pauseProducing()

    def resumeProducing(self) -> None:
        self._paused = False
        self._run_timeout()
        self._process.resumeProducing()
        if self._linger_call is not None and self._linger_call.active():
            # What the command wrote while the caller was not taking it
            # gets the whole grace to be read.
            self._linger_call.reset(self.pipe_grace)

    def stopProducing(self) -> None:
        # The run is stopped through its Deferred (SIGTERM, then SIGKILL);
        # here, only stop holding its output back.
        self.resumeProducing()

    def childDataReceived(self, childFD: int, data: bytes) -> None:
        if childFD == _LAUNCH_FD:
            self.launch_error.extend(data)
        else:
            super().childDataReceived(childFD, data)

    def outReceived(self, data: bytes) -> None:
        self._delta(self.decoder.decode(data))

    def errReceived(self, data: bytes) -> None:
        self.stderr.extend(data)
        del self.stderr[:-STDERR_TAIL]

    def _delta(self, text: str) -> None:
        # Once the adapter stopped the run, nothing more is its output.
        if text and self.outcome is None:
            self.emit(RunEventData(DELTA, text=text))

    def stop(self, outcome: str) -> None:
        """
        SIGTERM to the process group now, SIGKILL after C{grace} seconds
        if any of it is still there. Only the first request counts: a run
        is stopped once, for one reason.
        """
        if self.outcome is not None or self.end is not None:
            return
        self.outcome = outcome
        self._signal(signal.SIGTERM)
        self._kill_call = self.clock.callLater(self.grace, self._kill)
        if self._exited:
            # Only what the command left is still there; its output is
            # not wanted any more.
            self._close_pipes()

    def _signal(self, number: int) -> bool:
        """
        Send signal C{number} to the process group (0: only look whether
        it has a member left).

        @return: whether it reached a process.
        """
        if self._group_gone or self.pid is None:
            return False
        try:
            os.killpg(self.pid, number)
        except ProcessLookupError:
            if self._exited:
                self._group_gone = True
                return False
            # Alive but no group yet: the launcher has not made it.
            try:
                self._process.signalProcess(number)
            except (ProcessExitedAlready, OSError):
                return False
        except OSError:
            return False
        return True

    def _kill(self) -> None:
        """
        SIGKILL the process group and close the pipes: whatever holds them
        now, the run does not wait for it any more.
        """
        self._signal(signal.SIGKILL)
        self._killed = True
        self._close_pipes()
        self._check()

    def _close_pipes(self) -> None:
        for fd in (0, 1, 2, _LAUNCH_FD):
            self._process.closeChildFD(fd)

    def processExited(self, reason: Failure) -> None:
        self._exited = True
        # The command ended in time: what it left is bounded by the
        # pipes' grace, not by timeout_sec.
        self._hold_timeout()
        self._timeout_left = None
        if self.outcome is not None:
            # Children of a stopped process may hold its pipes open; we
            # are not waiting for their output. What is left of its group
            # had the SIGTERM too, and the SIGKILL is still to come.
            self._close_pipes()
        else:
            self._linger_call = self.clock.callLater(self.pipe_grace, self._lingered)

    def _lingered(self) -> None:
        """
        The command exited C{pipe_grace} seconds ago and the run is still
        not over: something it started holds the pipes or lives on.
        """
        self._linger_call = None
        if self._closed is None and self._paused:
            # Not leftovers, perhaps: the caller is not taking the output,
            # so the end of the pipes has not been read. Look again later.
            self._linger_call = self.clock.callLater(self.pipe_grace, self._lingered)
            return
        self.log.info(
            "pid {pid} exited {grace} s ago leaving processes that {what}; killing its process group",
            pid=self.pid,
            grace=self.pipe_grace,
            what="hold its output open" if self._closed is None else "still run",
        )
        self._kill()

    def processEnded(self, reason: Failure) -> None:
        self._delta(self.decoder.decode(b"", final=True))
        # The exception, not the Failure: a Failure would run errbacks.
        # Twisted ends a process with ProcessDone or ProcessTerminated.
        end = reason.value
        assert end is not None
        self._closed = end
        self._check()

    def _check(self) -> None:
        """
        End the run if it is over: the command exited, its pipes are
        closed and its process group is gone (or was killed); else, once
        the rest is, look again soon.
        """
        if self.end is not None or self._closed is None:
            return
        if not self._killed and self._signal(0):
            if self._poll_call is None or not self._poll_call.active():
                self._poll_call = self.clock.callLater(_GROUP_POLL_SEC, self._check)
            return
        for call in (self._kill_call, self._linger_call, self._poll_call, self._timeout_call):
            if call is not None and call.active():
                call.cancel()
        self.end = self._closed
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            waiter.callback(self.end)

    def when_ended(self) -> "defer.Deferred[BaseException]":
        """
        A new Deferred firing with the command's end reason
        (C{ProcessDone} or C{ProcessTerminated}) once the run is over: the
        command gone, its pipes closed, its process group gone or killed.
        Waiters fire in the order they asked; cancelling one only stops it
        waiting.
        """
        if self.end is not None:
            return defer.succeed(self.end)

        def forget(waiter: "defer.Deferred[BaseException]") -> None:
            if waiter in self._waiters:
                self._waiters.remove(waiter)

        waiter: defer.Deferred[BaseException] = defer.Deferred(forget)
        self._waiters.append(waiter)
        return waiter


class _Session:
    """
    A logical session: what C{session_list} shows.
    """

    def __init__(self, session_id: str, target: str, now: float) -> None:
        self.session_id = session_id
        self.target = target
        self.created_at = now
        self.runs = 0
        self.last_run_at: float | None = None
        self.process: _RunProcess | None = None

    def describe(self) -> dict[str, Any]:
        return {
            "session_id": self.session_id,
            "target": self.target,
            "created_at": self.created_at,
            "runs": self.runs,
            "last_run_at": self.last_run_at,
            "running": self.process is not None,
            "pid": self.process.pid if self.process is not None else None,
        }


@implementer(IAdapter)
class CLIAdapter(AdapterBase):
    """
    Options: C{command} (argument list, required), C{env} (mapping merged
    over the Node's environment), C{cwd}, C{timeout_sec}, C{grace_sec}
    (default 2), C{sessions} (default false), C{session_arg} (default
    C{--session}).

    @ivar running: run id -> its process, while it lives.
    """

    type = "cli"
    OPTIONS = AdapterBase.OPTIONS | {"command", "env", "cwd", "timeout_sec", "grace_sec", "sessions", "session_arg"}
    log = Logger()
    #: How long the pipes of a run whose command exited may stay open (and
    #: what it started may live on) before its process group is killed:
    #: not an option, only tests change it.
    pipe_grace = 2.0

    def __init__(self, name: str, max_concurrency: int, options: dict[str, Any] | None, reactor: Any) -> None:
        super().__init__(name, max_concurrency, options, reactor)
        command = self.option("command", kind=list, required=True)
        if not command or not all(isinstance(arg, str) for arg in command):
            raise AdapterConfigError(name, "command", "must be a non-empty list of strings")
        self.argv: list[str] = list(command)
        env = self.option("env", {}, dict)
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
            raise AdapterConfigError(name, "env", "must map strings to strings")
        self.env = dict(env)
        self.cwd = self.option("cwd", None, str)
        self.timeout = self._seconds("timeout_sec", None)
        self.grace = self._seconds("grace_sec", 2, allow_zero=True)
        self.sessions_enabled = self.option("sessions", False, bool)
        self.session_arg = self.option("session_arg", "--session", str)
        self.sessions: dict[str, _Session] = {}
        self.running: dict[str, _RunProcess] = {}
        #: Set by L{stop}: a run still waiting for a seat starts nothing.
        self.stopped = False

    @overload
    def _seconds(self, key: str, default: float, allow_zero: bool = False) -> float: ...

    @overload
    def _seconds(self, key: str, default: None, allow_zero: bool = False) -> float | None: ...

    def _seconds(self, key: str, default: float | None, allow_zero: bool = False) -> float | None:
        value: float | None = self.option(key, default, (int, float))
        if value is None:
            return None
        if isinstance(value, bool) or value < 0 or (value == 0 and not allow_zero):
            raise AdapterConfigError(self.name, key, "must be a positive number")
        return value

    def start(self) -> "defer.Deferred[None]":
        """
        Refuse to start (so the configuration that names it is refused,
        at registration or on a refresh) when the command cannot be found
        or run here; a command removed later still fails its runs with
        C{spawn_failed}.
        """
        if self._executable(dict(os.environ, **self.env)) is None:
            raise AdapterConfigError(
                self.name, "command", f"names {self.argv[0]!r}, which is not an executable program on this node"
            )
        return defer.succeed(None)

    def _executable(self, env: Mapping[str, str]) -> str | None:
        """
        The program C{argv[0]} names (a path, relative to C{cwd}, or looked
        up on the C{PATH} of C{env}), or C{None}.
        """
        program = self.argv[0]
        if os.sep not in program:
            return shutil.which(program, path=env.get("PATH"))
        path = os.path.join(self.cwd or os.curdir, program)
        return program if os.path.isfile(path) and os.access(path, os.X_OK) else None

    def capabilities(self) -> Capabilities:
        if self.sessions_enabled:
            return Capabilities(max_concurrency=self.max_concurrency, sessions=True, commands=("session_list",))
        return Capabilities(max_concurrency=self.max_concurrency)

    def stop(self) -> "defer.Deferred[None]":
        """
        Stop every process still running; fires once they are all gone.
        """
        self.stopped = True
        processes = list(self.running.values())
        for process in processes:
            process.stop("stopped")
        return defer.DeferredList([p.when_ended() for p in processes]).addCallback(lambda _: None)

    def _argv(self, run: RunInput) -> list[str]:
        argv = list(self.argv)
        if self.sessions_enabled and run.session_id:
            argv += [self.session_arg, run.session_id]
        return argv

    def execute(self, run: RunInput, emit: Emit) -> "defer.Deferred[None]":
        """
        Run the command once for C{run}.

        @return: a Deferred firing after the terminal event. Cancelling it
            fails it with C{CancelledError} at once and stops the process
            group (SIGTERM, then SIGKILL after C{grace_sec}); while the run
            waits for a stopped run's group (L{_after}), nothing starts.
        """
        if self.stopped:
            emit(_error(ADAPTER_STOPPED, f"adapter {self.name} was stopped"))
            return defer.succeed(None)
        session = None
        if self.sessions_enabled and run.session_id:
            problem = _session_id_problem(run.session_id)
            if problem is not None:
                message = f"session id {run.session_id!r} refused: {problem} (it goes after {self.session_arg})"
                emit(_error(INVALID_REQUEST, message))
                return defer.succeed(None)
            session = self.sessions.get(run.session_id)
            if session is not None and session.process is not None:
                if session.process.outcome is not None:
                    return self._after(session.process, run, emit)
                emit(_error(SESSION_BUSY, f"session {run.session_id} already has a run in progress"))
                return defer.succeed(None)
        leaving = self._leaving_seat()
        if leaving is not None:
            return self._after(leaving, run, emit)
        env = dict(os.environ, **self.env)
        argv = self._argv(run)
        executable = self._executable(env)
        if executable is None:
            emit(_error(SPAWN_FAILED, f"command not found: {argv[0]}"))
            return defer.succeed(None)
        if any("\0" in text for text in (*argv, *env, *env.values())):
            # The launcher (on Twisted's fork path) would only exit 1 with a traceback.
            emit(_error(SPAWN_FAILED, f"cannot start {argv[0]}: a NUL in its arguments or environment"))
            return defer.succeed(None)
        process = _RunProcess(
            emit, _text(run.last_user_text()).encode("utf-8"), self.reactor, self.grace, self.pipe_grace, self.timeout
        )
        try:
            self.reactor.spawnProcess(
                process,
                sys.executable,
                _launcher_argv(executable, argv, env),
                env=env,
                path=self.cwd,
                childFDs={0: "w", 1: "r", 2: "r", _LAUNCH_FD: "r"},
            )
        except (OSError, ValueError) as e:
            # ValueError: an argument or variable that cannot be encoded.
            emit(_error(SPAWN_FAILED, f"cannot start {argv[0]}: {e}"))
            return defer.succeed(None)
        self.log.debug(
            "adapter {adapter} run {run_id} started pid {pid}", adapter=self.name, run_id=run.run_id, pid=process.pid
        )
        self.running[run.run_id] = process
        if self.sessions_enabled and run.session_id:
            if session is None:
                session = self.sessions[run.session_id] = _Session(run.session_id, run.target, self.reactor.seconds())
            session.runs += 1
            session.last_run_at = self.reactor.seconds()
            session.process = process
        emit(RunEventData(START))

        result: defer.Deferred[None] = defer.Deferred(lambda d: process.stop("cancelled"))

        def ended(reason: BaseException) -> None:
            self.running.pop(run.run_id, None)
            if session is not None and session.process is process:
                session.process = None
            if not result.called:
                emit(self._terminal(process, reason))
                result.callback(None)

        process.when_ended().addCallback(ended)
        return result

    def _leaving_seat(self) -> "_RunProcess | None":
        """
        When every seat is held, one held by a run the adapter stopped
        whose process group is still going (the Node gave that seat away
        at the stop); else C{None}.
        """
        if len(self.running) < self.max_concurrency:
            return None
        return next((p for p in self.running.values() if p.outcome is not None), None)

    def _after(self, leaving: "_RunProcess", run: RunInput, emit: Emit) -> "defer.Deferred[None]":
        """
        C{run}, once the stopped run's process group C{leaving} is gone
        (everything is checked again then). Cancelling the wait starts
        nothing.
        """
        self.log.debug(
            "adapter {adapter} run {run_id} waits for stopped pid {pid} to go",
            adapter=self.name,
            run_id=run.run_id,
            pid=leaving.pid,
        )
        return leaving.when_ended().addCallback(lambda _: self.execute(run, emit))

    def _terminal(self, process: _RunProcess, end: BaseException) -> RunEventData:
        if process.outcome == "timeout":
            return _error(TIMEOUT, f"killed after timeout_sec={self.timeout}")
        if process.outcome == "terminated":
            return _error(SESSION_TERMINATED, "the run's session was terminated")
        if process.outcome == "stopped":
            return _error(ADAPTER_STOPPED, f"adapter {self.name} was stopped")
        if process.launch_error:
            message = bytes(process.launch_error).decode("utf-8", "replace")
            return _error(SPAWN_FAILED, f"cannot start {self.argv[0]}: {message}")
        code: int | None = getattr(end, "exitCode", None)
        sig: int | None = getattr(end, "signal", None)
        if code == 0:
            return RunEventData(COMPLETE)
        tail = bytes(process.stderr).decode("utf-8", "replace").strip()
        if code is None:
            what, status = f"killed by signal {_signal_name(sig)}", -(sig or 0)
        else:
            what, status = f"exit status {code}", code
        return _error(EXIT_STATUS, f"{what}: {tail}" if tail else what, status)

    def terminate_session(self, target: str, session_id: str) -> "defer.Deferred[dict[str, bool]]":
        """
        Forget the session, stopping its running process first. The
        session stays known (listed as running) until that process is
        gone, so that a run continuing it meanwhile waits for the process
        (L{_after}) instead of starting beside it.

        @return: a Deferred firing with C{{"terminated": bool}} (whether
            the session existed) once its process is gone.
        """
        if not self.sessions_enabled:
            return super().terminate_session(target, session_id)
        session = self.sessions.get(session_id)
        if session is None:
            return defer.succeed({"terminated": False})
        self.log.info("adapter {adapter} terminating session {session_id}", adapter=self.name, session_id=session_id)

        def forget(_: object = None) -> dict[str, bool]:
            if self.sessions.get(session_id) is session:
                if session.process is None:
                    del self.sessions[session_id]
                else:
                    # A run that was waiting for the stopped process to
                    # continue the session started once it was gone: the
                    # session is that run's now, as a new one, and stays
                    # known (listed, terminable, busy for another run).
                    session.runs, session.created_at = 1, session.last_run_at or self.reactor.seconds()
            return {"terminated": True}

        if session.process is None:
            return defer.succeed(forget())
        process = session.process
        process.stop("terminated")
        return process.when_ended().addCallback(forget)

    def command(self, name: str, args: dict[str, Any], progress: Progress | None = None) -> "defer.Deferred[Any]":
        if name == "session_list" and self.sessions_enabled:
            return defer.succeed([s.describe() for s in self.sessions.values()])
        return super().command(name, args)


def _signal_name(number: int | None) -> str:
    """
    C{SIGTERM} for 15; the number as is when it names no signal (or when
    the end reason carried none).
    """
    if number is not None:
        try:
            return signal.Signals(number).name
        except ValueError:
            pass
    return str(number)


def _error(code: str, message: str, status: int = 0) -> RunEventData:
    return RunEventData(ERROR, error=RunFailure(code=code, message=message, status=status))
