"""
Loaded by Python at start-up in the daemons a benchmark launches (the
bench puts this directory on C{PYTHONPATH} and names a log directory in
C{IOP_BENCH_GC_LOG}): logs every pass of the cyclic garbage collector over
the oldest generation, and any pass longer than 5 ms, to
C{$IOP_BENCH_GC_LOG/<pid>.log}, one line each:

    <unix time> <generation> <wall ms> <thread CPU ms> <objects collected>

Why: a long gap in a stream can be the collector stopping the reactor, not
the code on the path; this tells the two apart from outside, without a
change to iop. The cost is two calls per collection. Without the
environment variable it does nothing.
"""

import gc
import os
import time

_DIR = os.environ.get("IOP_BENCH_GC_LOG")

if _DIR:
    _started = [0.0, 0.0]
    _path = os.path.join(_DIR, f"{os.getpid()}.log")

    def _watch(phase, info):
        if phase == "start":
            _started[0] = time.perf_counter()
            _started[1] = time.thread_time()
            return
        wall = time.perf_counter() - _started[0]
        if info["generation"] == 2 or wall > 0.005:
            cpu = time.thread_time() - _started[1]
            with open(_path, "a") as f:
                f.write(
                    f"{time.time():.3f} {info['generation']} {wall * 1000:.2f} {cpu * 1000:.2f} {info['collected']}\n"
                )

    gc.callbacks.append(_watch)
