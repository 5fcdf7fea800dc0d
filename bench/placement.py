"""
Placement cost in a large model group: the Edge's own L{ProviderPool}, in
this process (no daemons), on a L{Clock}.

One group of N members (1,000 by default), every member's Node ready. It
times, per call:

  - C{fill}: acquiring leases until the group is nearly full (90%), the
    loads changing under the index as it goes;
  - C{steady}: at that load, releasing a random lease and acquiring
    another, many times (the shape of a busy Edge);
  - C{release}: giving every lease back.

An acquire that finds room fires its Deferred at once, so what is timed is
the choice of a provider and the ledger update — what issue 11 calls
"placement per acquire".

    .venv/bin/python bench/placement.py [--members N] [--capacity C] [--cycles K]
"""

import argparse
import random
import sys
import time

from twisted.internet.task import Clock

from iop.edge.pool import NORMAL, GroupMember, ModelGroupSpec, ProviderPool, ProviderSpec


def build(members, capacity):
    providers = [ProviderSpec(f"n{i}", "p", "echo", "echo", capacity, 0) for i in range(members)]
    group = ModelGroupSpec("g", tuple(GroupMember(p.node_id, p.provider_id, "t") for p in providers))
    pool = ProviderPool(Clock(), providers, [group])
    for generation, spec in enumerate(providers, 1):
        pool.node_ready(spec.node_id, generation)
    return pool


def acquire(pool, leases):
    pool.acquire("g", NORMAL).addCallback(leases.append)


def run(members=1000, capacity=5, cycles=20000, seed=11):
    """
    @return: C{{"fill", "steady", "release"}}: seconds per call.
    """
    rng = random.Random(seed)
    pool = build(members, capacity)
    leases = []
    target = int(members * capacity * 0.9)
    start = time.perf_counter()
    for _ in range(target):
        acquire(pool, leases)
    fill = (time.perf_counter() - start) / target
    assert len(leases) == target, "every acquire found room"
    start = time.perf_counter()
    for _ in range(cycles):
        leases.pop(rng.randrange(len(leases))).release()
        acquire(pool, leases)
    steady = (time.perf_counter() - start) / cycles
    count = len(leases)
    start = time.perf_counter()
    for lease in leases:
        lease.release()
    release = (time.perf_counter() - start) / count
    return {"members": members, "fill": fill, "steady": steady, "release": release}


def summary(f):
    """
    The placement row of issue 11's table.
    """
    return [
        (
            f"placement in a {f['members']:,}-member group, per acquire (fill; steady release+acquire)",
            f"{f['fill'] * 1e6:.1f} us; {f['steady'] * 1e6:.1f} us",
            "<= 50 us",
        )
    ]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--members", type=int, default=1000)
    parser.add_argument("--capacity", type=int, default=5, help="slots per member (default 5)")
    parser.add_argument("--cycles", type=int, default=20000, help="release+acquire pairs at 90%% load")
    args = parser.parse_args(argv)
    f = run(args.members, args.capacity, args.cycles)
    print(
        f"placement, {args.members} members x {args.capacity} slots: fill {f['fill'] * 1e6:.1f} us/acquire, "
        f"steady {f['steady'] * 1e6:.1f} us/(release+acquire), release {f['release'] * 1e6:.1f} us"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
