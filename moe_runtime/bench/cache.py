"""Miss rate of the expert cache against its size, per policy, on synthetic routing traces
or on traces recorded from the layer; the layer's time per batch against its cache size.

    python -m moe_runtime.bench.cache [--experts 16] [--batches 2000] [--tokens 8]
                                      [--zipf 1.2] [--sticky 0.8] [--seed 0] [--json]
                                      [--from-layer [--model-dim 256 --hidden 512 --timed-batches 200]]

A trace is seeded and synthetic: each batch routes ``tokens`` tokens (top-1,
as in decoding); each token keeps an expert of the previous batch with
probability ``sticky`` (temporal locality, a Markov "sticky" choice), else
draws from a Zipf(``zipf``) law over the experts (skew; ranks shuffled so the
hot experts are not the low ids). The active set of a batch is its distinct
experts. The cache sizes run from 1 to E slots; the miss rate is misses over
requests (cache_policy.py). The Deployment paper's claims (Fig. 12) are the
targets: LIFO better than FIFO, and close to Belady's MIN (the paper gives no
number for "close": the table prints the gap).

``--from-layer`` records the trace from a 1-rank dropless ``MoELayer`` with
an ``ExpertCache(record=True)`` instead: ``tokens`` tokens per batch, top-1,
whose inputs drift (each batch's tokens are ``sticky`` x the previous ones
plus noise, so the gate's choices have temporal locality). It then times the
layer under ``torch.no_grad()`` over ``timed-batches`` batches, uncached and
with LIFO caches of 1, E/4, E/2 and E slots: device memory saved against
time per batch lost (on CPU the copies are memcpy of the expert weights).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time

import torch

import a2a

from ..deployment.cache_policy import POLICIES, simulate
from ..deployment.expert_cache import ExpertCache
from ..deployment.flow import Dropless
from ..layer import MoELayer


def synthetic_trace(experts: int, batches: int, tokens: int, zipf: float, sticky: float, seed: int) -> list[set[int]]:
    """Sets of active experts per batch, Zipf-skewed and sticky (see the module docstring)."""
    rng = random.Random(seed)
    order = list(range(experts))
    rng.shuffle(order)
    weights = [0.0] * experts
    for rank, expert in enumerate(order):
        weights[expert] = 1.0 / (rank + 1) ** zipf
    trace: list[set[int]] = []
    previous: list[int] = []
    for _ in range(batches):
        chosen = [
            rng.choice(previous) if previous and rng.random() < sticky else rng.choices(range(experts), weights)[0]
            for _ in range(tokens)
        ]
        trace.append(set(chosen))
        previous = chosen
    return trace


def _layer(experts: int, model_dim: int, hidden: int, cache: ExpertCache | None) -> MoELayer:
    """A 1-rank dropless layer (the same seeds every time, so every cache size sees the same model)."""
    from mpi4py import MPI

    comm = a2a.Comm.from_mpi(MPI.COMM_SELF)
    spec = {"type": "ffn", "num_experts_per_device": experts, "hidden_size_per_expert": hidden}
    return MoELayer({"type": "top", "k": 1}, model_dim, spec, comm=comm, seeds=(1, 2),
                    flow=Dropless(expert_cache=cache)).eval()


def layer_inputs(batches: int, tokens: int, model_dim: int, sticky: float, seed: int) -> list[torch.Tensor]:
    """Drifting token batches: x_b = sticky x_{b-1} + sqrt(1 - sticky^2) noise."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, model_dim, generator=generator)
    inputs = []
    for _ in range(batches):
        inputs.append(x)
        x = sticky * x + math.sqrt(1 - sticky**2) * torch.randn(tokens, model_dim, generator=generator)
    return inputs


def recorded_trace(inputs: list[torch.Tensor], experts: int, model_dim: int, hidden: int) -> list[set[int]]:
    """The active experts of every batch, recorded by the layer's cache."""
    cache = ExpertCache(experts, record=True)
    layer = _layer(experts, model_dim, hidden, cache)
    with torch.no_grad():
        for x in inputs:
            layer(x)
    return [set(batch) for batch in cache.recorded]


def time_per_batch(inputs: list[torch.Tensor], experts: int, model_dim: int, hidden: int,
                   sizes: list[int]) -> list[dict[str, float]]:
    """Seconds per batch of the layer uncached and with a LIFO cache of each size; outputs checked equal."""
    def run(cache: ExpertCache | None) -> tuple[float, list[torch.Tensor]]:
        layer = _layer(experts, model_dim, hidden, cache)
        with torch.no_grad():
            layer(inputs[0])  # warm up (and bind the cache)
            start = time.perf_counter()
            outputs = [layer(x) for x in inputs]
            return (time.perf_counter() - start) / len(inputs), outputs

    uncached, want = run(None)
    rows = [{"slots": 0, "seconds": uncached, "miss_rate": 0.0, "memory_saved": 0.0}]
    for slots in sizes:
        cache = ExpertCache(slots, "lifo")
        seconds, got = run(cache)
        # The cache runs the loop over the experts; the uncached layer may run grouped GEMMs (to rounding).
        if not all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(got, want)):
            raise AssertionError(f"the layer with {slots} cache slots differs from the uncached layer")
        rows.append({"slots": slots, "seconds": seconds, "miss_rate": cache.stats.miss_rate,
                     "memory_saved": (experts - slots) / experts})
    return rows


def sweep(trace: list[set[int]], experts: int) -> list[dict[str, float]]:
    """One row per cache size 1..E: the miss rate of every policy and the fraction of expert memory saved."""
    rows = []
    for slots in range(1, experts + 1):
        row: dict[str, float] = {"slots": slots, "memory_saved": (experts - slots) / experts}
        for policy in POLICIES:
            row[policy] = simulate(trace, slots, policy).miss_rate
        rows.append(row)
    return rows


def targets(rows: list[dict[str, float]]) -> dict[str, object]:
    """The paper's claims on these rows: LIFO <= FIFO at every size; LIFO's gap to MIN."""
    lifo_not_better = [r["slots"] for r in rows if r["lifo"] > r["fifo"]]
    gaps = [r["lifo"] - r["belady"] for r in rows]
    return {
        "lifo_le_fifo_at_every_size": not lifo_not_better,
        "sizes_where_fifo_wins": lifo_not_better,
        "lifo_minus_min_max": max(gaps),
        "lifo_minus_min_mean": sum(gaps) / len(gaps),
        "fifo_minus_min_mean": sum(r["fifo"] - r["belady"] for r in rows) / len(rows),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moe_runtime.bench.cache", description=__doc__.split("\n")[0])
    parser.add_argument("--experts", type=int, default=16, help="experts per rank, E (default 16)")
    parser.add_argument("--batches", type=int, default=2000)
    parser.add_argument("--tokens", type=int, default=8, help="tokens routed per batch (default 8)")
    parser.add_argument("--zipf", type=float, default=1.2, help="Zipf exponent of expert popularity")
    parser.add_argument("--sticky", type=float, default=0.8, help="chance a token keeps a previous batch's expert")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--from-layer", action="store_true", help="record the trace from a 1-rank dropless layer")
    parser.add_argument("--model-dim", type=int, default=256, help="--from-layer: M (default 256)")
    parser.add_argument("--hidden", type=int, default=512, help="--from-layer: H per expert (default 512)")
    parser.add_argument("--timed-batches", type=int, default=200,
                        help="--from-layer: batches timed per cache size (default 200; 0 skips the timing)")
    args = parser.parse_args(argv)
    for name in ("experts", "batches", "tokens", "model_dim", "hidden"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1 (got {getattr(args, name)})")
    if args.timed_batches < 0:
        parser.error(f"--timed-batches must be >= 0 (got {args.timed_batches})")
    if not 0.0 <= args.sticky <= 1.0:
        parser.error(f"--sticky must be in [0, 1] (got {args.sticky})")
    if args.zipf < 0:
        parser.error(f"--zipf must be >= 0 (got {args.zipf})")
    timing = []
    if args.from_layer:
        inputs = layer_inputs(args.batches, args.tokens, args.model_dim, args.sticky, args.seed)
        trace = recorded_trace(inputs, args.experts, args.model_dim, args.hidden)
        if args.timed_batches:
            sizes = sorted({1, max(args.experts // 4, 1), max(args.experts // 2, 1), args.experts})
            timing = time_per_batch(inputs[: args.timed_batches], args.experts, args.model_dim, args.hidden, sizes)
        source = (f"recorded from a 1-rank dropless layer (M={args.model_dim}, H={args.hidden}, top-1, "
                  f"drift sticky={args.sticky})")
    else:
        trace = synthetic_trace(args.experts, args.batches, args.tokens, args.zipf, args.sticky, args.seed)
        source = f"synthetic, zipf={args.zipf}, sticky={args.sticky}"
    rows = sweep(trace, args.experts)
    claims = targets(rows)
    if args.json:
        json.dump({"config": vars(args) | {"json": None}, "rows": rows, "targets": claims, "timing": timing},
                  sys.stdout)
        print()
        return 0
    print(f"miss rate, E={args.experts}, {args.batches} batches x {args.tokens} tokens, {source}, seed={args.seed}")
    print(f"{'slots':>5} {'saved':>6} " + " ".join(f"{p:>7}" for p in POLICIES))
    for r in rows:
        print(f"{r['slots']:>5} {r['memory_saved']:>6.1%} " + " ".join(f"{r[p]:>7.3f}" for p in POLICIES))
    met = "met" if claims["lifo_le_fifo_at_every_size"] else f"NOT met at slots {claims['sizes_where_fifo_wins']}"
    print(f"LIFO <= FIFO at every size (paper, Fig. 12b): {met}")
    print(
        f"LIFO - MIN: mean {claims['lifo_minus_min_mean']:.3f}, max {claims['lifo_minus_min_max']:.3f} "
        f"(FIFO - MIN mean {claims['fifo_minus_min_mean']:.3f}); the paper: LIFO 'very close' to MIN"
    )
    if timing:
        base = timing[0]["seconds"]
        print(f"time per batch under no_grad, {len(inputs[: args.timed_batches])} batches (LIFO; outputs equal "
              "to the uncached layer's to rounding, checked)")
        print(f"{'slots':>5} {'saved':>6} {'miss':>6} {'ms':>8} {'x uncached':>10}")
        for r in timing:
            name = "none" if r["slots"] == 0 else str(r["slots"])
            print(f"{name:>5} {r['memory_saved']:>6.1%} {r['miss_rate']:>6.3f} {r['seconds'] * 1e3:>8.3f} "
                  f"{r['seconds'] / base:>10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
