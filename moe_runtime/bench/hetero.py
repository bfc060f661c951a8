"""Hexa-MoE's heterogeneous split (Section 3.4, Table 2, Figure 8): the step time of the data- and
model-centric layers with the work split uniformly against in proportion to each rank's speed.

    python -m moe_runtime.bench --hetero [--np 2] [-T 2048] [-M 512] [-H 1024] [-E 8] [--hogs 1]
                                         [--steps 12] [--warmup 3] [--json F]

Heterogeneity is emulated: each rank is pinned to a core of its own (one thread), and in the slow
cases ``--hogs`` busy processes are pinned to the slow rank's core, so the scheduler gives that
rank about 1 / (1 + hogs) of it (the paper lowers a GPU's power limit instead). Cases, as Table 2:
``balanced`` (no hog), ``rank 0 slow`` and ``rank 1 slow``.

In each case every rank measures the proxy task (``moe_runtime.measure_latency``: a loop of
(``--proxy-size``)^2 matmuls, the median of ``--proxy-rounds`` rounds), the latencies are all-gathered (``rank_latencies``), and

* data-centric (Equation 1): a global batch of ``W * T`` tokens is split uniformly, then by
  ``split_by_latency``; each rank runs its part through ``flow="data_centric"``;
* model-centric (Equation 2): every rank runs ``T`` tokens through ``flow="model_centric"``
  with the hidden size split uniformly, then by ``split_by_latency(H, latencies)``.

A step is forward + backward (the slowest rank's time); medians over the steps after ``--warmup``.
``change`` = proportional / uniform - 1 (negative: the split helps). The paper, for the two
unequal cases of Table 2: data-centric -13.2% and -25.3%, model-centric -6.3% and -11.9%.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
from typing import Any

from a2a.bench import common

from .rank import RankRun

__all__ = ["PAPER", "main", "parse_args"]

DEFAULT_NP = 2
CASES = ("balanced", "rank 0 slow", "rank 1 slow")
PAPER = {("data_centric", "rank 0 slow"): -0.132, ("data_centric", "rank 1 slow"): -0.253,
         ("model_centric", "rank 0 slow"): -0.063, ("model_centric", "rank 1 slow"): -0.119}


def _spin(core: int) -> None:
    """A busy loop pinned to `core` (the emulated slowdown)."""
    os.sched_setaffinity(0, {core})
    while True:
        pass


class Run(RankRun):
    def __init__(self, args: argparse.Namespace):
        super().__init__(args)
        cores = sorted(os.sched_getaffinity(0))
        self.core = cores[self.comm.rank % len(cores)]
        os.sched_setaffinity(0, {self.core})

    def layer(self, parallel: str, hidden_split: list[int] | None):
        import moe_runtime

        args, ranks = self.args, self.comm.size
        spec = {"type": "ffn", "num_experts_per_device": args.experts // ranks, "hidden_size_per_expert": args.hidden}
        return moe_runtime.MoELayer({"type": "top", "k": args.top_k}, args.model_dim, spec, comm=self.comm,
                                    seeds=(args.seed, args.seed + 1),
                                    flow=moe_runtime.DataCentric(hidden_split) if parallel == "data_centric"
                                    else moe_runtime.ModelCentric(hidden_split))

    def case(self, name: str) -> dict:
        from moe_runtime.hexa.split import measure_latency, rank_latencies, split_by_latency, uniform_split

        torch, args, comm = self.torch, self.args, self.comm
        slow = {"rank 0 slow": 0, "rank 1 slow": 1}.get(name)
        hogs = []
        if slow == comm.rank:
            hogs = [multiprocessing.Process(target=_spin, args=(self.core,), daemon=True) for _ in range(args.hogs)]
            for hog in hogs:
                hog.start()
        try:
            self.world.Barrier()
            # The median of a few rounds: one round can catch a rank's start-up (allocator, thread pool).
            latency = statistics.median(measure_latency(size=args.proxy_size, repeats=args.proxy_repeats, warmup=5)
                                        for _ in range(args.proxy_rounds))
            latencies = rank_latencies(comm, latency)
            ranks = comm.size
            batch = ranks * args.tokens
            generator = torch.Generator().manual_seed(args.seed)
            global_batch = torch.randn(batch, args.model_dim, generator=generator)
            row: dict[str, Any] = {"case": name, "latencies": latencies}
            splits = {"uniform": uniform_split(batch, ranks), "proportional": split_by_latency(batch, latencies)}
            row["batch_split"] = splits["proportional"]
            data = self.layer("data_centric", None)
            for label, split in splits.items():
                start = sum(split[:comm.rank])
                row[f"data_centric {label}"] = self.median_step(data, global_batch[start:start + split[comm.rank]], args.warmup)
            hidden = {"uniform": None, "proportional": split_by_latency(args.hidden, latencies)}
            if min(hidden["proportional"]) < 1:  # every rank must hold a hidden unit
                hidden["proportional"] = None
            row["hidden_split"] = hidden["proportional"] or uniform_split(args.hidden, ranks)
            local = global_batch[comm.rank * args.tokens:(comm.rank + 1) * args.tokens]
            for label, split in hidden.items():
                row[f"model_centric {label}"] = self.median_step(self.layer("model_centric", split), local, args.warmup)
            for flow in ("data_centric", "model_centric"):
                row[f"{flow} change"] = row[f"{flow} proportional"] / row[f"{flow} uniform"] - 1
            return row
        finally:
            for hog in hogs:
                hog.terminate()
                hog.join()


def report(rows: list[dict], args: argparse.Namespace, ranks: int, argv: list[str]) -> None:
    print(f"# {common.command_line(argv, 'moe_runtime.bench')}")
    print(f"# {ranks} ranks, one core and one thread each; T = {args.tokens} per rank, M = {args.model_dim}, "
          f"H = {args.hidden}, E = {args.experts}, k = {args.top_k}; hogs on the slow rank's core: {args.hogs}; "
          f"medians of {args.steps} steps (forward + backward, slowest rank)")
    print(f"# {'case':<12} {'latency ms':>16} {'share':>11} {'flow':>14} {'uniform ms':>11} {'proportional':>13} "
          f"{'change':>8} {'paper':>7}")
    for row in rows:
        shares = "/".join(f"{(1 / l) / sum(1 / v for v in row['latencies']):.2f}" for l in row["latencies"])
        latency = "/".join(f"{l * 1e3:.2f}" for l in row["latencies"])
        for flow in ("data_centric", "model_centric"):
            paper = PAPER.get((flow, row["case"]))
            print(f"  {row['case']:<12} {latency:>16} {shares:>11} {flow:>14} {row[f'{flow} uniform'] * 1e3:>11.1f} "
                  f"{row[f'{flow} proportional'] * 1e3:>13.1f} {row[f'{flow} change'] * 100:>7.1f}% "
                  f"{'' if paper is None else f'{paper * 100:.1f}%':>7}")


def _bench(args: argparse.Namespace, argv: list[str]) -> int:
    run = Run(args)
    if run.comm.size < 2:
        raise SystemExit("--hetero needs at least 2 ranks")
    if args.experts % run.comm.size:
        raise SystemExit(f"--hetero: {args.experts} experts cannot be split over {run.comm.size} ranks")
    rows = [run.case(name) for name in args.cases]
    if run.comm.rank == 0:
        report(rows, args, run.comm.size, argv)
        if args.json:
            with open(args.json, "w") as out:
                json.dump({"command": common.command_line(argv, "moe_runtime.bench"), "ranks": run.comm.size,
                           "config": vars(args), "rows": rows, "paper": {f"{k[0]} {k[1]}": v for k, v in PAPER.items()}},
                          out, indent=1)
    return 0


QUICK = {"tokens": 64, "model_dim": 32, "hidden": 64, "experts": 4, "steps": 2, "warmup": 1, "proxy_size": 64,
         "proxy_repeats": 2, "proxy_rounds": 1}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m moe_runtime.bench --hetero", description=__doc__.split("\n")[0])
    p.add_argument("--np", type=int, help=f"ranks to launch under mpirun when not under it (default {DEFAULT_NP})")
    p.add_argument("--cases", type=lambda s: [v.strip() for v in s.split(",") if v.strip()], default=list(CASES),
                   help=f"comma list of {', '.join(CASES)}")
    p.add_argument("-T", "--tokens", type=int, default=2048, help="tokens per rank (the global batch is W * T)")
    p.add_argument("-M", "--model-dim", type=int, default=512)
    p.add_argument("-H", "--hidden", type=int, default=1024, help="hidden size per expert")
    p.add_argument("-E", "--experts", type=int, default=8)
    p.add_argument("-k", "--top-k", type=int, default=2)
    p.add_argument("--hogs", type=int, default=1, help="busy processes sharing the slow rank's core")
    p.add_argument("--proxy-size", type=int, default=512, help="the proxy matmul's size")
    p.add_argument("--proxy-repeats", type=int, default=20, help="matmuls per round of the proxy task")
    p.add_argument("--proxy-rounds", type=int, default=5, help="rounds of the proxy task; their median is the latency")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3, help="steps left out of the medians")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="small sizes and counts, for a test run in seconds")
    p.add_argument("--json", metavar="FILE", help="write the run as JSON to FILE (rank 0)")
    args = common.parse_with_quick(p, argv, QUICK)
    unknown = [c for c in args.cases if c not in CASES]
    if unknown or not args.cases:
        p.error(f"--cases: unknown {unknown}; known: {', '.join(CASES)}")
    for name in ("tokens", "model_dim", "hidden", "experts", "top_k", "hogs", "proxy_size", "proxy_repeats", "proxy_rounds", "steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1 (got {getattr(args, name)})")
    if args.warmup < 0:
        p.error(f"--warmup must be >= 0 (got {args.warmup})")
    return args


def main(argv: list[str] | None = None) -> int:
    """The --hetero mode of ``python -m moe_runtime.bench`` (`argv` without --hetero)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    return common.run_mode("moe_runtime.bench", "--hetero", argv, args, DEFAULT_NP, 1, _bench)
