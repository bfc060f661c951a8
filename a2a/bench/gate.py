"""Benchmark of the fused top-k gate: ``python -m a2a.bench --op top_k_gate``.

    python -m a2a.bench --op top_k_gate --tokens 4096,16384 --experts 8,64,256 --top-k 2,8

One process (no mpirun), CPU or CUDA (``--device``). For every (T, E, k,
dtype) it times forward and backward, in turns (a2a.bench.common.take_turns):

* ``a2a``: ``a2a.top_k_gate(logits, k, normalize=True)`` -> scores,
  indices, gates, share and GShard's loss; ``a2a.top_k_gate_backward`` of
  the gates' and the loss's gradients -> the logits';
* ``torch``: the same math in torch ops, as a layer writes it without a2a
  (softmax, topk, the normalized gates, the share by a scatter and a mean,
  the loss; backward: the written-out adjoints, moe_runtime's node on 16-bit
  logits): 14 ops forward, 10 backward;
* ``memcpy``: torch ``copy_`` of a buffer of ``bytes / 2`` into another, so
  that it moves the op's ``bytes``: forward reads the logits and writes the
  scores, indices and gates; backward reads the scores, indices and gates'
  gradients and writes the logits'.

Columns: time (median of ``-r`` repetitions of the mean of ``-n`` calls,
us), GB/s = bytes / time, ``vs memcpy`` = memcpy's time / a2a's,
``vs torch`` = torch's time / a2a's. ``#wrong`` (exit status 1 if any):
forward, choices whose logit is not the one torch's topk of the logits puts
there (a2a ranks by the logits; torch's ops rank the scores, which in 16
bits tie where the logits do not); backward, gradient elements further from
torch's ops than the dtype's rounding, in the tokens both chose alike.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from . import common

__all__ = ["GATE_OPS", "is_gate_mode", "main", "parse_args"]

GATE_OPS = ("top_k_gate",)


def is_gate_mode(argv: list[str]) -> bool:
    """Whether --op names the fused gate."""
    return common.names_only(argv, GATE_OPS)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m a2a.bench", allow_abbrev=False,
                                usage="python -m a2a.bench --op top_k_gate [options]",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--op", required=True, help="top_k_gate")
    p.add_argument("--tokens", type=common.int_list, default=[4096, 16384], help="T, comma list (default 4096,16384)")
    p.add_argument("--experts", type=common.int_list, default=[8, 64, 256], help="E, comma list (default 8,64,256)")
    p.add_argument("--top-k", type=common.int_list, default=[2, 8], help="k, comma list; k > E skipped (default 2,8)")
    p.add_argument("--dtype", default="float32", help="float32, float64, float16, bfloat16, comma list (default float32)")
    common.add_op_bench_flags(p, repeats=7, iters=10)
    return p


def parse_args(argv: list[str]) -> argparse.Namespace:
    return build_parser().parse_args(argv)


class _Case:
    """One (T, E, k, dtype): the logits, the gradients, and each path."""

    def __init__(self, torch: Any, a2a: Any, tokens: int, experts: int, top_k: int, dtype: Any, device: str):
        self.torch, self.a2a, self.top_k = torch, a2a, top_k
        gen = torch.Generator().manual_seed(tokens + experts + top_k)
        self.logits = torch.randn(tokens, experts, generator=gen, dtype=torch.float64).mul_(2).to(device, dtype)
        self.d_gates = torch.randn(tokens, top_k, generator=gen, dtype=torch.float64).to(device, dtype)
        self.d_l_aux = torch.ones((), dtype=dtype, device=device)
        self.saved = a2a.top_k_gate(self.logits, top_k, normalize=True)
        self.torch_saved = self.forward_torch()
        # forward: logits in, scores, indices and gates out; backward: scores, indices and d_gates in, d_logits out
        size, index = self.logits.element_size(), 8
        moved = tokens * experts * 2 * size + tokens * top_k * (index + size)
        self.bytes = {"forward": moved, "backward": moved}
        self.memcpy = common.Memcpy(torch, self.bytes, device)

    def forward(self) -> Any:
        return self.a2a.top_k_gate(self.logits, self.top_k, normalize=True)

    def backward(self) -> Any:
        scores, indices, _, share, _ = self.saved
        return self.a2a.top_k_gate_backward(scores, indices, share, self.d_gates, self.d_l_aux, normalize=True)

    def forward_torch(self) -> Any:
        torch = self.torch
        scores = torch.softmax(self.logits, dim=1)
        top, indices = torch.topk(scores, self.top_k, dim=1)
        sums = top.sum(dim=1, keepdim=True)
        denominators = sums.clamp(min=torch.finfo(top.dtype).eps)
        gates = top / denominators
        share = torch.zeros_like(scores).scatter_(1, indices[:, :1], 1.0).mean(0)
        l_aux = (scores.mean(0) * share).sum() * scores.shape[1]
        return scores, indices, gates, sums, denominators, share, l_aux

    def backward_torch(self) -> Any:
        torch = self.torch
        scores, indices, gates, sums, denominators, share, _ = self.torch_saved
        d_scores = torch.zeros_like(scores)
        dot = (self.d_gates * gates).sum(dim=1, keepdim=True)
        dot.masked_fill_(sums < denominators, 0)
        d_scores.scatter_(1, indices, (self.d_gates - dot) / denominators)
        d_scores.addcmul_(share * (scores.shape[1] / scores.shape[0]), self.d_l_aux)
        return torch._softmax_backward_data(d_scores, scores, 1, scores.dtype)

    def wrong_backward(self) -> int:
        """Gradient elements that differ from torch's ops by more than the dtype's rounding (relative to
        the largest), in the tokens where both chose the same experts."""
        torch = self.torch
        ours, theirs = self.backward().double(), self.backward_torch().double()
        same = (self.saved[1] == self.torch_saved[1]).all(dim=1)
        tolerance = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
        limit = tolerance[self.logits.dtype] * max(theirs.abs().max().item(), 1e-30)
        return int(((ours - theirs).abs() > limit)[same].sum())

    def wrong(self) -> int:
        """Choices whose logit differs from torch's topk of the logits at the same place (the
        softmax's order; compared by value, so that equal logits may come in either order)."""
        torch = self.torch
        logits = self.logits.double()
        expected = torch.topk(logits, self.top_k, dim=1).values
        return int((logits.gather(1, self.saved[1]) != expected).sum())


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    started = common.start_op_bench(args)
    if started is None:
        return 2
    torch, a2a, _ = started
    clock = common.Clock(torch, args.device)
    print(f"# a2a.bench --op top_k_gate: {args.device}, threads {torch.get_num_threads()}, normalized gates, "
          f"{common.command_line(argv)}")
    print(f"# {'pass':>8} {'T':>6} {'E':>4} {'k':>2} {'dtype':>8} {'bytes':>10} {'time us':>9} {'GB/s':>6} "
          f"{'memcpy':>6} {'vs memcpy':>9} {'torch us':>9} {'vs torch':>8} {'#wrong':>6}")
    rows, failed = [], False
    for tokens in args.tokens:
        for experts in args.experts:
            for top_k in (k for k in args.top_k if k <= experts):
                for dtype_name in (d.strip() for d in args.dtype.split(",") if d.strip()):
                    case = _Case(torch, a2a, tokens, experts, top_k, getattr(torch, dtype_name), args.device)
                    wrong = {"forward": case.wrong(), "backward": case.wrong_backward()}
                    failed |= wrong["forward"] + wrong["backward"] > 0
                    for direction in ("forward", "backward"):
                        paths = [getattr(case, direction), lambda d=direction, case=case: case.memcpy(d),
                                 getattr(case, f"{direction}_torch")]
                        t, copy, torch_t = common.medians_in_turns(paths, clock, args.iters, args.repeats)
                        nbytes = case.bytes[direction]
                        row = {"op": "top_k_gate", "pass": direction, "tokens": tokens, "experts": experts,
                               "top_k": top_k, "dtype": dtype_name, "device": args.device, "bytes": nbytes,
                               "time_us": t * 1e6, "gbps": nbytes / t / 1e9, "memcpy_gbps": nbytes / copy / 1e9,
                               "vs_memcpy": copy / t, "torch_us": torch_t * 1e6, "vs_torch": torch_t / t,
                               "wrong": wrong[direction]}
                        rows.append(row)
                        print(f"  {direction:>8} {tokens:>6} {experts:>4} {top_k:>2} {dtype_name:>8} {nbytes:>10} "
                              f"{row['time_us']:>9.1f} {row['gbps']:>6.2f} {row['memcpy_gbps']:>6.2f} "
                              f"{row['vs_memcpy']:>9.2f} {row['torch_us']:>9.1f} {row['vs_torch']:>8.2f} "
                              f"{row['wrong']:>6}", flush=True)
    if args.json:
        common.write_json(args.json, rows)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
