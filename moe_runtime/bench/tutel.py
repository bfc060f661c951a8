"""``python -m moe_runtime.bench.tutel``: what Tutel's surface costs over the
native layer, and its low-level ops against the layer's own kernels.

    python -m moe_runtime.bench.tutel                 # 4 ranks (2 emulated nodes of 2), the defaults
    python -m moe_runtime.bench.tutel --quick --np 2  # seconds

Two layers with the same weights take turns, step by step (forward and
backward of the same tokens): ``moe_runtime.moe.moe_layer`` (Tutel's
surface, a subclass of MoELayer) and ``moe_runtime.MoELayer`` built with the
settings the surface resolves to (expert_gradient="sum", the gate's k and
capacity factor); which goes first alternates. Printed: each layer's median step time (the slowest
rank's), their ratio, and whether the two outputs are bitwise equal. Then,
on one rank's tokens, Tutel's ``extract_critical`` + ``fast_encode`` +
``fast_decode`` (moe/ops.py) against ``a2a.route`` + ``a2a.fast_encode`` +
``a2a.fast_decode`` called directly, both forward only.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from a2a import launch
from a2a.bench import common

DEFAULT_NP, DEFAULT_LOCAL_SIZE = 4, 2
DEFAULTS = {"tokens": 4096, "experts_per_rank": 2, "model_dim": 512, "hidden": 1024, "k": 2, "steps": 10}
QUICK = {"tokens": 128, "experts_per_rank": 2, "model_dim": 32, "hidden": 64, "k": 2, "steps": 3}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m moe_runtime.bench.tutel", description=__doc__.split("\n\n")[0])
    p.add_argument("--np", type=int, help=f"ranks to launch under mpirun when not under it (default {DEFAULT_NP})")
    p.add_argument("--local-size", type=int, help="ranks per emulated node (A2A_LOCAL_SIZE)")
    p.add_argument("--quick", action="store_true", help="small sizes (seconds)")
    p.add_argument("--tokens", type=int, help=f"tokens per rank (default {DEFAULTS['tokens']})")
    p.add_argument("--experts-per-rank", type=int, help=f"n (default {DEFAULTS['experts_per_rank']})")
    p.add_argument("--model-dim", type=int, help=f"M (default {DEFAULTS['model_dim']})")
    p.add_argument("--hidden", type=int, help=f"H (default {DEFAULTS['hidden']})")
    p.add_argument("--k", type=int, help=f"top-k (default {DEFAULTS['k']})")
    p.add_argument("--steps", type=int, help=f"timed steps of each (default {DEFAULTS['steps']})")
    args = p.parse_args(argv)
    base = QUICK if args.quick else DEFAULTS
    for name, value in base.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def _bench(args: argparse.Namespace) -> list[str]:
    import torch
    from mpi4py import MPI

    import a2a
    from moe_runtime import MoELayer
    from moe_runtime import moe as tutel_moe

    from .rank import slowest

    torch.set_num_threads(1)
    world = MPI.COMM_WORLD
    gate = {"type": "top", "k": args.k, "capacity_factor": 1.0}
    experts = {"type": "ffn", "num_experts_per_device": args.experts_per_rank, "hidden_size_per_expert": args.hidden}
    tutel = tutel_moe.moe_layer(gate_type=gate, model_dim=args.model_dim, experts=experts, seeds=(1, 2, 3))
    native = MoELayer(gate, args.model_dim, experts, comm=tutel.comm, seeds=(1, 2), expert_gradient="sum")
    native.load_state_dict({k: v for k, v in tutel.state_dict().items() if k != "_num_global_experts"})
    x = torch.randn(args.tokens, args.model_dim, generator=torch.Generator().manual_seed(world.Get_rank()))

    def step(layer) -> tuple[float, torch.Tensor]:
        leaf = x.clone().requires_grad_()
        world.Barrier()
        start = time.perf_counter()
        y = layer(leaf)
        (y.square().mean() + y.l_aux).backward()
        return slowest(time.perf_counter() - start, tutel.comm), y.detach()

    times: dict[str, list[float]] = {"tutel": [], "native": []}
    outputs = {}
    pair = (("tutel", tutel), ("native", native))
    for round_ in range(args.steps + 2):  # two untimed rounds first; who goes first alternates
        for name, layer in pair if round_ % 2 else pair[::-1]:
            seconds, outputs[name] = step(layer)
            if round_ >= 2:
                times[name].append(seconds)
    same = bool(torch.equal(outputs["tutel"], outputs["native"]))
    tutel_ms, native_ms = (1e3 * statistics.median(times[name]) for name in ("tutel", "native"))
    lines = [(f"# W={world.Get_size()} T={args.tokens}/rank E={tutel.num_global_experts} M={args.model_dim} "
              f"H={args.hidden} k={args.k}; median of {args.steps} steps (forward + backward), slowest rank"),
             "#  layer                        step ms",
             f"   moe_runtime.moe.moe_layer  {tutel_ms:9.3f}",
             f"   moe_runtime.MoELayer       {native_ms:9.3f}",
             f"#  Tutel surface / native: {tutel_ms / native_ms:.3f}x; outputs bitwise equal: {same}"]

    # The ops alone, on this rank's tokens (no collective).
    scores = torch.softmax(tutel.gates[0].wg(x).detach(), dim=1)
    capacity = args.k * int(1.0 * -(-args.tokens // tutel.num_global_experts))

    def ops_tutel():
        crit, _ = tutel_moe.extract_critical(scores, args.k, loss_fn=None, capacity_factor=1.0)
        return tutel_moe.fast_decode(tutel_moe.fast_encode(x, crit), crit)

    def ops_a2a():
        indices = torch.topk(scores, args.k, dim=1).indices
        routing = a2a.route(indices, tutel.num_global_experts, capacity=capacity)
        gates = scores.gather(1, indices)
        gates = gates / gates.sum(dim=1, keepdim=True)
        return a2a.fast_decode(a2a.fast_encode(x, routing), routing, gates=gates)

    def median_ms(fn) -> float:
        fn()
        samples = []
        for _ in range(max(3, args.steps)):
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
        return 1e3 * statistics.median(samples)

    ops = {"tutel": [], "a2a": []}
    for _ in range(3):  # taking turns
        ops["tutel"].append(median_ms(ops_tutel))
        ops["a2a"].append(median_ms(ops_a2a))
    tutel_ops, a2a_ops = (statistics.median(ops[name]) for name in ("tutel", "a2a"))
    torch.testing.assert_close(ops_tutel(), ops_a2a())
    lines += ["#  rank 0's ops, forward              ms",
              f"   extract_critical+encode+decode  {tutel_ops:8.3f}   (moe_runtime.moe)",
              f"   route+fast_encode+fast_decode   {a2a_ops:8.3f}   (a2a, directly)",
              (f"#  Tutel ops / a2a: {tutel_ops / a2a_ops:.3f}x (both take the top-k of the same scores; "
               "extract_critical also counts each expert's choices and keeps Tutel's per-choice lists)")]
    return lines


def main(argv: list[str] | None = None) -> int:
    """Relaunched under mpirun when not under it already; rank 0 prints."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if not launch.under_mpirun() and (args.np if args.np is not None else DEFAULT_NP) > 1:
        return common.relaunch("moe_runtime.bench.tutel", argv, args.np, args.local_size,
                               default_np=DEFAULT_NP, default_local_size=DEFAULT_LOCAL_SIZE)
    from mpi4py import MPI

    lines = _bench(args)
    if MPI.COMM_WORLD.Get_rank() == 0:
        print("# " + common.command_line(argv, "moe_runtime.bench.tutel"))
        for line in lines:
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
