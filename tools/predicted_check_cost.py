#!/usr/bin/env python3
"""What the predicted check saves (docs/algorithms.md, "The predicted
check"), on the CPU: the same all_to_all repeated on the test factory's
arrangements of a CUDA communicator with host memory, one checking every call
by round ("staged", as a NCCL communicator did until 2026-11-29) and one
posting the check of predicted calls ("predicted", as NCCL under MPI does
now), beside the same arrangement without the check, and beside an MPI
communicator (the check in its messages). Per call: the median time (in
turns, each sample many calls), check rounds, control rounds and messages.

    python tools/predicted_check_cost.py [--np 4] [--bytes 64,4096] [--calls 200] [--repetitions 7]
"""

from __future__ import annotations

import argparse
import sys


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--np", type=int, default=4)
    parser.add_argument("--bytes", default="64,4096", help="bytes per peer, comma-separated (default 64,4096)")
    parser.add_argument("--calls", type=int, default=200, help="calls per timed sample (default 200)")
    parser.add_argument("--repetitions", type=int, default=7)
    return parser.parse_args()


def measure(args: argparse.Namespace) -> None:
    import numpy as np
    from mpi4py import MPI

    import a2a
    from a2a import _C
    from a2a.bench.common import Clock, medians_in_turns

    world = MPI.COMM_WORLD

    def arranged(staging: str, cross_check: bool = True) -> a2a.Comm:
        native = _C.testing_comm_create_mpi(staging, MPI._addressof(world), 0, 0.0, -1, 0, 0, -1, int(cross_check))
        return a2a.Comm(native, world)

    comms = {
        "staged, round": arranged("staged"),
        "staged, predicted": arranged("predicted"),
        "staged, no check": arranged("staged", cross_check=False),
        "mpi, in band": a2a.Comm.from_mpi(world),
    }
    if world.rank == 0:
        print(f"W={world.size}; per all_to_all call: median of {args.repetitions} x {args.calls} calls, in turns")
        print(f"{'bytes/peer':>10}  {'communicator':<18} {'us/call':>8} {'vs round':>8}  {'check':>5} "
              f"{'control rounds':>14} {'control msgs':>12}")
    for size in (int(b) for b in args.bytes.split(",")):
        x = np.zeros(world.size * max(size // 4, 1), np.float32)
        calls = [lambda c=c, x=x: a2a.all_to_all(x, comm=c) for c in comms.values()]
        for call in calls:
            for _ in range(4):  # predicted from the third
                call()
        seconds = medians_in_turns(calls, Clock(None, "cpu"), args.calls, args.repetitions)
        for (name, comm), call, s in zip(comms.items(), calls, seconds, strict=True):
            with a2a.counting(comm) as cost:
                call()
            comm.check()
            c = cost.counters
            if world.rank == 0:
                print(f"{size:>10}  {name:<18} {s * 1e6:>8.1f} {s / seconds[0]:>8.2f}  {c.check_rounds:>5} "
                      f"{c.control_rounds:>14} {c.control_messages:>12}", flush=True)


def main() -> int:
    args = parse()
    from a2a.launch import main_on_ranks

    return main_on_ranks(args.np, lambda: measure(args))


if __name__ == "__main__":
    sys.exit(main())
