"""FP8 dispatch against the tokens' own dtype: the step time of
``MoELayer(dispatch_dtype="float8_e4m3fn")`` beside the same layer without it.

    python -m moe_runtime.bench --fp8 [--np 4] [-T 4096] [-M 1024] [-H 1024] [-E 8] [-d bfloat16]
                                      [--steps 5] [--warmup 1] [--json F]

For each flow (``expert``: Tutel's capacity flow at factor 1, r = 1, d = 1;
``dropless``) two layers with the same seeds, one moving the tokens' dtype
and one FP8 with block scales (quantized once, dequantized at the experts;
the way back and the backward in the tokens' dtype), take turns: a step is
forward + backward (the slowest rank's time), and an inference call is a
forward under ``torch.no_grad``. Rows: the medians of ``--steps`` after
``--warmup``, in ms, and ``fp8 / plain`` (the issue's target for the step:
<= 1.0 at T = 4096, M = H = 1024).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

from a2a.bench import common

from .rank import RankRun

__all__ = ["main", "parse_args"]

DEFAULT_NP = 4
FLOWS = ("expert", "dropless")


class Run(RankRun):
    def layer(self, flow: str, dispatch_dtype: str | None) -> Any:
        import moe_runtime

        args = self.args
        spec = {"type": "ffn", "num_experts_per_device": args.experts // self.comm.size,
                "hidden_size_per_expert": args.hidden}
        layer = moe_runtime.MoELayer({"type": "top", "k": args.top_k, "capacity_factor": 1.0}, args.model_dim, spec,
                                     comm=self.comm, seeds=(args.seed, args.seed + 1), flow=flow,
                                     dispatch_dtype=dispatch_dtype)
        return layer.to(getattr(self.torch, args.dtype))

    def forward(self, layer: Any, tokens: Any) -> float:
        """Seconds of one forward under no_grad, slowest rank."""
        self.world.Barrier()
        start = time.perf_counter()
        with self.torch.no_grad():
            layer(tokens)
        return self.slowest(time.perf_counter() - start)

    def case(self, flow: str) -> dict:
        torch, args = self.torch, self.args
        generator = torch.Generator().manual_seed(args.seed + self.comm.rank)
        tokens = torch.randn(args.tokens, args.model_dim, generator=generator).to(getattr(torch, args.dtype))
        timings = []
        for layer in (self.layer(flow, None), self.layer(flow, "float8_e4m3fn")):
            for _ in range(args.warmup):
                self.step(layer, tokens)
            timings += [lambda layer=layer: self.step(layer, tokens), lambda layer=layer: self.forward(layer, tokens)]
        step_plain, forward_plain, step_fp8, forward_fp8 = (statistics.median(s) for s in
                                                            common.take_turns(timings, args.steps))
        return {"flow": flow, "step_plain": step_plain, "step_fp8": step_fp8, "step_ratio": step_fp8 / step_plain,
                "forward_plain": forward_plain, "forward_fp8": forward_fp8,
                "forward_ratio": forward_fp8 / forward_plain}


def _bench(args: argparse.Namespace, argv: list[str]) -> int:
    run = Run(args, args.threads)
    if args.experts % run.comm.size:
        raise SystemExit(f"--fp8: {args.experts} experts cannot be split over {run.comm.size} ranks")
    rows = [run.case(flow) for flow in FLOWS]
    if run.comm.rank == 0:
        print(f"# {common.command_line(argv, 'moe_runtime.bench')}")
        print(f"# {run.comm.size} ranks, {args.threads} thread(s) each; T = {args.tokens} per rank, M = "
              f"{args.model_dim}, H = {args.hidden}, E = {args.experts}, k = {args.top_k}, {args.dtype}; medians of "
              f"{args.steps} in turns (ms), slowest rank")
        print(f"# {'flow':>9} {'step plain':>11} {'step fp8':>9} {'fp8/plain':>9} {'fwd plain':>10} {'fwd fp8':>8} "
              f"{'fp8/plain':>9}")
        for row in rows:
            print(f"  {row['flow']:>9} {row['step_plain'] * 1e3:>11.1f} {row['step_fp8'] * 1e3:>9.1f} "
                  f"{row['step_ratio']:>9.2f} {row['forward_plain'] * 1e3:>10.1f} {row['forward_fp8'] * 1e3:>8.1f} "
                  f"{row['forward_ratio']:>9.2f}")
        if args.json:
            with open(args.json, "w") as out:
                json.dump({"command": common.command_line(argv, "moe_runtime.bench"), "ranks": run.comm.size,
                           "config": vars(args), "rows": rows}, out, indent=1)
    return 0


QUICK = {"tokens": 64, "model_dim": 256, "hidden": 64, "experts": 4, "steps": 2, "warmup": 1}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m moe_runtime.bench --fp8", description=__doc__.split("\n")[0])
    p.add_argument("--np", type=int, help=f"ranks to launch under mpirun when not under it (default {DEFAULT_NP})")
    p.add_argument("--local-size", type=int, help="emulated ranks per node (A2A_LOCAL_SIZE)")
    p.add_argument("-T", "--tokens", type=int, default=4096, help="tokens per rank (default 4096)")
    p.add_argument("-M", "--model-dim", type=int, default=1024)
    p.add_argument("-H", "--hidden", type=int, default=1024, help="hidden size per expert")
    p.add_argument("-E", "--experts", type=int, default=8)
    p.add_argument("-k", "--top-k", type=int, default=2)
    p.add_argument("-d", "--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="the tokens' dtype")
    p.add_argument("--threads", type=int, default=1, help="torch and a2a threads per rank (default 1)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1, help="untimed steps of each layer first")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="small sizes and counts, for a test run in seconds")
    p.add_argument("--json", metavar="FILE", help="write the run as JSON to FILE (rank 0)")
    args = common.parse_with_quick(p, argv, QUICK)
    for name in ("tokens", "model_dim", "hidden", "experts", "top_k", "threads", "steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1 (got {getattr(args, name)})")
    if args.warmup < 0:
        p.error("--warmup must be >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    """The --fp8 mode of ``python -m moe_runtime.bench`` (`argv` without --fp8)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    return common.run_mode("moe_runtime.bench", "--fp8", argv, args, DEFAULT_NP, args.threads, _bench)
