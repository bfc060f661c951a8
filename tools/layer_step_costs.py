#!/usr/bin/env python3
"""What one MoELayer training step (forward and backward) costs at tiny sizes,
where the time is host overhead: the median time per step, and per step the
collectives, native calls, host waits, allocations (a2a.counting over the
process) and torch ops dispatched (each a launch on a GPU). Run it on two
commits to compare them (docs/benchmarks.md, "The layer keeps its agreement").

    python tools/layer_step_costs.py [--np 2] [-T 16] [-M 64] [-E W] [--steps 50] [--repetitions 7]
"""

from __future__ import annotations

import argparse
import sys


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("-T", type=int, default=16, help="tokens per rank (default 16)")
    parser.add_argument("-M", type=int, default=64, help="model dim and hidden size per expert (default 64)")
    parser.add_argument("-E", type=int, default=0, help="experts (default: one per rank)")
    parser.add_argument("--steps", type=int, default=50, help="steps per timed repetition (default 50)")
    parser.add_argument("--repetitions", type=int, default=7)
    return parser.parse_args()


def measure(args: argparse.Namespace) -> None:
    import torch

    import a2a
    from a2a.bench.common import Clock, medians_in_turns
    from moe_runtime import MoELayer
    from moe_runtime.bench.dispatched import DispatchedOps

    torch.set_num_threads(1)
    comm = a2a.Comm.from_mpi()
    experts = args.E or comm.size
    layer = MoELayer({"type": "top", "k": 2, "capacity_factor": 1.0}, model_dim=args.M,
                     experts={"type": "ffn", "count_per_node": max(experts // comm.size, 1),
                              "hidden_size_per_expert": args.M}, comm=comm, seeds=(1, 2))
    x = torch.randn(args.T, args.M, requires_grad=True)

    def step() -> None:
        y = layer(x)
        (y.sum() + layer.l_aux).backward()

    for _ in range(20):
        step()
    [seconds] = medians_in_turns([step], Clock(torch, "cpu"), args.steps, args.repetitions)
    with a2a.counting() as cost, DispatchedOps() as dispatched:
        step()
    if comm.rank == 0:
        c = cost.counters
        print(f"W={comm.size} E={experts} T={args.T} M=H={args.M}: {seconds * 1e6:.0f} us per step (median of "
              f"{args.repetitions} x {args.steps}); per step {c.collectives} collectives, {c.calls} native calls, "
              f"{c.host_waits} host waits, {c.allocations} allocations, {sum(dispatched.ops.values())} torch ops",
              flush=True)


def main() -> int:
    args = parse()
    from a2a.launch import main_on_ranks

    return main_on_ranks(args.np, lambda: measure(args))


if __name__ == "__main__":
    sys.exit(main())
