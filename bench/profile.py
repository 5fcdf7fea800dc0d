"""
Where the relay's CPU goes: py-spy on the running Edge and Node while one
path of L{relay} serves one scenario over and over.

    .venv/bin/python bench/profile.py --path tunnel --concurrency 50 --requests 400 --seconds 20 --out /tmp/prof

Writes C{edge.txt} and C{node.txt} (py-spy's raw stacks, one line per
stack with its sample count) and prints each daemon's hottest functions,
by own samples and by samples below them (the reactor's frames, below
nearly every sample, left out). Needs C{py-spy}
(C{pip install py-spy}) and the right to trace a child process.

With C{--cprofile} the daemons run under twistd's cProfile instead
(C{--profile ... --profiler cprofile}): exact call counts and CPU per
function for the whole run, at the cost of slowing every call down (so
read it for where the calls go, and py-spy for how long they take). The
statistics are written to C{iop-edge-0.prof} and C{iop-node-0.prof} in
C{--out} when the daemons stop, and their top functions printed.
"""

import argparse
import collections
import os
import pstats
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import loadgen  # noqa: E402
import procstat  # noqa: E402
import relay  # noqa: E402

#: py-spy as installed beside this Python (a virtualenv's bin), else on PATH.
PY_SPY = shutil.which("py-spy", path=os.path.dirname(sys.executable)) or "py-spy"


def hottest(collapsed_path, top):
    """
    The C{top} functions by own samples and by inclusive samples, from a
    collapsed-stack file.
    """
    own = collections.Counter()
    inclusive = collections.Counter()
    total = 0
    with open(collapsed_path) as lines:
        for line in lines:
            stack, _, count = line.rstrip().rpartition(" ")
            samples = int(count)
            total += samples
            # Per function, not per line: "name (file:line)" -> "name (file)".
            frames = [frame.rsplit(":", 1)[0] + ")" if frame.endswith(")") else frame for frame in stack.split(";")]
            own[frames[-1]] += samples
            for frame in set(frames):
                inclusive[frame] += samples
    # The frames of the process's top (twistd, the reactor's loop) are
    # below nearly every sample: left out.
    ranked = inclusive.most_common()
    most = ranked[0][1] if ranked else 0
    below = [(frame, samples) for frame, samples in ranked if samples < 0.9 * most]
    return total, own.most_common(top), below[:top]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--path", default="tunnel", choices=[p.name for p in relay.PATHS if p.edge])
    parser.add_argument("--concurrency", type=int, default=50)
    parser.add_argument("--requests", type=int, default=400, help="requests per round")
    parser.add_argument("--words", type=int, default=relay.WORDS, help="chunks per stream")
    parser.add_argument("--paced", action="store_true", help="the provider's 5 ms per event")
    parser.add_argument("--seconds", type=float, default=20.0, help="how long to sample")
    parser.add_argument("--rate", type=int, default=250, help="samples per second")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--out", default=None, help="directory for the collapsed stacks")
    parser.add_argument("--cprofile", action="store_true", help="twistd's cProfile instead of py-spy")
    args = parser.parse_args()
    out = args.out or tempfile.mkdtemp(prefix="iop-profile-")
    os.makedirs(out, exist_ok=True)
    if args.cprofile:
        os.environ["IOP_TWISTD_PROFILE_DIR"] = out
    procstat.raise_open_files()
    workdir = tempfile.mkdtemp(prefix="iop-bench-profile-")
    launcher, providers, ports, pids = relay.start(workdir)
    spies = []
    try:
        path = next(p for p in relay.PATHS if p.name == args.path)
        scenario = relay.Scenario("profile", args.concurrency, args.requests, words=args.words, paced=args.paced)
        port, request = path.target(ports, scenario)
        loadgen.run_load(port, [request] * 16, 4, path.separator)  # warm up
        if not args.cprofile:  # (cProfile runs inside the daemons already)
            for name in ("edge", "node"):
                command = [PY_SPY, "record", "--pid", str(pids[name]), "--rate", str(args.rate)]
                command += ["--duration", str(int(args.seconds)), "--format", "raw", "--nonblocking"]
                command += ["--output", os.path.join(out, f"{name}.txt")]
                spies.append(subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        deadline = time.monotonic() + args.seconds
        rounds = 0
        while time.monotonic() < deadline:
            loadgen.run_load(port, [request] * scenario.requests, scenario.concurrency, path.separator)
            rounds += 1
        for spy in spies:
            spy.wait(timeout=args.seconds + 30)
    finally:
        for spy in spies:
            if spy.poll() is None:
                spy.kill()
        launcher.stop_all()
        for provider in providers.values():
            provider.stop()
        procstat.keep_on_failure(workdir)
    print(f"{rounds} rounds of {args.requests} requests; profiles in {out}")
    if args.cprofile:
        for name in ("edge", "node"):
            print(f"\n{name}:")
            pstats.Stats(os.path.join(out, f"iop-{name}-0.prof")).sort_stats("tottime").print_stats(args.top)
        return
    for name in ("edge", "node"):
        total, own, inclusive = hottest(os.path.join(out, f"{name}.txt"), args.top)
        if not total:
            print(f"\n{name}: no samples (is py-spy allowed to trace it?)")
            continue
        print(f"\n{name}: {total} samples\n  own:")
        for frame, samples in own:
            print(f"  {100 * samples / total:5.1f}%  {frame}")
        print("  inclusive:")
        for frame, samples in inclusive:
            print(f"  {100 * samples / total:5.1f}%  {frame}")


if __name__ == "__main__":
    main()
