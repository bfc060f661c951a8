#!/usr/bin/env python3
"""a2a.all_reduce / reduce_scatter against MPI's own reductions, in turns, in
one mpirun: on an MPI communicator a2a reduces with its own exchanges, which
carry the cross-rank check (core/reduce_exchanges.hpp); with
cross_check=False it calls MPI_Iallreduce / MPI_Ireduce_scatter_block, and
mpi4py's Allreduce / Reduce_scatter_block is the plain baseline. Prints, per
size, the median time per call of each and the ratios.

    python tools/reductions_vs_mpi.py [--np 4] [--local-size 2] [-b 8] [-e 16M] [--calls 50] [--repetitions 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from a2a._sweep import parse_size


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--np", type=int, default=4)
    parser.add_argument("--local-size", type=int, default=0, help="emulated ranks per node (A2A_LOCAL_SIZE)")
    parser.add_argument("-b", type=parse_size, default=8, help="smallest buffer, bytes per rank (default 8)")
    parser.add_argument("-e", type=parse_size, default=16 << 20, help="largest buffer, bytes per rank (default 16M)")
    parser.add_argument("-f", type=int, default=8, help="size step factor (default 8)")
    parser.add_argument("--calls", type=int, default=50, help="calls per timed repetition")
    parser.add_argument("--repetitions", type=int, default=7)
    return parser.parse_args()


def median_seconds(call, calls: int, repetitions: int, barrier) -> float:
    call()
    times = []
    for _ in range(repetitions):
        barrier()
        start = time.perf_counter()
        for _ in range(calls):
            call()
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def measure(args: argparse.Namespace) -> None:
    import numpy as np
    from mpi4py import MPI

    import a2a

    world = MPI.COMM_WORLD
    checked = a2a.Comm.from_mpi(world)
    unchecked = a2a.Comm.from_mpi(world, cross_check=False)
    if world.rank == 0:
        print(f"# {world.size} ranks, {checked.num_nodes} node(s); float32 sums; median of {args.repetitions} x "
              f"{args.calls} calls; us per call")
        print(f"# {'op':>14} {'bytes':>10} {'a2a':>9} {'a2a (off)':>9} {'mpi4py':>9} {'a2a/mpi4py':>10}")
    size = args.b
    while size <= args.e:
        count = max(1, size // 4 // world.size) * world.size
        for name, (ours, theirs) in calls(np.ones(count, np.float32), world).items():
            t = [median_seconds(lambda ours=ours: ours(checked), args.calls, args.repetitions, world.Barrier),
                 median_seconds(lambda ours=ours: ours(unchecked), args.calls, args.repetitions, world.Barrier),
                 median_seconds(theirs, args.calls, args.repetitions, world.Barrier)]
            t = [world.allreduce(v, op=MPI.MAX) for v in t]  # the slowest rank's
            if world.rank == 0:
                print(f"  {name:>14} {count * 4:>10} {t[0] * 1e6:>9.1f} {t[1] * 1e6:>9.1f} {t[2] * 1e6:>9.1f} "
                      f"{t[0] / t[2]:>10.2f}", flush=True)
        size *= args.f


def calls(x, world) -> dict:
    """Per op: a2a's call on a given comm, and mpi4py's, into preallocated outputs."""
    import numpy as np

    import a2a

    out, block = np.empty_like(x), np.empty(x.size // world.size, x.dtype)
    return {
        "all_reduce": (lambda c: a2a.all_reduce(x, comm=c, out=out), lambda: world.Allreduce(x, out)),
        "reduce_scatter": (lambda c: a2a.reduce_scatter(x, comm=c, out=block),
                           lambda: world.Reduce_scatter_block(x, block)),
    }


def main() -> int:
    args = parse()
    from a2a.launch import mpirun_command, under_mpirun

    if under_mpirun():
        measure(args)
        return 0
    import subprocess

    env = dict(os.environ)
    env.pop("A2A_LOCAL_SIZE", None)
    if args.local_size:
        env["A2A_LOCAL_SIZE"] = str(args.local_size)
    return subprocess.run(mpirun_command(args.np, [sys.executable, *sys.argv]), env=env, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
