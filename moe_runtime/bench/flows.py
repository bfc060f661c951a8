"""Which flow wins as the workload grows (Hexa-MoE, Figure 7): the step time of the expert-parallel
layer, the dropless one, and Hexa-MoE's data- and model-centric layers, over tokens per rank.

    python -m moe_runtime.bench --flows [--np 2] [--tokens 64,256,1024,4096] [-M 512] [-H 1024] [-E 8]
                                        [--steps 8] [--warmup 2] [--kernels auto|es|grouped] [--json F]

Every flow computes the same function here (nothing is dropped: the expert-parallel layer runs
Tutel's capacity rule with factor 0, the smallest capacity that drops nothing), with the same
seeds, so only the time differs:

* ``expert``: ``flow="expert"``, r = 1 (EP: tokens to the experts' ranks and back by
  all-to-all, the weights stay);
* ``dropless``: ``flow="dropless"`` (permute + all_to_all_v, no padding);
* ``data_centric``: the experts all-gathered into the pipeline-shared cache, tokens stay;
* ``model_centric``: the tokens all-gathered, each rank computes its hidden slice, the outputs
  reduce-scattered: the weights stay, the tokens travel (both Hexa flows with ``--kernels``:
  a2a's expert-specific operators, "es", or grouped GEMMs on permuted rows, "grouped");
* ``dictionary`` (when the layer offers it: ``flows=``): an adaptive layer choosing among the flows
  by timed trials; ``choice`` is what it settled on.

A step is forward + backward (the slowest rank's time), median of ``--steps`` after ``--warmup``;
``best`` names the fastest flow of each T. The paper: model-centric wins at small workloads,
data-centric at large ones (Swin-MoE-Base, 4 GPUs).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from a2a.bench import common

from .rank import RankRun

__all__ = ["FLOWS", "main", "parse_args"]

DEFAULT_NP = 2
FLOWS = ("expert", "dropless", "data_centric", "model_centric")


class Run(RankRun):
    def __init__(self, args: argparse.Namespace):
        super().__init__(args, args.threads)

    def layer(self, flow: str):
        import moe_runtime

        args = self.args
        spec = {"type": "ffn", "num_experts_per_device": args.experts // self.comm.size,
                "hidden_size_per_expert": args.hidden}
        gate = {"type": "top", "k": args.top_k}
        options: dict[str, Any] = {}
        if flow == "expert":
            gate["capacity_factor"] = 0.0
        elif flow == "dropless":
            options["flow"] = "dropless"
        elif flow == "dictionary":
            gate["capacity_factor"] = 0.0
            options = {"parallel_type": "adaptive:auto", "flows": tuple(f for f in FLOWS if f != "expert")}
        elif flow == "data_centric":
            options["flow"] = moe_runtime.DataCentric(kernels=args.kernels)
        elif flow == "model_centric":
            options["flow"] = moe_runtime.ModelCentric(kernels=args.kernels)
        else:
            options["flow"] = flow
        return moe_runtime.MoELayer(gate, args.model_dim, spec, comm=self.comm, seeds=(args.seed, args.seed + 1),
                                    **options)

    def case(self, tokens_per_rank: int, dictionary: bool) -> dict:
        torch, args = self.torch, self.args
        generator = torch.Generator().manual_seed(args.seed + self.comm.rank)
        tokens = torch.randn(tokens_per_rank, args.model_dim, generator=generator)
        row: dict[str, Any] = {"tokens": tokens_per_rank}
        for flow in FLOWS:
            row[flow] = self.median_step(self.layer(flow), tokens, args.warmup)
        row["best"] = min(FLOWS, key=lambda flow: row[flow])
        if dictionary:
            layer = self.layer("dictionary")
            row["dictionary"] = self.median_step(layer, tokens, args.settle + args.warmup)
            capacity = layer.last_plan.capacity
            row["choice"] = str(layer.adaptive.choose(capacity)) + (" (tuning)" if layer.adaptive.tuning(capacity) else "")
        return row


def report(rows: list[dict], args: argparse.Namespace, ranks: int, argv: list[str]) -> None:
    print(f"# {common.command_line(argv, 'moe_runtime.bench')}")
    print(f"# {ranks} ranks, {args.threads} thread(s) each; M = {args.model_dim}, H = {args.hidden}, E = {args.experts}, "
          f"k = {args.top_k}; Hexa kernels {args.kernels}; step = forward + backward, slowest rank, median of "
          f"{args.steps} (ms)")
    extra = "dictionary" in rows[0]
    print(f"# {'T/rank':>7} " + " ".join(f"{flow:>13}" for flow in FLOWS) + f" {'best':>13}"
          + (f" {'dictionary':>11} {'choice':>24}" if extra else ""))
    for row in rows:
        line = f"  {row['tokens']:>7} " + " ".join(f"{row[flow] * 1e3:>13.1f}" for flow in FLOWS) + f" {row['best']:>13}"
        if extra:
            line += f" {row['dictionary'] * 1e3:>11.1f} {row['choice']:>24}"
        print(line)


def _offers_flows() -> bool:
    import inspect

    import moe_runtime

    return "flows" in inspect.signature(moe_runtime.MoELayer.__init__).parameters


def _bench(args: argparse.Namespace, argv: list[str]) -> int:
    run = Run(args)
    if args.experts % run.comm.size:
        raise SystemExit(f"--flows: {args.experts} experts cannot be split over {run.comm.size} ranks")
    dictionary = args.dictionary and _offers_flows()
    rows = [run.case(tokens, dictionary) for tokens in args.tokens]
    if run.comm.rank == 0:
        report(rows, args, run.comm.size, argv)
        if args.json:
            with open(args.json, "w") as out:
                json.dump({"command": common.command_line(argv, "moe_runtime.bench"), "ranks": run.comm.size,
                           "config": vars(args), "rows": rows}, out, indent=1)
    return 0


QUICK = {"tokens": [16, 64], "model_dim": 32, "hidden": 64, "experts": 4, "steps": 2, "warmup": 1, "settle": 8}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m moe_runtime.bench --flows", description=__doc__.split("\n")[0])
    p.add_argument("--np", type=int, help=f"ranks to launch under mpirun when not under it (default {DEFAULT_NP})")
    p.add_argument("--local-size", type=int, help="emulated ranks per node (A2A_LOCAL_SIZE)")
    p.add_argument("--tokens", type=lambda s: [int(v) for v in s.split(",") if v], default=[64, 256, 1024, 4096],
                   help="tokens per rank, comma list (the workload)")
    p.add_argument("-M", "--model-dim", type=int, default=512)
    p.add_argument("-H", "--hidden", type=int, default=1024, help="hidden size per expert")
    p.add_argument("-E", "--experts", type=int, default=8)
    p.add_argument("-k", "--top-k", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch and a2a threads per rank (default 1)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2, help="untimed steps of each flow first")
    p.add_argument("--settle", type=int, default=40, help="steps the dictionary gets to try the flows first")
    p.add_argument("--dictionary", action=argparse.BooleanOptionalAction, default=True,
                   help="also run the adaptive layer that chooses among the flows (when the layer offers flows=)")
    p.add_argument("--kernels", choices=("auto", "es", "grouped"), default="auto",
                   help="how the data- and model-centric flows compute the experts (default auto: grouped GEMMs "
                        "where torch runs them, else the expert-specific operators)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="small sizes and counts, for a test run in seconds")
    p.add_argument("--json", metavar="FILE", help="write the run as JSON to FILE (rank 0)")
    args = common.parse_with_quick(p, argv, QUICK)
    if not args.tokens or min(args.tokens) < 1:
        p.error("--tokens must be positive integers")
    for name in ("model_dim", "hidden", "experts", "top_k", "threads", "steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1 (got {getattr(args, name)})")
    if args.warmup < 0 or args.settle < 0:
        p.error("--warmup and --settle must be >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    """The --flows mode of ``python -m moe_runtime.bench`` (`argv` without --flows)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    return common.run_mode("moe_runtime.bench", "--flows", argv, args, DEFAULT_NP, args.threads, _bench)
