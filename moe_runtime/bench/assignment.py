"""``python -m moe_runtime.bench.assignment``: sample-assignment caching
(DynaMoE Section 4.2) against the same dropless layer without it.

    python -m moe_runtime.bench.assignment                 # 4 ranks (2 emulated nodes of 2), the defaults
    python -m moe_runtime.bench.assignment --quick --np 2  # seconds
    mpirun -np 4 python -m moe_runtime.bench.assignment --tokens 2048 --experts 32 --json out.json

The workload repeats assignments across steps, as training epochs do: each
rank owns ``--batches`` fixed batches of ``--tokens`` tokens
(``--tokens-per-sample`` per sample, one id per sample) and cycles through
them for ``--epochs`` epochs; after every step the gate's weights drift by
``--drift`` x N(0, 1) per element (the same on every rank, as an optimizer
step would), so a few assignments change between two visits of a sample.
Two layers with the same weights take turns on every step (forward and
backward): ``flow="dropless"`` (uncached) and the same with an
:class:`moe_runtime.AssignmentCache` (default thresholds 0.95 / 0.85). Both
see the same drift. Printed: the hit rate (the cached layer's hits over
its choices from the second epoch on), the steps that ran the predicted
dispatch, the median step time of each layer over those steps and their
ratio, and the gate's forward alone (what the predicted dispatch can hide).
Times are the maximum over ranks of each step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

from a2a import launch
from a2a.bench import common

DEFAULT_NP, DEFAULT_LOCAL_SIZE = 4, 2
DEFAULTS = {"tokens": 1024, "tokens_per_sample": 64, "batches": 4, "epochs": 8, "experts": 16,
            "model_dim": 1024, "hidden": 512, "k": 2, "drift": 2e-4, "gate": "top"}
QUICK = {"tokens": 64, "tokens_per_sample": 8, "batches": 2, "epochs": 4, "experts": 4, "model_dim": 32,
         "hidden": 32, "k": 2, "drift": 2e-4, "gate": "top"}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m moe_runtime.bench.assignment", description=__doc__.split("\n\n")[0])
    p.add_argument("--np", type=int, help=f"ranks to launch under mpirun when not under it (default {DEFAULT_NP})")
    p.add_argument("--local-size", type=int, help="ranks per emulated node (A2A_LOCAL_SIZE)")
    p.add_argument("--quick", action="store_true", help="small sizes (seconds)")
    p.add_argument("--tokens", type=int, help=f"tokens per rank per step (default {DEFAULTS['tokens']})")
    p.add_argument("--tokens-per-sample", type=int, help=f"L (default {DEFAULTS['tokens_per_sample']})")
    p.add_argument("--batches", type=int, help=f"batches per rank per epoch (default {DEFAULTS['batches']})")
    p.add_argument("--epochs", type=int, help=f"epochs (default {DEFAULTS['epochs']})")
    p.add_argument("--experts", type=int, help=f"E, a multiple of the ranks (default {DEFAULTS['experts']})")
    p.add_argument("--model-dim", type=int, help=f"M (default {DEFAULTS['model_dim']})")
    p.add_argument("--hidden", type=int, help=f"H (default {DEFAULTS['hidden']})")
    p.add_argument("--k", type=int, help=f"top-k (default {DEFAULTS['k']})")
    p.add_argument("--drift", type=float, help=f"gate weight drift per step (default {DEFAULTS['drift']:g})")
    p.add_argument("--gate", choices=("top", "cosine_top"), help=f"gate type (default {DEFAULTS['gate']})")
    p.add_argument("--algo", choices=("linear", "2dh"), default="linear", help="all-to-all algorithm")
    p.add_argument("--json", metavar="PATH", help="write the result row as JSON")
    args = p.parse_args(argv)
    for name, value in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    for name in ("tokens", "tokens_per_sample", "batches", "epochs", "experts", "model_dim", "hidden", "k"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.tokens % args.tokens_per_sample:
        p.error(f"--tokens ({args.tokens}) must be a multiple of --tokens-per-sample ({args.tokens_per_sample})")
    if args.epochs < 2:
        p.error("--epochs must be at least 2 (the first one fills the cache)")
    return args


def _bench(args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np
    import torch
    from mpi4py import MPI

    import a2a

    from ..deployment.assignment_cache import AssignmentCache
    from ..deployment.flow import Dropless
    from ..gating.gates import decide
    from ..layer import MoELayer

    comm = a2a.Comm.from_mpi(MPI.COMM_WORLD)
    if args.experts % comm.size:
        raise SystemExit(f"--experts ({args.experts}) must be a multiple of the {comm.size} ranks (whole experts)")
    samples = args.tokens // args.tokens_per_sample
    spec = {"type": "ffn", "num_experts_per_device": args.experts // comm.size, "hidden_size_per_expert": args.hidden}
    gate = {"type": args.gate, "k": args.k}
    plain = MoELayer(gate, args.model_dim, spec, comm=comm, seeds=(1, 2), flow="dropless")
    cached = MoELayer(gate, args.model_dim, spec, comm=comm, seeds=(1, 2),
                      flow=Dropless(assignment_cache=AssignmentCache()))
    batches = []
    for b in range(args.batches):
        generator = torch.Generator().manual_seed(1000 * comm.rank + b)
        x = torch.randn(samples, args.tokens_per_sample, args.model_dim, generator=generator).requires_grad_(True)
        batches.append((x, np.arange(samples) + (comm.rank * args.batches + b) * samples))
    drift = torch.Generator().manual_seed(7)  # the same on every rank: the gates stay equal

    def step(layer: MoELayer, x: torch.Tensor, **call: Any) -> float:
        MPI.COMM_WORLD.Barrier()
        start = time.perf_counter()
        x.grad = None
        layer.zero_grad(set_to_none=True)
        y = layer(x, algo=args.algo, **call)
        (y.sum() + y.l_aux).backward()
        return time.perf_counter() - start

    rows = []
    for epoch in range(args.epochs):
        for b, (x, ids) in enumerate(batches):
            order = [(plain, {}), (cached, {"sample_ids": ids})]
            if (epoch + b) % 2:
                order.reverse()  # taking turns: neither layer always runs second
            seconds = {id(layer): step(layer, x, **call) for layer, call in order}
            stats = cached.assignment_stats
            rows.append((epoch, seconds[id(plain)], seconds[id(cached)], stats.hits, stats.misses, stats.cached))
            with torch.no_grad():
                delta = torch.randn(plain.gates[0].wg.weight.shape if args.gate == "top"
                                    else plain.gates[0].sim_matrix.shape, generator=drift) * args.drift
                for layer in (plain, cached):
                    (layer.gates[0].wg.weight if args.gate == "top" else layer.gates[0].sim_matrix).add_(delta)

    x = batches[0][0].detach().reshape(-1, args.model_dim)
    gate_times = []
    for _ in range(5):
        start = time.perf_counter()
        decide(plain.gates[0], x, args.k, training=True, normalize_gate=True, is_gshard_loss=True)
        gate_times.append(time.perf_counter() - start)

    table = np.array([[p, c, h, m, int(on)] for epoch, p, c, h, m, on in rows if epoch >= 1], dtype=np.float64)
    gathered = a2a.all_gather(table.reshape(-1), comm=comm).reshape(comm.size, *table.shape)
    plain_s, cached_s = gathered[:, :, 0].max(axis=0), gathered[:, :, 1].max(axis=0)
    hits, misses = gathered[:, :, 2].sum(), gathered[:, :, 3].sum()
    on = gathered[0, :, 4] > 0
    steps_on = int(on.sum())
    chosen = on if steps_on else np.ones_like(on)
    plain_ms = statistics.median(plain_s[chosen]) * 1e3
    cached_ms = statistics.median(cached_s[chosen]) * 1e3
    gate_ms = float(a2a.all_gather(np.array([statistics.median(gate_times)]), comm=comm).max()) * 1e3
    return {"ranks": comm.size, "tokens": args.tokens, "tokens_per_sample": args.tokens_per_sample,
            "batches": args.batches, "epochs": args.epochs, "experts": args.experts, "model_dim": args.model_dim,
            "hidden": args.hidden, "k": args.k, "gate": args.gate, "drift": args.drift, "algo": args.algo,
            "hit_rate": float(hits / max(hits + misses, 1)), "steps": len(on), "steps_cached": steps_on,
            "uncached_ms": plain_ms, "cached_ms": cached_ms, "speedup": plain_ms / cached_ms, "gate_ms": gate_ms}


def format_result(row: dict[str, Any]) -> list[str]:
    return [
        (f"# sample-assignment caching: W={row['ranks']} T={row['tokens']} L={row['tokens_per_sample']} "
        f"batches={row['batches']} epochs={row['epochs']} E={row['experts']} M={row['model_dim']} "
        f"H={row['hidden']} k={row['k']} gate={row['gate']} drift={row['drift']:g} algo={row['algo']}"),
        "#  hit rate  cached steps  uncached(ms)  cached(ms)  speedup  gate fwd(ms)",
        (f"   {row['hit_rate']:8.4f}  {row['steps_cached']:5d} / {row['steps']:<5d} {row['uncached_ms']:12.2f}  "
        f"{row['cached_ms']:10.2f}  {row['speedup']:6.3f}x  {row['gate_ms']:12.2f}"),
    ]


def main(argv: list[str] | None = None) -> int:
    """Relaunched under mpirun when not under it already, else the benchmark
    on every rank of MPI_COMM_WORLD (rank 0 prints)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if not launch.under_mpirun() and (args.np if args.np is not None else DEFAULT_NP) > 1:
        return common.relaunch("moe_runtime.bench.assignment", argv, args.np, args.local_size,
                               default_np=DEFAULT_NP, default_local_size=DEFAULT_LOCAL_SIZE)
    from mpi4py import MPI

    row = _bench(args)
    if MPI.COMM_WORLD.Get_rank() == 0:
        command = os.environ.get(common.COMMAND_ENV) or common.command_line(argv, "moe_runtime.bench.assignment")
        print(f"# {command}")
        for line in format_result(row):
            print(line)
        if args.json:
            with open(args.json, "w") as out:
                json.dump(row, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
