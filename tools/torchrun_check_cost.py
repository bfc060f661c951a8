#!/usr/bin/env python3
"""What the predicted check saves over torch.distributed's gloo group (a
torchrun job on CPUs, docs/algorithms.md "The predicted check"): the same
all_to_all repeated on Comm.from_torch(device="cpu") (the check of a
predicted call posted beside its data), on the same communicator checking
every call by a round before its data (as until 2026-11-30: the test-only
factory a2a_testing_comm_create_external_by_round), on it with
cross_check=False, and gloo's own all_to_all_single, in turns. Per call: the
median time (each sample many calls), check rounds, control rounds and
messages. Launches itself under torchrun, outside any mpirun:

    python tools/torchrun_check_cost.py [--np 2] [--bytes 64,4096] [--calls 100] [--repetitions 5]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

WORKER = "A2A_TORCHRUN_CHECK_COST_WORKER"


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--bytes", default="64,4096", help="bytes per peer, comma-separated (default 64,4096)")
    parser.add_argument("--calls", type=int, default=100, help="calls per timed sample (default 100)")
    parser.add_argument("--repetitions", type=int, default=5)
    return parser.parse_args(argv)


def measure(args: argparse.Namespace) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist

    import a2a
    from a2a import _C
    from a2a._torch_transport import TorchGroupTransport, agree_tag_base
    from a2a.bench.common import Clock, medians_in_turns

    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD

    def by_round() -> a2a.Comm:
        transport = TorchGroupTransport(group, agree_tag_base(group))
        return a2a.Comm(_C.testing_comm_create_external_by_round(transport, "gloo", size, rank, 0, 0.0, 1))

    comms = {
        "predicted": a2a.Comm.from_torch(device="cpu"),
        "round": by_round(),
        "no check": a2a.Comm.from_torch(device="cpu", cross_check=False),
    }
    if rank == 0:
        print(f"W={size}; per all_to_all call: median of {args.repetitions} x {args.calls} calls, in turns")
        print(f"{'bytes/peer':>10}  {'path':<22} {'us/call':>8} {'vs round':>8}  {'check':>5} "
              f"{'control rounds':>14} {'control msgs':>12}")
    for nbytes in (int(b) for b in args.bytes.split(",")):
        x = np.zeros(size * max(nbytes // 4, 1), np.float32)
        t, out = torch.from_numpy(x), torch.empty(x.shape, dtype=torch.float32)
        calls = [lambda c=c, x=x: a2a.all_to_all(x, comm=c) for c in comms.values()]
        calls.append(lambda out=out, t=t: dist.all_to_all_single(out, t))
        for call in calls:
            for _ in range(4):  # predicted from the third
                call()
        seconds = medians_in_turns(calls, Clock(None, "cpu"), args.calls, args.repetitions)
        rows = [(f"ours, {name}", comm) for name, comm in comms.items()] + [("gloo all_to_all_single", None)]
        for (name, comm), call, s in zip(rows, calls, seconds, strict=True):
            counts = ""
            if comm is not None:
                with a2a.counting(comm) as cost:
                    call()
                comm.check()
                c = cost.counters
                counts = f"{c.check_rounds:>5} {c.control_rounds:>14} {c.control_messages:>12}"
            if rank == 0:
                print(f"{nbytes:>10}  {name:<22} {s * 1e6:>8.1f} {s / seconds[1]:>8.2f}  {counts}", flush=True)
    dist.destroy_process_group()


def main() -> int:
    if os.environ.get(WORKER):  # the arguments travel here: torchrun would parse them as its own
        measure(parse(json.loads(os.environ[WORKER])))
        return 0
    from a2a.launch import MPIRUN_PREFIXES, torchrun_command

    args = parse(sys.argv[1:])
    env = {k: v for k, v in os.environ.items() if not k.startswith(MPIRUN_PREFIXES)}
    env.update({WORKER: json.dumps(sys.argv[1:]), "A2A_QUIET": "1", "OMP_NUM_THREADS": "1"})
    command = torchrun_command(args.np, [sys.executable, os.path.abspath(__file__)])
    return subprocess.run(command, env=env, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
