"""Benchmark of the FP8 row quantization: ``python -m a2a.bench --op quantize_fp8,dequantize_fp8``.

    python -m a2a.bench --op quantize_fp8,dequantize_fp8 --rows 4096,16384 --model-dim 1024 --dtype bfloat16

One process (no mpirun), CPU or CUDA (``--device``). For every (op, rows,
M, dtype) it times, in turns (a2a.bench.common.take_turns):

* ``a2a``: ``a2a.quantize_fp8(x, block, out=)`` -> the (q, scales) pair of
  packed rows (e4m3); ``a2a.dequantize_fp8(q, scales, dtype=, out=)`` ->
  (rows, M) of the dtype (both into preallocated outputs, as memcpy's);
* ``memcpy``: torch ``copy_`` of a buffer of ``bytes / 2`` into another, so
  that it reads and writes the op's ``bytes``: quantize reads rows * M
  elements and writes the packed rows; dequantize the reverse.
* ``torch``: the same with torch ops: amax per block, a division, and a cast
  to ``torch.float8_e4m3fn`` (quantize); a cast back and a multiply
  (dequantize): what a user writes without a2a.

Columns: time (median of ``-r`` repetitions of the mean of ``-n`` calls,
us), GB/s = bytes / time, ``vs memcpy`` = a2a's GB/s over memcpy's (the
issue's target: >= 0.7 on CPU), ``vs torch`` = torch's time / a2a's.
``#wrong``: codes that differ from the torch path's (which rounds the same
way; exit status 1 if any).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from . import common

__all__ = ["FP8_OPS", "is_fp8_mode", "main", "parse_args"]

FP8_OPS = ("quantize_fp8", "dequantize_fp8")


def is_fp8_mode(argv: list[str]) -> bool:
    """Whether --op names only the FP8 quantization's ops."""
    return common.names_only(argv, FP8_OPS)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m a2a.bench", allow_abbrev=False,
                                usage="python -m a2a.bench --op quantize_fp8,dequantize_fp8 [options]",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--op", required=True, help="quantize_fp8, dequantize_fp8, or both (comma list)")
    p.add_argument("--rows", type=common.int_list, default=[4096, 16384], help="rows (tokens), comma list (default 4096,16384)")
    p.add_argument("--model-dim", type=common.int_list, default=[1024, 7168], help="M, comma list (default 1024,7168)")
    p.add_argument("--block", type=int, default=128, help="channels per scale (default 128)")
    p.add_argument("--dtype", default="bfloat16", help="bfloat16, float16, float32, comma list (default bfloat16)")
    common.add_op_bench_flags(p, repeats=7, iters=5)
    return p


def parse_args(argv: list[str]) -> argparse.Namespace:
    return build_parser().parse_args(argv)


class _Case:
    """One (rows, M, dtype): inputs, outputs, and each path of each op."""

    def __init__(self, torch: Any, a2a: Any, rows: int, model_dim: int, dtype: Any, block: int, device: str):
        self.torch, self.a2a, self.block = torch, a2a, block
        gen = torch.Generator().manual_seed(rows + model_dim)
        self.x = torch.randn(rows, model_dim, generator=gen).mul_(4).to(device=device, dtype=dtype)
        self.pair = a2a.quantize_fp8(self.x, block)
        self.out = a2a.quantize_fp8(self.x, block)  # quantize's output, preallocated as memcpy's is
        self.y = torch.empty_like(self.x)
        self.dtype_name = str(dtype).removeprefix("torch.")
        self.blocks = -(-model_dim // block)
        packed = self.pair.packed.numel()
        self.bytes = {"quantize_fp8": self.x.numel() * self.x.element_size() + packed,
                      "dequantize_fp8": packed + self.x.numel() * self.x.element_size()}
        self.memcpy = common.Memcpy(torch, self.bytes, device)

    def quantize_fp8(self) -> Any:
        return self.a2a.quantize_fp8(self.x, self.block, out=self.out)

    def dequantize_fp8(self) -> Any:
        return self.a2a.dequantize_fp8(*self.pair, block=self.block, dtype=self.dtype_name, out=self.y)

    def _blocked(self, t: Any) -> Any:
        """(rows, blocks, block) of t padded with zeros to whole blocks."""
        torch = self.torch
        pad = self.blocks * self.block - t.shape[1]
        return torch.nn.functional.pad(t, (0, pad)).view(t.shape[0], self.blocks, self.block)

    def quantize_fp8_torch(self) -> Any:
        torch = self.torch
        blocked = self._blocked(self.x.float())
        amax = blocked.abs().amax(dim=2, keepdim=True)
        scale = amax / 448.0
        # torch.full_like(...) / amax divides; 448.0 / amax multiplies by a reciprocal, another rounding.
        multiplier = torch.where(amax > 0, torch.full_like(amax, 448.0) / amax, torch.zeros_like(amax))
        q = (blocked * multiplier).to(torch.float8_e4m3fn)
        return q.view(self.x.shape[0], -1)[:, : self.x.shape[1]], scale.squeeze(2)

    def dequantize_fp8_torch(self) -> Any:
        q, scales = self.pair
        values = self._blocked(q.float()) * scales.unsqueeze(2)
        return self.y.copy_(values.view(q.shape[0], -1)[:, : q.shape[1]])

    def wrong(self) -> int:
        """Codes of a2a's quantization that differ from torch's cast."""
        ours = self.quantize_fp8()[0].view(self.torch.uint8)
        theirs = self.quantize_fp8_torch()[0].contiguous().view(self.torch.uint8)
        return int((ours != theirs).sum())


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    started = common.start_op_bench(args)
    if started is None:
        return 2
    torch, a2a, ops = started
    clock = common.Clock(torch, args.device)
    print(f"# a2a.bench --op {','.join(ops)}: {args.device}, threads {torch.get_num_threads()}, block {args.block}, "
          f"e4m3, {common.command_line(argv)}")
    print(f"# {'op':>14} {'rows':>6} {'M':>5} {'dtype':>8} {'bytes':>10} {'time us':>9} {'GB/s':>6} "
          f"{'memcpy':>6} {'vs memcpy':>9} {'torch us':>9} {'vs torch':>8} {'#wrong':>6}")
    rows, failed = [], False
    for count in args.rows:
        for model_dim in args.model_dim:
            for dtype_name in (d.strip() for d in args.dtype.split(",") if d.strip()):
                case = _Case(torch, a2a, count, model_dim, getattr(torch, dtype_name), args.block, args.device)
                wrong = case.wrong()
                failed |= wrong > 0
                for op in ops:
                    paths = [getattr(case, op), lambda op=op, case=case: case.memcpy(op), getattr(case, f"{op}_torch")]
                    t, copy, torch_t = common.medians_in_turns(paths, clock, args.iters, args.repeats)
                    nbytes = case.bytes[op]
                    row = {"op": op, "rows": count, "M": model_dim, "dtype": dtype_name, "device": args.device,
                           "block": args.block, "bytes": nbytes, "time_us": t * 1e6, "gbps": nbytes / t / 1e9,
                           "memcpy_gbps": nbytes / copy / 1e9, "vs_memcpy": copy / t, "torch_us": torch_t * 1e6,
                           "vs_torch": torch_t / t, "wrong": wrong if op == "quantize_fp8" else 0}
                    rows.append(row)
                    print(f"  {op:>14} {count:>6} {model_dim:>5} {dtype_name:>8} {nbytes:>10} "
                          f"{row['time_us']:>9.1f} {row['gbps']:>6.2f} {row['memcpy_gbps']:>6.2f} "
                          f"{row['vs_memcpy']:>9.2f} {row['torch_us']:>9.1f} {row['vs_torch']:>8.2f} "
                          f"{row['wrong']:>6}", flush=True)
    if args.json:
        common.write_json(args.json, rows)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
