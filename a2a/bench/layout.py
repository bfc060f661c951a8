"""``python -m a2a.bench --layout``: the layout kernels against a plain copy
of the same bytes, in one process.

For each chunk size the buffer of ``--total`` bytes is viewed as a
``rows x cols`` grid of chunks (``cols`` = ``--cols``, e.g. the ranks of a
node) and transposed, as 2DH's stride copy and the flexible all-to-all's
layout change do:

* ``transpose``: ``a2a_transpose_chunks`` (one kernel on CUDA);
* ``ranges``: ``a2a_copy_ranges`` with one range per chunk, the path of 2DH
  all-to-all-v (its table made once, as 2DH's is);
* ``copy``: one copy of the same bytes (``cudaMemcpyAsync`` device to device
  through torch ``copy_``, or NumPy ``copyto`` on the host), measured in the
  same run, just before.

Columns: the time per call (median of ``-r`` repetitions of ``-n`` calls;
CUDA timed with events on the current stream), GB/s as bytes / time (1 GB =
1e9 B; the same count for the copy), ``of copy`` = copy time / kernel time,
and ``#wrong``: bytes that differ from the transpose computed by NumPy.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import _C
from . import common

DEFAULT_CHUNKS = "256,4K,64K,256K,1M,4M"


def is_layout_mode(argv: list[str]) -> bool:
    """Whether argv asks for this benchmark (has --layout before any --)."""
    return "--layout" in argv[: argv.index("--")] if "--" in argv else "--layout" in argv


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m a2a.bench --layout",
        description="The layout kernels (transpose_chunks, copy_ranges) against a copy of the same bytes.",
        allow_abbrev=False,
    )
    p.add_argument("--layout", action="store_true", required=True, help="this benchmark")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the buffers live (default cpu)")
    p.add_argument("--total", type=common.parse_size, default=common.parse_size("256M"), help="bytes per buffer (default 256M)")
    p.add_argument("--chunks", default=DEFAULT_CHUNKS, help=f"chunk sizes, a comma list (default {DEFAULT_CHUNKS})")
    p.add_argument("--cols", type=int, default=8, help="columns of the chunk grid (default 8)")
    common.add_timing_flags(p, iters=10, repeats=5, warmup=3)
    p.add_argument("--json", metavar="PATH", help="write the rows as a JSON list")
    return p


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.chunk_sizes = [common.parse_size(c) for c in args.chunks.split(",") if c.strip()]
    except ValueError as error:
        parser.error(f"--chunks: {error}")
    common.require_at_least(parser, (("--cols", args.cols, 1), ("-n/--iters", args.iters, 1),
                                     ("-r/--repeats", args.repeats, 1)))
    if not args.chunk_sizes or min(args.chunk_sizes) < 1:
        parser.error("--chunks must list positive sizes")
    if args.total < args.cols * max(args.chunk_sizes):
        parser.error(f"--total {args.total} holds less than one row of {args.cols} chunks of {max(args.chunk_sizes)} B")
    return args


class _Buffers:
    """Source and destination of `nbytes` on one device, and how to time calls there."""

    def __init__(self, device: str, nbytes: int):
        self.device = device
        if device == "cuda":
            import torch

            self.torch = torch
            self.src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
            self.dst = torch.empty_like(self.src)
            self.src_address, self.dst_address = self.src.data_ptr(), self.dst.data_ptr()
        else:
            self.torch = None
            self.src = np.random.default_rng(0).integers(0, 256, size=nbytes, dtype=np.uint8)
            self.dst = np.empty_like(self.src)
            self.src_address, self.dst_address = self.src.ctypes.data, self.dst.ctypes.data

    def exec(self) -> tuple[int, int, int]:
        if self.device == "cuda":
            return (1, self.torch.cuda.current_stream().cuda_stream, 0)
        return (0, 0, 0)

    def copy(self) -> None:
        if self.device == "cuda":
            self.dst.copy_(self.src)
        else:
            np.copyto(self.dst, self.src)

    def host(self, which: Any) -> np.ndarray:
        return which.cpu().numpy() if self.device == "cuda" else which


def _measure(buffers: _Buffers, calls: list[Callable[[], None]], args: argparse.Namespace) -> list[float]:
    """Median seconds per call; the calls take turns in every repetition."""
    for call in calls:
        for _ in range(args.warmup_iters):
            call()
    clock = common.Clock(buffers.torch, buffers.device)  # CUDA events on the current stream, else perf_counter
    samples = common.take_turns([functools.partial(clock.time, call, args.iters) for call in calls], args.repeats)
    return [statistics.median(t) for t in samples]


_COLUMNS = "{:>9}  {:>13}  {:>10}  {:>9}  {:>9}  {:>8}  {:>8}  {:>7}"


def header_lines() -> list[str]:
    return [
        "#" + _COLUMNS.format("chunk", "grid", "op", "time", "GB/s", "copy", "of copy", "#wrong")[1:],
        "#" + _COLUMNS.format("(B)", "(rows x cols)", "", "(us)", "", "(GB/s)", "", "")[1:],
    ]


def main(argv: list[str]) -> int:
    """The layout benchmark, in this process."""
    args = parse_args(argv)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("a2a.bench --layout: --device cuda needs a CUDA device", file=sys.stderr)
            return 2
        where = f"cuda:{torch.cuda.current_device()} ({torch.cuda.get_device_name()})"
    else:
        where = "cpu"
    print(f"# a2a layout kernels on {where}: {args.total} B per buffer, {args.cols} columns; "
          f"median of {args.repeats} x {args.iters} calls")
    print("# GB/s = bytes / time; 'of copy' = copy time / kernel time (same run)")
    for line in header_lines():
        print(line)
    wrong_total = 0
    rows_out: list[dict] = []
    for chunk in args.chunk_sizes:
        rows = args.total // (args.cols * chunk)
        nbytes = rows * args.cols * chunk
        buffers = _Buffers(args.device, nbytes)
        # (src offset, dst offset, bytes) per chunk as (n, 3) uint64, made once and read in place by every call,
        # as 2DH's C++ table is: a Python list would be converted on every call, at 50-100 ns a range.
        r, c = np.meshgrid(np.arange(rows, dtype=np.uint64), np.arange(args.cols, dtype=np.uint64), indexing="ij")
        ranges = np.stack([(r * args.cols + c) * chunk, (c * rows + r) * chunk, np.full_like(r, chunk)], axis=-1)
        ranges = np.ascontiguousarray(ranges.reshape(-1, 3))
        want = buffers.host(buffers.src).reshape(rows, args.cols, chunk).transpose(1, 0, 2).reshape(-1)

        def transpose(b: _Buffers = buffers, rows: int = rows, chunk: int = chunk) -> None:
            _C.transpose_chunks(b.exec(), b.dst_address, b.src_address, rows, args.cols, chunk)

        def copy_ranges(b: _Buffers = buffers, ranges: np.ndarray = ranges) -> None:
            _C.copy_ranges(b.exec(), b.dst_address, b.src_address, ranges)

        copy_s, *kernel_s = _measure(buffers, [buffers.copy, transpose, copy_ranges], args)
        for name, call, seconds in (("transpose", transpose, kernel_s[0]), ("ranges", copy_ranges, kernel_s[1])):
            buffers.dst[:] = 0
            call()
            wrong = int(np.count_nonzero(buffers.host(buffers.dst) != want))
            wrong_total += wrong
            rows_out.append({"op": name, "device": args.device, "chunk_bytes": chunk, "rows": rows, "cols": args.cols,
                             "bytes": nbytes, "time_us": seconds * 1e6, "gbps": nbytes / seconds / 1e9,
                             "copy_gbps": nbytes / copy_s / 1e9, "of_copy": copy_s / seconds, "wrong": wrong})
            print(
                _COLUMNS.format(
                    chunk,
                    f"{rows} x {args.cols}",
                    name,
                    common.format_time(seconds * 1e6),
                    f"{nbytes / seconds / 1e9:9.1f}",
                    f"{nbytes / copy_s / 1e9:8.1f}",
                    f"{copy_s / seconds:8.2f}",
                    wrong,
                )
            )
    print(common.out_of_bounds_line(wrong_total))
    if args.json:
        common.write_json(args.json, rows_out)
    return 1 if wrong_total else 0
