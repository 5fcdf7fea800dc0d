"""
What a process has spent, read from C{/proc}: CPU time (user + system,
every thread included, reaped ones too) and memory (resident now, and its
peak).

The benchmarks read these for the C{twistd} processes of the Edge and the
Node before and after each scenario, so each daemon's cost is measured
apart, from outside, without a profiler's own overhead.
"""

import os
import resource

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
