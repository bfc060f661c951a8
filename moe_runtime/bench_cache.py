"""Miss rate of the expert cache against its size, per policy, on synthetic routing traces.

    python -m moe_runtime.bench_cache [--experts 16] [--batches 2000] [--tokens 8]
                                      [--zipf 1.2] [--sticky 0.8] [--seed 0] [--json]

A trace is seeded and synthetic: each batch routes ``tokens`` tokens (top-1,
as in decoding); each token keeps an expert of the previous batch with
probability ``sticky`` (temporal locality, a Markov "sticky" choice), else
draws from a Zipf(``zipf``) law over the experts (skew; ranks shuffled so the
hot experts are not the low ids). The active set of a batch is its distinct
experts. The cache sizes run from 1 to E slots; the miss rate is misses over
requests (cache_policy.py). The Deployment paper's claims (Fig. 12) are the
targets: LIFO better than FIFO, and close to Belady's MIN (the paper gives no
number for "close": the table prints the gap).
"""

from __future__ import annotations

import argparse
import json
import random
import sys

from .cache_policy import POLICIES, simulate


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
    parser = argparse.ArgumentParser(prog="python -m moe_runtime.bench_cache", description=__doc__.split("\n")[0])
    parser.add_argument("--experts", type=int, default=16, help="experts per rank, E (default 16)")
    parser.add_argument("--batches", type=int, default=2000)
    parser.add_argument("--tokens", type=int, default=8, help="tokens routed per batch (default 8)")
    parser.add_argument("--zipf", type=float, default=1.2, help="Zipf exponent of expert popularity")
    parser.add_argument("--sticky", type=float, default=0.8, help="chance a token keeps a previous batch's expert")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args(argv)
    for name in ("experts", "batches", "tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1 (got {getattr(args, name)})")
    if not 0.0 <= args.sticky <= 1.0:
        parser.error(f"--sticky must be in [0, 1] (got {args.sticky})")
    if args.zipf < 0:
        parser.error(f"--zipf must be >= 0 (got {args.zipf})")
    trace = synthetic_trace(args.experts, args.batches, args.tokens, args.zipf, args.sticky, args.seed)
    rows = sweep(trace, args.experts)
    claims = targets(rows)
    if args.json:
        json.dump({"config": vars(args) | {"json": None}, "rows": rows, "targets": claims}, sys.stdout)
        print()
        return 0
    print(f"miss rate, E={args.experts}, {args.batches} batches x {args.tokens} tokens, "
          f"zipf={args.zipf}, sticky={args.sticky}, seed={args.seed}")
    print(f"{'slots':>5} {'saved':>6} " + " ".join(f"{p:>7}" for p in POLICIES))
    for r in rows:
        print(f"{r['slots']:>5} {r['memory_saved']:>6.1%} " + " ".join(f"{r[p]:>7.3f}" for p in POLICIES))
    met = "met" if claims["lifo_le_fifo_at_every_size"] else f"NOT met at slots {claims['sizes_where_fifo_wins']}"
    print(f"LIFO <= FIFO at every size (paper, Fig. 12b): {met}")
    print(
        f"LIFO - MIN: mean {claims['lifo_minus_min_mean']:.3f}, max {claims['lifo_minus_min_max']:.3f} "
        f"(FIFO - MIN mean {claims['fifo_minus_min_mean']:.3f}); the paper: LIFO 'very close' to MIN"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
