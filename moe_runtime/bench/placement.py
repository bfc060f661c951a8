"""Expert placement: Max Load and Avg Max Load of the placements, and what ``MoELayer.place`` costs.

    python -m moe_runtime.bench.placement [--np 4] [--experts-per-rank 4] [--batches 400]
                                          [--tokens 4096] [--seed 0] [--trials 1] [--json out.json]

Started plainly it runs itself under mpirun on ``--np`` ranks (a2a.launch).
Three traces of (batches, E) counts, E = W x ``--experts-per-rank``, each
fitted on its first half and measured on its second (the Deployment paper,
Section VII; moe_runtime.deployment.placement), for the identity placement (the
layer's), greedy and anti-correlation:

* ``skewed``: Zipf(``--zipf``) popularity over shuffled ids, a log-normal
  per-batch fluctuation (sigma 0.3), ``--tokens`` choices per batch drawn
  from it (multinomial).
* ``correlated``: ``--topics`` groups of experts (shuffled ids); each batch
  has one topic whose experts get ``--boost`` times the weight: experts of
  a topic rise and fall together, with equal means.

``--trials N``: the synthetic rows are means over N seeds.
* ``layer``: recorded from an MoELayer (``routing_trace``): dropless,
  top-2, M = H = ``--dim``, on tokens from ``--topics`` clusters with Zipf
  popularity (the gate maps each cluster mostly to a few experts), summed
  over the ranks.

Then the layer takes the greedy placement with its Adam state
(``place``): the seconds (the slowest rank, median of ``--repeats``
placements back and forth) and bytes moved; and the median training step
(forward, backward, Adam) on the recorded routing before and after, with
the largest rank's share of the routed rows (on a shared host the step
time shows little: the ranks share cores).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

from a2a import launch
from a2a.bench import common

from ..deployment import placement

DEFAULT_NP = 4
POLICY_NAMES = tuple(placement.POLICIES)


def skewed_trace(experts: int, batches: int, tokens: int, zipf: float, rng: np.random.Generator) -> np.ndarray:
    popularity = 1.0 / (1.0 + rng.permutation(experts)) ** zipf
    weights = popularity * rng.lognormal(0.0, 0.3, size=(batches, experts))
    weights /= weights.sum(axis=1, keepdims=True)
    return np.stack([rng.multinomial(tokens, row) for row in weights])


def correlated_trace(experts: int, batches: int, tokens: int, topics: int, boost: float,
                     rng: np.random.Generator) -> np.ndarray:
    topic_of = rng.permutation(experts) % topics
    active = rng.integers(0, topics, size=batches)
    weights = np.where(topic_of[None, :] == active[:, None], boost, 1.0)
    weights /= weights.sum(axis=1, keepdims=True)
    return np.stack([rng.multinomial(tokens, row) for row in weights])


def evaluate(name: str, trace: np.ndarray, ranks: int) -> dict:
    results = placement.fit_and_evaluate(trace, ranks)
    row = {"trace": name, "batches": int(trace.shape[0]), "experts": int(trace.shape[1]), "ranks": ranks}
    for policy, result in results.items():
        row[f"{policy}_max_load"] = result["max_load"]
        row[f"{policy}_avg_max_load"] = result["avg_max_load"]
        row[f"{policy}_assignment"] = result["assignment"].tolist()
    return row


def synthetic_rows(args: argparse.Namespace, experts: int, ranks: int) -> list[dict]:
    """The skewed and correlated rows; with --trials N, the metrics are means over
    seeds seed .. seed + N - 1 (the assignment shown is the first seed's)."""
    trials = {"skewed": [], "correlated": []}
    for seed in range(args.seed, args.seed + args.trials):
        rng = np.random.default_rng(seed)
        trials["skewed"].append(evaluate("skewed", skewed_trace(experts, args.batches, args.tokens, args.zipf, rng),
                                         ranks))
        trace = correlated_trace(experts, args.batches, args.tokens, args.topics, args.boost, rng)
        trials["correlated"].append(evaluate("correlated", trace, ranks))
    rows = []
    for runs in trials.values():
        row = dict(runs[0], trials=len(runs))
        for key in row:
            if key.endswith("load"):
                row[key] = float(np.mean([run[key] for run in runs]))
        rows.append(row)
    return rows


class LayerRun:
    """The recorded trace, the placement's cost and the step times on every rank."""

    def __init__(self, args: argparse.Namespace):
        import torch
        from mpi4py import MPI

        import a2a
        from moe_runtime import MoELayer

        self.torch, self.a2a, self.world = torch, a2a, MPI.COMM_WORLD
        self.comm = a2a.Comm.from_mpi(self.world)
        self.args = args
        torch.manual_seed(args.seed + 1000 * self.comm.rank)
        torch.set_num_threads(1)
        experts = {"type": "ffn", "num_experts_per_device": args.experts_per_rank, "hidden_size_per_expert": args.dim}
        self.layer = MoELayer({"type": "top", "k": 2}, args.dim, experts, comm=self.comm, seeds=(args.seed, 1),
                              flow="dropless")
        self.optimizer = torch.optim.Adam(self.layer.parameters(), lr=1e-3)
        generator = torch.Generator().manual_seed(args.seed)  # the same clusters on every rank
        self.centres = torch.randn(args.topics, args.dim, generator=generator) * 3.0
        self.popularity = 1.0 / (1.0 + torch.randperm(args.topics, generator=generator).double()) ** args.zipf

    def tokens(self, count: int):
        torch = self.torch
        cluster = torch.multinomial(self.popularity, count, replacement=True)
        return self.centres[cluster] + torch.randn(count, self.args.dim)

    def record(self) -> np.ndarray:
        """(batches, E): the routed choices per expert, summed over the ranks."""
        per_rank = max(1, self.args.tokens // (2 * self.comm.size))  # top-2: tokens choices per batch in all
        self.layer.routing_trace = []
        with self.torch.no_grad():
            for _ in range(self.args.batches):
                self.layer(self.tokens(per_rank))
        local = np.stack(self.layer.routing_trace).astype(np.int64)
        self.layer.routing_trace = None
        return self.a2a.all_reduce(local, comm=self.comm)

    def step(self, x) -> float:
        start = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        y = self.layer(x)
        (y.square().mean() + y.l_aux).backward()
        from moe_runtime import sync_shared_gradients

        sync_shared_gradients(self.layer, self.comm)
        self.optimizer.step()
        return self._slowest(time.perf_counter() - start)

    def _slowest(self, seconds: float) -> float:
        return float(self.a2a.all_reduce(np.array([seconds]), comm=self.comm, op="max")[0])

    def step_times(self, inputs) -> float:
        for x in inputs[:2]:
            self.step(x)  # warm-up
        return statistics.median(self.step(x) for x in inputs)

    def place_cost(self, assignment: np.ndarray) -> dict:
        """Median seconds of placing `assignment` (and back, for repeats), bytes moved in all."""
        identity = placement.identity(assignment.size, assignment.shape[0])
        seconds, moved_bytes, moved_experts = [], 0, 0
        for i in range(self.args.repeats):
            target = assignment if i % 2 == 0 else identity
            self.world.Barrier()
            start = time.perf_counter()
            moved = self.layer.place(target, self.optimizer)
            seconds.append(self._slowest(time.perf_counter() - start))
            if i == 0:
                sent = np.array([moved.bytes_sent, moved.experts_sent], dtype=np.int64)
                moved_bytes, moved_experts = (int(v) for v in self.a2a.all_reduce(sent, comm=self.comm))
        if self.args.repeats % 2 == 0:
            self.layer.place(assignment, self.optimizer)  # leave the layer placed
        return {"place_seconds": statistics.median(seconds), "bytes_moved": moved_bytes,
                "experts_moved": moved_experts}


def _bench(args: argparse.Namespace) -> int:
    run = LayerRun(args)
    comm = run.comm
    lead = comm.rank == 0
    ranks = comm.size
    experts = ranks * args.experts_per_rank
    rows = []
    if lead:
        rows += synthetic_rows(args, experts, ranks)
    trace = run.record()
    layer_row = evaluate("layer", trace, ranks)
    inputs = [run.tokens(max(1, args.tokens // (2 * ranks))) for _ in range(args.steps)]
    run.step(inputs[0])  # Adam's state exists: place moves it too
    greedy = np.array(layer_row["greedy_assignment"], dtype=np.int64)
    before = run.step_times(inputs)
    layer_row.update(run.place_cost(greedy))
    after = run.step_times(inputs)
    layer_row.update({"step_ms_identity": before * 1e3, "step_ms_greedy": after * 1e3})
    rows.append(layer_row)
    if not lead:
        return 0
    print(f"Max Load / Avg Max Load, fitted on the first half, measured on the second; W = {ranks}, "
          f"E = {experts}, floor 1/W = {1 / ranks:.3f}; synthetic rows: mean of {args.trials} seed(s)")
    print(f"{'trace':>10} " + " ".join(f"{p:>22}" for p in POLICY_NAMES))
    for row in rows:
        print(f"{row['trace']:>10} " + " ".join(
            f"{row[f'{p}_max_load']:>10.3f} /{row[f'{p}_avg_max_load']:>10.3f}" for p in POLICY_NAMES))
    print(f"place (greedy, Adam state included): {layer_row['experts_moved']} experts, "
          f"{layer_row['bytes_moved'] / 2**20:.2f} MiB in all, {layer_row['place_seconds'] * 1e3:.2f} ms "
          f"(median of {args.repeats}, slowest rank)")
    print(f"training step (median of {args.steps}, slowest rank): identity {before * 1e3:.2f} ms, "
          f"greedy {after * 1e3:.2f} ms")
    if args.json:
        config = {k: v for k, v in vars(args).items() if k != "json"} | {"ranks": ranks}
        with open(args.json, "w") as out:
            json.dump({"command": common.command_line(sys.argv[1:], "moe_runtime.bench.placement"),
                       "config": config, "rows": rows}, out, indent=1)
    return 0


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m moe_runtime.bench.placement",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--np", type=int, help=f"ranks to launch under mpirun when not under it (default {DEFAULT_NP})")
    parser.add_argument("--experts-per-rank", type=int, default=4)
    parser.add_argument("--batches", type=int, default=400, help="batches per trace (half to fit, half to measure)")
    parser.add_argument("--tokens", type=int, default=4096, help="routed choices per batch, all ranks together")
    parser.add_argument("--zipf", type=float, default=1.2, help="Zipf exponent of expert (and cluster) popularity")
    parser.add_argument("--topics", type=int, default=4, help="groups of correlated experts; token clusters")
    parser.add_argument("--boost", type=float, default=6.0, help="weight of the active topic's experts")
    parser.add_argument("--dim", type=int, default=64, help="the layer's M = H")
    parser.add_argument("--steps", type=int, default=10, help="timed training steps before and after place")
    parser.add_argument("--repeats", type=int, default=5, help="placements timed (back and forth)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trials", type=int, default=1, help="synthetic traces: mean over this many seeds")
    parser.add_argument("--json", help="write the rows, config and command to this file")
    args = parser.parse_args(argv)
    for name in ("experts_per_rank", "batches", "tokens", "topics", "dim", "steps", "repeats", "trials"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1 (got {getattr(args, name)})")
    if args.batches < 2:
        parser.error("--batches must be at least 2 (half to fit, half to measure)")
    if args.np is not None and args.np < 1:
        parser.error(f"--np must be positive, got {args.np}")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if not launch.under_mpirun() and (args.np if args.np is not None else DEFAULT_NP) > 1:
        return common.relaunch("moe_runtime.bench.placement", argv, args.np, None, default_np=DEFAULT_NP,
                               default_local_size=DEFAULT_NP)
    os.environ.setdefault("A2A_NUM_THREADS", "1")
    return common.on_every_rank(lambda: _bench(args))


if __name__ == "__main__":
    sys.exit(main())
