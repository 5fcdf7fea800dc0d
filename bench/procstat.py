"""
What a process has spent, read from C{/proc}: CPU time (user + system,
every thread included, reaped ones too) and memory (resident now, and its
peak).

The benchmarks read these for the C{twistd} processes of the Edge and the
Node before and after each scenario, so each daemon's cost is measured
apart, from outside, without a profiler's own overhead.
"""

import contextlib
import os
import resource
import shutil
import sys
import time

_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid):
    """
    User + system CPU seconds of process C{pid} so far (C{/proc/<pid>/stat},
    fields 14 and 15, in clock ticks: 10 ms on most kernels, so a scenario
    should spend well over that for the figure to mean anything).
    """
    with open(f"/proc/{pid}/stat", "rb") as f:
        data = f.read()
    # The command name (field 2) may hold spaces: split after its ")".
    fields = data[data.rindex(b")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


def memory(pid):
    """
    C{(rss, peak_rss)} of process C{pid}, in bytes (C{VmRSS}, C{VmHWM}).
    """
    values = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                name, amount, _unit = line.split()
                values[name] = int(amount) * 1024
    return values.get("VmRSS:", 0), values.get("VmHWM:", 0)


def raise_open_files():
    """
    Lift this process's soft limit on open files to its hard limit: a
    thousand concurrent streams need a few thousand descriptors in the
    caller and in every daemon, and daemons started from here inherit it.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


class Meter:
    """
    CPU spent by a set of named processes between L{start} and L{stop}.

    @ivar pids: name -> pid; C{None} as a pid means this process.
    """

    def __init__(self, pids):
        self.pids = dict(pids)
        self._before = {}
        self.spent = {}

    def _read(self):
        return {
            name: (os.times().user + os.times().system) if pid is None else cpu_seconds(pid)
            for name, pid in self.pids.items()
        }

    def start(self):
        self._before = self._read()
        return self

    def stop(self):
        after = self._read()
        self.spent = {name: after[name] - self._before[name] for name in after}
        return self.spent


def settle(pids, window=0.1, quiet=0.015, limit=15.0):
    """
    Wait until the processes C{pids} are quiet: none spent more than
    C{quiet} CPU seconds (one clock tick) in a C{window}. Bounded by
    C{limit}. @return: how long they kept working, in seconds (0 when
    the first window was already quiet).
    """
    start = time.monotonic()
    last = [cpu_seconds(pid) for pid in pids]
    while time.monotonic() - start < limit:
        time.sleep(window)  # a measurement window, not a synchronisation
        now = [cpu_seconds(pid) for pid in pids]
        if all(b - a <= quiet for a, b in zip(last, now, strict=True)):
            return max(time.monotonic() - start - window, 0.0)
        last = now
    return limit


def keep_on_failure(workdir):
    """
    From a C{finally}: remove a bench's working directory (configs, daemon
    logs, run stores) after a run that went through; keep it, and say
    where, when an exception is on its way out.
    """
    if sys.exc_info()[0] is None:
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        sys.stderr.write(f"bench: daemon logs kept in {workdir}\n")


GC_WATCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gcwatch")


@contextlib.contextmanager
def gc_watched(directory):
    """
    Within this context, every Python process started has its long
    garbage collections logged into C{directory} (L{gcwatch/sitecustomize.py}
    reads the environment at start-up, so start the daemons inside it).
    """
    os.makedirs(directory, exist_ok=True)
    saved = {name: os.environ.get(name) for name in ("IOP_BENCH_GC_LOG", "PYTHONPATH")}
    os.environ["IOP_BENCH_GC_LOG"] = directory
    os.environ["PYTHONPATH"] = GC_WATCH + (os.pathsep + saved["PYTHONPATH"] if saved["PYTHONPATH"] else "")
    try:
        yield directory
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def gc_passes(directory, pid, since, until):
    """
    The collections process C{pid} logged between the Unix times C{since}
    and C{until}: C{(generation, wall seconds, CPU seconds, collected)}.
    """
    passes = []
    try:
        with open(os.path.join(directory, f"{pid}.log")) as f:
            for line in f:
                at, generation, wall, cpu, collected = line.split()
                if since <= float(at) <= until:
                    passes.append((int(generation), float(wall) / 1000, float(cpu) / 1000, int(collected)))
    except OSError:
        pass
    return passes


def gc_summary(passes):
    """
    C{(longest pass in wall seconds, CPU seconds of all logged passes,
    number of full collections)}.
    """
    return (
        max((wall for _, wall, _, _ in passes), default=0.0),
        sum(cpu for _, _, cpu, _ in passes),
        sum(1 for generation, _, _, _ in passes if generation == 2),
    )


def listen_overflows():
    """
    The kernel's count of connections dropped because a listen queue was
    full (C{ListenOverflows} in C{/proc/net/netstat}; this network
    namespace, every process in it). A burst of connections beyond a
    listener's backlog waits for TCP retransmits (a second or more)
    instead of failing: the count says when first-byte latency is that.
    """
    try:
        with open("/proc/net/netstat") as f:
            lines = f.read().splitlines()
    except OSError:
        return 0
    for names, values in zip(lines[::2], lines[1::2], strict=False):
        if names.startswith("TcpExt:"):
            return int(dict(zip(names.split()[1:], values.split()[1:], strict=True)).get("ListenOverflows", 0))
    return 0
