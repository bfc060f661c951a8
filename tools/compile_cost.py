#!/usr/bin/env python3
"""What torch.compile makes of a model holding an MoELayer: a Linear, the
layer, a Linear, trained eagerly and compiled, in turns, on one rank.

    python tools/compile_cost.py [--tokens 24] [--model-dim 16] [--backend inductor] [--steps 50]

Prints, for each: dynamo's graphs and graph breaks after the warm-up steps,
the warm-up's seconds (compiling), and the median time of a training step
after it (7 samples of --steps steps). The layer is one graph break (its
collectives and native kernels run eagerly: moe_runtime/common/graphs.py,
a2a/_dynamo.py), so the compiled model should cost its eager time plus
dynamo's guards, and compile two graphs (before and after the layer) once.
docs/benchmarks.md quotes it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--model-dim", type=int, default=16)
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--flow", default="expert", help="the layer's flow (default expert)")
    parser.add_argument("--backend", default="inductor", help="torch.compile's backend (default inductor)")
    parser.add_argument("--warmup", type=int, default=12, help="steps before timing: compiling (default 12)")
    parser.add_argument("--steps", type=int, default=50, help="steps per timed sample (default 50)")
    return parser.parse_args()


def main() -> int:
    args = parse()
    import torch
    import torch._dynamo as dynamo
    from mpi4py import MPI

    import a2a
    import moe_runtime

    torch.set_num_threads(1)
    comm = a2a.Comm.from_mpi(MPI.COMM_SELF)
    width = args.model_dim

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.pre = torch.nn.Linear(width, width)
            self.moe = moe_runtime.MoELayer({"type": "top", "k": 2, "capacity_factor": 1.0}, width,
                                            {"type": "ffn", "num_experts_per_device": args.experts,
                                             "hidden_size_per_expert": 2 * width},
                                            comm=comm, seeds=(1, 2), flow=args.flow)
            self.post = torch.nn.Linear(width, width)

        def forward(self, x):
            y = self.moe(torch.relu(self.pre(x)))
            return self.post(y), y.l_aux

    torch.manual_seed(0)
    eager = Model()
    compiled = torch.compile(eager, backend=args.backend)
    x = torch.randn(args.tokens, width)

    def step(model) -> None:
        y, l_aux = model(x)
        (y.sum() + l_aux).backward()

    rows = []
    for name, model in (("eager", eager), (f"compiled ({args.backend})", compiled)):
        dynamo.reset()
        dynamo.utils.counters.clear()
        start = time.perf_counter()
        for _ in range(args.warmup):
            step(model)
        warmup = time.perf_counter() - start
        graphs = dynamo.utils.counters["stats"]["unique_graphs"]
        breaks = sum(dynamo.utils.counters["graph_break"].values())
        rows.append([name, graphs, breaks, warmup, model])
    samples: dict[str, list[float]] = {row[0]: [] for row in rows}
    for _ in range(7):  # in turns
        for name, *_, model in rows:
            start = time.perf_counter()
            for _ in range(args.steps):
                step(model)
            samples[name].append((time.perf_counter() - start) / args.steps)
    eager_time = statistics.median(samples["eager"])
    print(f"# a Linear, MoELayer(flow={args.flow!r}), a Linear: T = {args.tokens}, M = {width}, "
          f"{args.experts} experts, top-2, one rank, torch {torch.__version__}, 1 thread; {args.warmup} warm-up "
          f"steps, then the median of 7 x {args.steps} steps, in turns")
    print(f"{'model':<22} {'graphs':>6} {'breaks':>6} {'warm-up s':>10} {'us/step':>9} {'x eager':>8}")
    for name, graphs, breaks, warmup, _ in rows:
        median = statistics.median(samples[name])
        print(f"{name:<22} {graphs:>6} {breaks:>6} {warmup:>10.2f} {median * 1e6:>9.0f} {median / eager_time:>8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
