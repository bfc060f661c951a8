"""The command line of the kernel benchmark (``python -m a2a.bench --op``)."""

from __future__ import annotations

import argparse
import math

from . import common
from .kernels_sizes import DTYPE_SIZES

__all__ = ["DEFAULT_EINSUM_MAX", "OPS", "build_parser", "parse_args"]

OPS = ("encode", "decode", "permute", "unpermute")
_DTYPE_ALIASES = {
    "fp32": "float32",
    "float": "float32",
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "fp64": "float64",
    "double": "float64",
}
DEFAULT_EINSUM_MAX = 2e11


def _int_list(text: str) -> list[int]:
    values = []
    for part in str(text).split(","):
        if not part.strip():
            continue
        try:
            value = common.parse_size(part)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid number {part.strip()!r}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"must be positive, got {part.strip()!r}")
        values.append(value)
    if not values:
        raise argparse.ArgumentTypeError("empty list")
    return values


def _float_list(text: str) -> list[float]:
    try:
        values = [float(p) for p in str(text).split(",") if p.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number list {text!r}") from None
    if not values or not all(math.isfinite(v) for v in values):
        raise argparse.ArgumentTypeError(f"invalid number list {text!r}")
    return values


_DESCRIPTION = """\
Benchmark of the MoE routing kernels (a2a.fast_encode, fast_decode, permute,
unpermute) in one process (no mpirun), against a memcpy of the same bytes, torch
index ops and GShard's dense einsum, all measured in the same run. The default
sweep (--op all: 4 ops x 48 shapes, those above --max-gib skipped) takes about
10 minutes on 2 cores; pick sizes with --tokens, --experts, --model-dim, --top-k
and --dtype.
"""

_EPILOG = """\
columns:
  C          capacity (rows per expert; '-' for the dropless permute / unpermute)
  bytes      read + written by the kernel, from the routing (data rows and gates)
  time       median over -r repetitions of the mean over -n calls (us)
  GB/s       bytes / time (GB = 1e9 B); memcpy: a copy of bytes/2 in the same run
  vs memcpy  GB/s / memcpy GB/s
  vs index   time of torch index ops giving the same result / a2a's time
  vs einsum  time of GShard's dense einsum / a2a's time ('-': not run)
  #wrong     elements differing from the index result (exit status 1 if any)
More in the docstring of a2a/bench/kernels.py and in docs/benchmarks.md.
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m a2a.bench",
        usage="python -m a2a.bench --op OPS [options]",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )

    def switch(name: str, help_text: str) -> None:
        """An on-by-default flag with its --no- form."""
        p.add_argument(name, action=argparse.BooleanOptionalAction, default=True, help=help_text)

    p.add_argument(
        "--op", required=True, metavar="OPS", help="encode, decode, permute, unpermute, all, or a comma list"
    )
    p.add_argument(
        "--tokens",
        type=_int_list,
        default=[4096, 16384, 65536],
        help="T, comma list (default 4096,16384,65536)",
    )
    p.add_argument("--experts", type=_int_list, default=[8, 64], help="E, comma list (default 8,64)")
    p.add_argument(
        "--model-dim", type=_int_list, default=[1024, 4096], help="M, comma list (default 1024,4096)"
    )
    p.add_argument("--top-k", type=_int_list, default=[1, 2], help="k, comma list (default 1,2)")
    p.add_argument(
        "--dtype",
        default="float32,bfloat16",
        help="float32, bfloat16, float16, float64 (or fp32, bf16, ...), comma list (default float32,bfloat16)",
    )
    p.add_argument(
        "--capacity-factor",
        type=_float_list,
        default=[1.0],
        help="Tutel's capacity setting for encode/decode: > 0 a factor, 0 no drops, < 0 no drops up to "
        "-x; comma list (default 1.0)",
    )
    p.add_argument(
        "-r",
        "--repeats",
        type=int,
        default=3,
        help="repetitions; rows show the median (default 3; -r 9 for figures to quote)",
    )
    p.add_argument(
        "-n",
        "--iters",
        type=int,
        default=None,
        help="calls per timing (default: auto, enough for about 50 ms, at most 100; the einsum is held to "
        "about 1 s per timing)",
    )
    p.add_argument("-w", "--warmup", type=int, default=1, help="untimed calls of each case first (default 1)")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads: A2A_NUM_THREADS for a2a (set before its first kernel call) and "
        "torch.set_num_threads for the baselines (default: A2A_NUM_THREADS, else every core)",
    )
    switch("--einsum", "time GShard's dense einsum where it fits the limits below (default on)")
    p.add_argument(
        "--einsum-max",
        type=float,
        default=DEFAULT_EINSUM_MAX,
        help=f"largest einsum cost T*E*C*M (MACs) to run (default {DEFAULT_EINSUM_MAX:g})",
    )
    p.add_argument(
        "--einsum-max-seconds",
        type=float,
        default=2.0,
        help="skip the einsum when a probe predicts more than this per call (default 2)",
    )
    switch("--gates", "pass float32 gates to encode, decode and unpermute (default on; --no-gates: plain copies and sums)")
    switch(
        "--out",
        "give a2a (out=) and the index baselines preallocated outputs, as memcpy has (default on); "
        "--no-out: every call allocates its output (on CPU that adds the page faults of fresh memory)",
    )
    p.add_argument(
        "--max-gib",
        type=float,
        default=8.0,
        help="skip configurations whose buffers are estimated above this many GiB (default 8)",
    )
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default=None,
        help="cpu or cuda (default cuda when torch sees a GPU and a2a was built with CUDA)",
    )
    p.add_argument(
        "--seed", type=int, default=0, help="random seed of the indices, gates and data (default 0)"
    )
    p.add_argument("--json", metavar="PATH", help="write every row (skipped ones too) as a JSON list")
    return p


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    ops: list[str] = []
    for name in (s.strip().lower() for s in args.op.split(",")):
        if name == "all":
            picked = list(OPS)
        elif name in OPS:
            picked = [name]
        else:
            parser.error(f"--op: unknown op {name!r}; expected {', '.join(OPS)}, all, or a comma list")
        ops += [o for o in picked if o not in ops]
    args.ops = ops
    dtypes: list[str] = []
    for name in (s.strip().lower() for s in args.dtype.split(",") if s.strip()):
        name = _DTYPE_ALIASES.get(name, name)
        if name not in DTYPE_SIZES:
            parser.error(f"--dtype: unknown dtype {name!r}; expected {', '.join(DTYPE_SIZES)}")
        if name not in dtypes:
            dtypes.append(name)
    if not dtypes:
        parser.error("--dtype: empty list")
    args.dtypes = dtypes
    for flag, value, low in (
        ("-r/--repeats", args.repeats, 1),
        ("-n/--iters", 1 if args.iters is None else args.iters, 1),
        ("-w/--warmup", args.warmup, 0),
        ("--threads", 1 if args.threads is None else args.threads, 1),
        ("--seed", args.seed, 0),
    ):
        if value < low:
            parser.error(f"{flag} must be at least {low}, got {value}")
    if args.max_gib <= 0:
        parser.error(f"--max-gib must be positive, got {args.max_gib:g}")
    if args.einsum_max < 0 or args.einsum_max_seconds < 0:
        parser.error("--einsum-max and --einsum-max-seconds must not be negative")
    for experts in args.experts:
        for k in args.top_k:
            if k > experts:
                parser.error(
                    f"--top-k {k} is more than --experts {experts} (the choices of a token are distinct)"
                )
    return args
