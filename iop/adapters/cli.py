"""
The C{cli} back end: a local command-line program as a model.

Each run spawns C{command} with C{reactor.spawnProcess}, writes the last
user message to its stdin and closes it, and streams its stdout back as
C{delta} events. The exit status decides the terminal: 0 is C{complete},
anything else C{error} with the tail of stderr, because the end of stderr
is where command-line tools say what went wrong.

Stopping a process is always SIGTERM, then SIGKILL after C{grace_sec}:
that gives agents a chance to save their state, and guarantees the
process is gone even if it ignores SIGTERM.

With C{sessions: true}, runs that carry a C{session_id} get
C{[session_arg, session_id]} appended to the command line, so that tools
with their own conversation store (C{--session}, C{--resume}) continue the
conversation; the adapter tracks those logical sessions so that one can
be listed and terminated.
"""

import codecs
import os
import shutil
import signal
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

    def signalProcess(self, signalID: str | int) -> None: ...

    def loseConnection(self) -> None: ...

    def pauseProducing(self) -> None: ...

    def resumeProducing(self) -> None: ...


@implementer(IPushProducer)
class _RunProcess(ProcessProtocol):
    """
    One run's process: feeds stdin, turns stdout into C{delta} events,
    keeps the tail of stderr. It is its stream's producer: while the
    caller is not taking the stream its pipes are not read, so the
    process blocks on a full pipe instead of the Node buffering its output.

    @ivar outcome: why the adapter stopped it (C{cancelled}, C{timeout},
        C{terminated}, C{stopped}), or C{None}.
    @ivar end: once the process is gone, why (C{ProcessDone} or
        C{ProcessTerminated}), else C{None}.
    """

    def __init__(self, emit: Emit, stdin: bytes) -> None:
        self.emit = emit
        self.stdin = stdin
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self.stderr = bytearray()
        self.outcome: str | None = None
        self.end: BaseException | None = None
        self._waiters: list[defer.Deferred[BaseException]] = []
        self.pid: int | None = None
        self._kill_call: IDelayedCall | None = None

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
        register_output(self.emit, self)

    def pauseProducing(self) -> None:
        self._process.pauseProducing()

    def resumeProducing(self) -> None:
        self._process.resumeProducing()

    def stopProducing(self) -> None:
        # The run is stopped through its Deferred (SIGTERM, then SIGKILL);
        # here, only stop holding its output back.
        self._process.resumeProducing()

    def outReceived(self, data: bytes) -> None:
        self._delta(self.decoder.decode(data))

    def errReceived(self, data: bytes) -> None:
        self.stderr.extend(data)
        del self.stderr[:-STDERR_TAIL]

    def _delta(self, text: str) -> None:
        # Once the adapter stopped the run, nothing more is its output.
        if text and self.outcome is None:
            self.emit(RunEventData(DELTA, text=text))

    def stop(self, outcome: str, reactor: IReactorTime, grace: float) -> None:
        """
        SIGTERM now, SIGKILL after C{grace} seconds if still alive. Only
        the first request counts: a process is stopped once, for one reason.
        """
        if self.outcome is not None:
            return
        self.outcome = outcome
        if self._signal("TERM"):
            self._kill_call = reactor.callLater(grace, self._signal, "KILL")

    def _signal(self, name: str) -> bool:
        try:
            self._process.signalProcess(name)
        except (ProcessExitedAlready, OSError):
            return False
        return True

    def processExited(self, reason: Failure) -> None:
        if self._kill_call is not None and self._kill_call.active():
            self._kill_call.cancel()
        if self.outcome is not None:
            # Children of a stopped process may hold its pipes open; we
            # are not waiting for their output.
            self._process.loseConnection()

    def processEnded(self, reason: Failure) -> None:
        self._delta(self.decoder.decode(b"", final=True))
        # The exception, not the Failure: a Failure would run errbacks.
        # Twisted ends a process with ProcessDone or ProcessTerminated.
        end = reason.value
        assert end is not None
        self.end = end
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            waiter.callback(end)

    def when_ended(self) -> "defer.Deferred[BaseException]":
        """
        A new Deferred firing with the end reason (C{ProcessDone} or
        C{ProcessTerminated}) once the process is gone and its pipes are
        closed; waiters fire in the order they asked.
        """
        if self.end is not None:
            return defer.succeed(self.end)
        waiter: defer.Deferred[BaseException] = defer.Deferred()
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
    log = Logger()

    def __init__(self, name: str, max_concurrency: int, options: dict[str, Any] | None, reactor: Any) -> None:
        super().__init__(name, max_concurrency, options, reactor)
        command = self.option("command", kind=list, required=True)
        if not command or not all(isinstance(arg, str) for arg in command):
            raise AdapterConfigError(f"adapters[{name}].command must be a non-empty list of strings")
        self.argv: list[str] = list(command)
        env = self.option("env", {}, dict)
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
            raise AdapterConfigError(f"adapters[{name}].env must map strings to strings")
        self.env = dict(env)
        self.cwd = self.option("cwd", None, str)
        self.timeout = self._seconds("timeout_sec", None)
        self.grace = self._seconds("grace_sec", 2, allow_zero=True)
        self.sessions_enabled = self.option("sessions", False, bool)
        self.session_arg = self.option("session_arg", "--session", str)
        self.sessions: dict[str, _Session] = {}
        self.running: dict[str, _RunProcess] = {}

    @overload
    def _seconds(self, key: str, default: float, allow_zero: bool = False) -> float: ...

    @overload
    def _seconds(self, key: str, default: None, allow_zero: bool = False) -> float | None: ...

    def _seconds(self, key: str, default: float | None, allow_zero: bool = False) -> float | None:
        value: float | None = self.option(key, default, (int, float))
        if value is None:
            return None
        if isinstance(value, bool) or value < 0 or (value == 0 and not allow_zero):
            raise AdapterConfigError(f"adapters[{self.name}].{key} must be a positive number")
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
                f"adapters[{self.name}].command: {self.argv[0]!r} is not an executable program on this node"
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
        processes = list(self.running.values())
        for process in processes:
            process.stop("stopped", self.reactor, self.grace)
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
            (SIGTERM, then SIGKILL after C{grace_sec}).
        """
        session = None
        if self.sessions_enabled and run.session_id:
            session = self.sessions.get(run.session_id)
            if session is not None and session.process is not None:
                emit(_error(SESSION_BUSY, f"session {run.session_id} already has a run in progress"))
                return defer.succeed(None)
        env = dict(os.environ, **self.env)
        argv = self._argv(run)
        executable = self._executable(env)
        if executable is None:
            emit(_error(SPAWN_FAILED, f"command not found: {argv[0]}"))
            return defer.succeed(None)
        process = _RunProcess(emit, _text(run.last_user_text()).encode("utf-8"))
        try:
            self.reactor.spawnProcess(process, executable, argv, env=env, path=self.cwd)
        except OSError as e:
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

        result: defer.Deferred[None] = defer.Deferred(lambda d: process.stop("cancelled", self.reactor, self.grace))
        timer = None
        if self.timeout:
            timer = self.reactor.callLater(self.timeout, process.stop, "timeout", self.reactor, self.grace)

        def ended(reason: BaseException) -> None:
            if timer is not None and timer.active():
                timer.cancel()
            self.running.pop(run.run_id, None)
            if session is not None and session.process is process:
                session.process = None
            if not result.called:
                emit(self._terminal(process, reason))
                result.callback(None)

        process.when_ended().addCallback(ended)
        return result

    def _terminal(self, process: _RunProcess, end: BaseException) -> RunEventData:
        if process.outcome == "timeout":
            return _error(TIMEOUT, f"killed after timeout_sec={self.timeout}")
        if process.outcome == "terminated":
            return _error(SESSION_TERMINATED, "the run's session was terminated")
        if process.outcome == "stopped":
            return _error(ADAPTER_STOPPED, f"adapter {self.name} was stopped")
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
        Forget the session, stopping its running process first.

        @return: a Deferred firing with C{{"terminated": bool}} (whether
            the session existed) once its process is gone.
        """
        if not self.sessions_enabled:
            return super().terminate_session(target, session_id)
        session = self.sessions.pop(session_id, None)
        if session is None:
            return defer.succeed({"terminated": False})
        self.log.info("adapter {adapter} terminating session {session_id}", adapter=self.name, session_id=session_id)
        if session.process is None:
            return defer.succeed({"terminated": True})
        process = session.process
        process.stop("terminated", self.reactor, self.grace)
        return process.when_ended().addCallback(lambda _: {"terminated": True})

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
