"""The MoE kernel benchmark: ``python -m a2a.bench --op encode|decode|permute|unpermute|all``.

    python -m a2a.bench --op all                                  # the default sweep (about 10 minutes on 2 cores)
    python -m a2a.bench --op encode,decode --tokens 16384 --experts 64 --model-dim 4096 --top-k 2
    python -m a2a.bench --op encode --tokens 4096 --experts 16 --model-dim 1024 --top-k 2 --json out.json

Unlike the collectives benchmark this runs in one process (no mpirun): the
kernels work on one rank's data. For every configuration (op, T tokens, E
experts, top-k, model dim M, dtype) it times

* ``a2a``: the kernel as an application calls it: ``a2a.fast_encode(x,
  routing, gates)`` -> (E, C, M); ``a2a.fast_decode(dispatched, routing,
  gates)`` -> (T, M); ``a2a.permute(x, indices, E)`` -> (N, M) (this one
  includes the routing: it takes the raw indices); ``a2a.unpermute(y_sorted,
  perm, gates)`` -> (T, M). The routing of encode / decode comes from
  ``a2a.route`` outside the timed region. Outputs are preallocated and
  passed as ``out=`` (memcpy writes into a preallocated buffer too);
  ``--no-out`` times the allocating calls, which on CPU adds the page faults
  of fresh memory (on the development VM that is several times the kernel).
  Decode reads an (E, C, M) buffer dispatched without gates (Tutel's
  ``is_postscore``: the gates are applied once, at decode).
* ``memcpy``: a plain copy of a buffer of ``bytes / 2`` into another (so that
  it reads and writes the kernel's ``bytes``), ``numpy.copyto`` and torch
  ``copy_`` (on CUDA torch only); the faster of the two is the reference.
* ``index``: the same result from torch index ops on routing tables computed
  independently with torch (a stable argsort of the choices): encode
  ``out = zeros(E*C, M); out.index_copy_(0, rows, (x.index_select(0, src) * g).to(dtype))``;
  decode ``acc = zeros(T, M, float32); acc.index_add_(0, src, d.index_select(0, rows) * g); acc.to(dtype)``;
  permute ``order = argsort(indices.t().reshape(-1), stable=True); x.index_select(0, order % T)``
  (the sort is timed, as a2a.permute routes); unpermute ``index_add_`` as decode.
* ``einsum``: GShard's dense dispatch / combine (Tutel Fig. 20a),
  ``einsum('tec,tm->ecm', mask, x)`` and ``einsum('tec,ecm->tm', mask, d)``,
  with the dense (T, E, C) mask (gates at the kept slots) built outside the
  timed region; encode and decode only. It costs T*E*C*M multiply-adds and
  T*E*C elements of memory, so it is skipped ('-') above ``--einsum-max``
  MACs (default 2e11), when a short probe of the same einsum predicts more than
  ``--einsum-max-seconds`` per call (default 2; bfloat16 matmuls are slow on
  CPUs without native bfloat16), or when the mask does not fit ``--max-gib``.

Columns: ``bytes`` is what the kernel must read plus write, computed
analytically from the routing (data rows and gates; the int64 routing tables
are not counted): encode ``kept*M*s + E*C*M*s + T*k*g``; decode ``kept*M*s +
T*M*s + T*k*g``; permute ``2*N*M*s``; unpermute ``N*M*s + T*M*s + T*k*g``
(s: the dtype's size, g: 4 for the float32 gates, 0 with ``--no-gates``;
kept: choices that fit their expert's capacity; N: routed choices).
``time`` is the median over ``-r`` repetitions of the mean over ``-n``
back-to-back calls, in microseconds; within each repetition a2a, index,
memcpy and einsum take turns, so the ratios compare like with like on a busy
machine. ``GB/s = bytes / time`` (GB = 1e9 B); ``memcpy`` the reference's GB/s;
``vs memcpy = GB/s / memcpy GB/s``; ``vs index`` and ``vs einsum`` are the
baselines' times divided by a2a's (above 1: a2a is faster). ``#wrong``: each
op's output is compared once (before timing) with the index result:
exactly for encode and permute (no sums), and with ``torch.isclose`` for
decode and unpermute (rtol 1e-5 float32, 1e-2 bfloat16, 2e-3 float16, 1e-12
float64); a routing capacity that differs from the rule also counts. The
exit status is 1 when anything was wrong.

Inputs: indices are top-k distinct experts per token, uniformly random (seed
``--seed``); gates a softmax over the k choices (float32); x uniform in
[-1, 1). Configurations whose buffers would exceed ``--max-gib`` (estimated
peak: inputs, outputs, the baselines' temporaries and the memcpy buffers) are
skipped with a ``# skipped`` line and a JSON row whose ``skipped`` says why.

Threads (CPU): ``--threads N`` sets ``A2A_NUM_THREADS`` before the first a2a
kernel call of the process (the core reads it once) and ``torch.set_num_threads(N)``
for the baselines; the default is every core. On CUDA (``--device cuda``, the
default when torch sees a GPU and a2a was built with CUDA) everything runs
on the current stream and is timed with ``torch.cuda.Event``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import platform
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import common

__all__ = [
    "OPS",
    "build_parser",
    "capacity_for",
    "einsum_macs",
    "format_row",
    "header_lines",
    "is_kernel_mode",
    "main",
    "moved_bytes",
    "parse_args",
]

OPS = ("encode", "decode", "permute", "unpermute")
DTYPE_SIZES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}
_DTYPE_ALIASES = {
    "fp32": "float32",
    "float": "float32",
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "fp64": "float64",
    "double": "float64",
}
# Tolerances of the decode / unpermute check: (rtol, atol). Both sides
# accumulate in float32 (float64) and round once; they may differ by an FMA
# and one rounding of the result.
TOLERANCES = {
    "float32": (1e-5, 1e-6),
    "float64": (1e-12, 1e-14),
    "bfloat16": (1e-2, 1e-3),
    "float16": (2e-3, 1e-4),
}
GATE_SIZE = 4  # float32 gates
DEFAULT_EINSUM_MAX = 2e11
AUTO_ITERS_TARGET_S = 0.05  # -n auto: calls per timing so that one timing takes about this long
AUTO_ITERS_MAX = 100
EINSUM_TIMING_MAX_S = 1.0  # einsum: fewer calls per timing, to at most about this long
EINSUM_PROBE_S = 0.05  # the einsum probe grows until one call takes this long


def is_kernel_mode(argv: list[str]) -> bool:
    """Whether argv asks for the kernel benchmark (has --op)."""
    for token in argv:
        if token == "--":
            return False
        if token == "--op" or token.startswith("--op="):
            return True
    return False


# ---------------------------------------------------------------------------
# Pure helpers (unit tested)


def capacity_for(tokens: int, experts: int, top_k: int, factor: float, max_count: int) -> int:
    """The capacity a2a.route must pick (docs/moe_kernels.md, Tutel's rule):
    factor > 0: ceil(k*factor*T/E); 0: the largest per-expert count; < 0: that,
    but at most ceil(k*(-factor)*T/E)."""
    if factor > 0:
        return max(1, math.ceil(top_k * factor * tokens / experts))
    if factor == 0:
        return max(1, max_count)
    return max(1, min(max_count, math.ceil(top_k * -factor * tokens / experts)))


def moved_bytes(
    op: str,
    *,
    tokens: int,
    experts: int,
    top_k: int,
    model_dim: int,
    itemsize: int,
    capacity: int | None,
    kept: int,
    routed: int,
    gates: bool = True,
) -> int:
    """Bytes the kernel reads plus writes (data rows and gates, not the routing tables)."""
    row = model_dim * itemsize
    gate_bytes = tokens * top_k * GATE_SIZE if gates else 0
    if op == "encode":
        assert capacity is not None
        return kept * row + experts * capacity * row + gate_bytes
    if op == "decode":
        return kept * row + tokens * row + gate_bytes
    if op == "permute":
        return 2 * routed * row
    if op == "unpermute":
        return routed * row + tokens * row + gate_bytes
    raise ValueError(f"unknown op {op!r}")


def einsum_macs(tokens: int, experts: int, capacity: int, model_dim: int) -> int:
    """Multiply-adds of GShard's dense dispatch or combine einsum."""
    return tokens * experts * capacity * model_dim


@dataclass(frozen=True)
class OpSize:
    """The sizes one op of one configuration works on (moved_bytes' arguments)."""

    op: str
    tokens: int
    experts: int
    top_k: int
    model_dim: int
    itemsize: int
    capacity: int | None  # None for the dropless permute / unpermute
    kept: int  # choices that fit their expert's capacity (every routed one when dropless)
    routed: int

    def moved_bytes(self, gates: bool) -> int:
        return moved_bytes(**dataclasses.asdict(self), gates=gates)

    def footprint_bytes(self, nbytes: int) -> int:
        """Estimated peak bytes of the op, without the einsum: x, the op's
        input (decode: the (E, C, M) buffer, unpermute: the (N, M) rows), the
        memcpy buffers (nbytes), a2a's and the index baseline's outputs, and the
        baseline's temporaries (gathered rows, their product with the gates in
        float32, the float32 sum)."""
        acc = 8 if self.itemsize == 8 else 4
        s, m, tokens, routed = self.itemsize, self.model_dim, self.tokens, self.routed
        wide = acc if s != acc else 0  # a copy in the accumulator type, for 16-bit data
        x = tokens * m * s
        if self.op == "encode":
            out = self.experts * (self.capacity or 0) * m * s
            temps = self.kept * m * (s + wide)
            return x + nbytes + 2 * out + temps
        if self.op == "decode":
            d = self.experts * (self.capacity or 0) * m * s
            out = tokens * m * s
            temps = self.kept * m * (s + wide) + tokens * m * wide
            return x + d + nbytes + 2 * out + temps
        if self.op == "permute":
            out = routed * m * s
            return x + nbytes + 2 * out + routed * 32
        if self.op == "unpermute":
            y_sorted = routed * m * s
            out = tokens * m * s
            temps = routed * m * acc + tokens * m * wide
            return x + y_sorted + nbytes + 2 * out + temps
        raise ValueError(f"unknown op {self.op!r}")

    def einsum_footprint_bytes(self) -> int:
        """The dense mask (and a transposed copy einsum may make) plus its output."""
        capacity = self.capacity or 0  # the einsum runs for the padded ops only
        mask = self.tokens * self.experts * capacity * self.itemsize
        out = (self.experts * capacity if self.op == "encode" else self.tokens) * self.model_dim * self.itemsize
        return 2 * mask + 2 * out


# ---------------------------------------------------------------------------
# Command line


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


# ---------------------------------------------------------------------------
# Output

_COLUMNS = (
    "{:>9}  {:>6}  {:>4}  {:>2}  {:>5}  {:>8}  {:>5}  {:>11}  {:>9}  {:>6}  {:>6}  {:>6}  {:>7}  {:>7}  {:>6}"
)
_NAMES = (
    ("op", ""),
    ("T", ""),
    ("E", ""),
    ("k", ""),
    ("M", ""),
    ("dtype", ""),
    ("C", ""),
    ("bytes", "(B)"),
    ("time", "(us)"),
    ("GB/s", ""),
    ("memcpy", "(GB/s)"),
    ("vs", "memcpy"),
    ("vs", "index"),
    ("vs", "einsum"),
    ("#wrong", ""),
)


def header_lines() -> list[str]:
    def line(cells: list[str]) -> str:
        return ("#" + _COLUMNS.format(*cells)[1:]).rstrip()

    return [line([a for a, _ in _NAMES]), line([b for _, b in _NAMES])]


def _ratio(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_row(row: dict) -> str:
    return _COLUMNS.format(
        row["op"],
        row["tokens"],
        row["experts"],
        row["top_k"],
        row["model_dim"],
        row["dtype"],
        "-" if row["capacity"] is None else row["capacity"],
        row["bytes"],
        common.format_time(row["time_us"], width=0),
        f"{row['gbps']:.2f}",
        f"{row['memcpy_gbps']:.2f}",
        _ratio(row["vs_memcpy"]),
        "-" if row["vs_index"] is None else f"{row['vs_index']:.2f}x",
        "-" if row["vs_einsum"] is None else f"{row['vs_einsum']:.1f}x",
        row["wrong"],
    )


def footer_lines(rows: list[dict], ops: list[str]) -> list[str]:
    done = [r for r in rows if not r.get("skipped")]
    wrong = sum(r["wrong"] for r in done)
    lines = [common.out_of_bounds_line(wrong)]
    skipped = len(rows) - len(done)
    if skipped:
        lines.append(f"# Skipped configurations: {skipped} (see the '# skipped' lines)")
    lines.append("#")
    for op in ops:
        mine = [r for r in done if r["op"] == op]
        if not mine:
            continue
        parts = [
            f"#   {op:<9} {len(mine):3d} rows  geomean: vs memcpy {_ratio(common.geomean([r['vs_memcpy'] for r in mine]))}"
        ]
        vi = common.geomean([r["vs_index"] for r in mine if r["vs_index"]])
        parts.append(f"vs index {_ratio(vi)}x" if vi else "vs index -")
        ve = [r["vs_einsum"] for r in mine if r["vs_einsum"]]
        parts.append(f"vs einsum {common.geomean(ve):.1f}x ({len(ve)} rows)" if ve else "vs einsum -")
        lines.append(", ".join(parts))
    lines.append("#")
    return lines


# ---------------------------------------------------------------------------
# Timing


@dataclass
class Timed:
    """One function to time, and its samples."""

    name: str
    run: Callable[[], Any]
    iters: int = 1
    max_seconds: float | None = None  # hold the calls per timing to about this long
    samples: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.samples)


def _measure(cases: list[Timed], clock: common.Clock, args: argparse.Namespace) -> None:
    """Warm-up, then -r repetitions in which the cases take turns."""
    for case in cases:
        one = None
        for _ in range(args.warmup):
            one = clock.time(case.run, 1)
        n = args.iters
        if n is None or case.max_seconds is not None:
            if one is None:
                one = clock.time(case.run, 1)
            if n is None:
                n = max(1, min(AUTO_ITERS_MAX, int(AUTO_ITERS_TARGET_S / max(one, 1e-9))))
            if case.max_seconds is not None:
                n = max(1, min(n, int(case.max_seconds / max(one, 1e-9))))
        case.iters = n
    timings = [functools.partial(clock.time, case.run, case.iters) for case in cases]
    for case, samples in zip(cases, common.take_turns(timings, args.repeats)):
        case.samples = samples


# ---------------------------------------------------------------------------
# The benchmark


class _Env:
    """torch, a2a, the device and helpers shared by all configurations."""

    def __init__(self, args: argparse.Namespace):
        import torch

        import a2a

        self.torch = torch
        self.a2a = a2a
        self.args = args
        self.device = args.device
        self.clock = common.Clock(torch, args.device)
        self.gen = torch.Generator().manual_seed(args.seed)

    def dtype(self, name: str) -> Any:
        return getattr(self.torch, name)

    def acc_dtype(self, name: str) -> Any:
        return self.torch.float64 if name == "float64" else self.torch.float32

    def to_dev(self, t: Any) -> Any:
        return t.to(self.device) if self.device != "cpu" else t

    def as_torch(self, value: Any) -> Any:
        if isinstance(value, self.torch.Tensor):
            return value.to(self.device)
        return self.to_dev(self.torch.as_tensor(np.asarray(value)))


def _random_indices(env: _Env, tokens: int, experts: int, top_k: int) -> Any:
    """(T, k) int64: k distinct experts per token, uniformly random."""
    torch = env.torch
    out = torch.empty((tokens, top_k), dtype=torch.int64)
    chunk = 1 << 16
    for start in range(0, tokens, chunk):
        n = min(chunk, tokens - start)
        out[start : start + n] = torch.rand((n, experts), generator=env.gen).topk(top_k, dim=1).indices
    return env.to_dev(out)


def _random_data(env: _Env, tokens: int, model_dim: int, dtype: str) -> Any:
    torch = env.torch
    work = torch.float64 if dtype == "float64" else torch.float32
    x = torch.empty((tokens, model_dim), dtype=work).uniform_(-1.0, 1.0, generator=env.gen)
    return env.to_dev(x).to(env.dtype(dtype))


@dataclass
class Reference:
    """Routing tables computed with torch alone (a stable argsort of the choices in Tutel's slot order)."""

    capacity: int
    row_map: Any  # (T, k) int64, -1 when dropped: row in the (E*C, M) buffer
    kept_choices: Any  # flat (t*k + j) of kept choices, in (t, j) order
    kept_rows: Any
    kept_tokens: Any
    order: Any  # dropless: order[r] = j*T + t of the choice at row r
    counts: Any


def _reference_routing(env: _Env, indices: Any, experts: int, factor: float) -> Reference:
    torch = env.torch
    tokens, top_k = indices.shape
    by_choice = indices.t().reshape(-1)  # j*T + t: first choices of every token, then second ones
    order = torch.argsort(by_choice, stable=True)
    counts = torch.bincount(by_choice, minlength=experts)
    starts = torch.cumsum(counts, 0) - counts
    slot = torch.empty_like(order)
    slot[order] = torch.arange(order.numel(), device=order.device) - starts[by_choice[order]]
    capacity = capacity_for(tokens, experts, top_k, factor, int(counts.max()))
    loc = slot.view(top_k, tokens).t()  # (T, k)
    row_map = torch.where(loc < capacity, indices * capacity + loc, torch.full_like(loc, -1))
    flat = row_map.reshape(-1)
    kept = torch.nonzero(flat >= 0).squeeze(1)
    return Reference(capacity, row_map, kept, flat[kept], kept // top_k, order, counts)


def _count_wrong(got: Any, want: Any, exact: bool, dtype: str, torch: Any) -> int:
    """Elements of got that differ from want, in chunks of rows (little extra memory)."""
    if tuple(got.shape) != tuple(want.shape) or got.dtype != want.dtype:
        return max(got.numel(), want.numel())
    if torch.equal(got, want):  # one fast pass in the common case
        return 0
    got = got.reshape(want.shape[0], -1) if want.dim() else got
    want = want.reshape(want.shape[0], -1) if want.dim() else want
    rtol, atol = TOLERANCES[dtype]
    wrong = 0
    chunk = max(1, (1 << 24) // max(1, want.shape[1]))
    for start in range(0, want.shape[0], chunk):
        a, b = got[start : start + chunk], want[start : start + chunk]
        if exact:
            wrong += int((a != b).sum())
        else:
            wide = torch.float64 if dtype == "float64" else torch.float32
            wrong += int((~torch.isclose(a.to(wide), b.to(wide), rtol=rtol, atol=atol)).sum())
    return wrong


class _Config:
    """One (T, E, k, M, dtype, capacity factor): the shared inputs and the routing."""

    def __init__(self, env: _Env, x: Any, indices: Any, gates: Any, experts: int, dtype: str, factor: float):
        self.env = env
        self.x = x
        self.indices = indices
        self.gates = gates
        self.tokens, self.model_dim = x.shape
        self.top_k = indices.shape[1]
        self.experts = experts
        self.dtype = dtype
        self.factor = factor
        self.ref = _reference_routing(env, indices, experts, factor)
        self._routing: Any = None
        self._dispatched: Any = None
        self._sorted: Any = None

    @property
    def routing(self) -> Any:
        if self._routing is None:
            a2a = self.env.a2a
            self._routing = a2a.route(self.indices, self.experts, capacity_setting=self.factor)
        return self._routing

    @property
    def kept(self) -> int:
        return int(self.ref.kept_choices.numel())

    @property
    def routed(self) -> int:
        return self.tokens * self.top_k

    # -- torch index-op versions (the baselines and the reference results) --

    # Products with the gates are formed in the accumulator type (float32,
    # float64 for float64), as the kernels do, with as few temporaries as
    # torch allows: a mixed-dtype product would first copy its input to float32.

    def _gated(self, rows: Any, gates: Any, fresh: bool) -> Any:
        """rows * gates[:, None] in the accumulator type; rows may be overwritten when fresh."""
        acc_t = self.env.acc_dtype(self.dtype)
        if rows.dtype != acc_t:
            rows, fresh = rows.to(acc_t), True
        if gates is None:
            return rows
        g = gates.to(acc_t).unsqueeze(1)
        return rows.mul_(g) if fresh else rows * g

    def index_encode(self, x: Any, out: Any = None) -> Any:
        torch, ref = self.env.torch, self.ref
        shape = (self.experts * ref.capacity, self.model_dim)
        out = torch.zeros(shape, dtype=x.dtype, device=x.device) if out is None else out.view(shape).zero_()
        picked = x.index_select(0, ref.kept_tokens)
        if self.gates is not None:
            picked = self._gated(picked, self.gates.reshape(-1)[ref.kept_choices], fresh=True).to(x.dtype)
        out.index_copy_(0, ref.kept_rows, picked)
        return out.view(self.experts, ref.capacity, self.model_dim)

    def _weighted_sum(self, tokens: Any, rows: Any, gates: Any, fresh: bool, like: Any, out: Any) -> Any:
        """y[tokens[i]] += gates[i] * rows[i] in the accumulator type, then y in like's dtype (into out)."""
        torch = self.env.torch
        acc_t = self.env.acc_dtype(self.dtype)
        if out is not None and out.dtype == acc_t:
            acc = out.zero_()
        else:
            acc = torch.zeros((self.tokens, self.model_dim), dtype=acc_t, device=like.device)
        acc.index_add_(0, tokens, self._gated(rows, gates, fresh))
        if out is None:
            return acc.to(like.dtype)
        if acc is not out:
            out.copy_(acc)
        return out

    def index_decode(self, d: Any, out: Any = None) -> Any:
        ref = self.ref
        rows = d.reshape(-1, self.model_dim).index_select(0, ref.kept_rows)
        gates = None if self.gates is None else self.gates.reshape(-1)[ref.kept_choices]
        return self._weighted_sum(ref.kept_tokens, rows, gates, True, d, out)

    def index_permute(self, x: Any, out: Any = None) -> Any:
        torch = self.env.torch
        order = torch.argsort(self.indices.t().reshape(-1), stable=True)
        if out is None:
            return x.index_select(0, order % self.tokens)
        return torch.index_select(x, 0, order % self.tokens, out=out)

    def index_unpermute(self, y_sorted: Any, out: Any = None) -> Any:
        ref = self.ref
        gates = None if self.gates is None else self.gates.t().reshape(-1)[ref.order]
        return self._weighted_sum(ref.order % self.tokens, y_sorted, gates, False, y_sorted, out)

    # -- inputs of decode and unpermute (built once, with the reference) --

    def dispatched(self) -> Any:
        if self._dispatched is None:
            saved, self.gates = self.gates, None  # Tutel's is_postscore: gates applied once, at decode
            try:
                self._dispatched = self.index_encode(self.x)
            finally:
                self.gates = saved
        return self._dispatched

    def y_sorted(self) -> Any:
        if self._sorted is None:
            self._sorted = self.index_permute(self.x)
        return self._sorted

    def release(self) -> None:
        self._dispatched = None
        self._sorted = None

    # -- GShard's dense einsum --

    def dense_mask(self) -> Any:
        torch, ref = self.env.torch, self.ref
        mask = torch.zeros(
            (self.tokens, self.experts, ref.capacity), dtype=self.x.dtype, device=self.x.device
        )
        loc = ref.row_map.reshape(-1)[ref.kept_choices] % ref.capacity
        expert = self.indices.reshape(-1)[ref.kept_choices]
        weight = (
            self.gates.reshape(-1)[ref.kept_choices].to(self.x.dtype)
            if self.gates is not None
            else torch.ones(loc.shape, dtype=self.x.dtype, device=self.x.device)
        )
        mask[ref.kept_tokens, expert, loc] = weight
        return mask


def _bench_op(env: _Env, cfg: _Config, op: str, base: dict, say: Callable[[str], None]) -> dict:
    """Checks and times one op of one configuration; returns its row."""
    torch, a2a, args = env.torch, env.a2a, env.args
    padded = op in ("encode", "decode")
    capacity = cfg.ref.capacity if padded else None
    kept = cfg.kept if padded else cfg.routed
    size = OpSize(op, cfg.tokens, cfg.experts, cfg.top_k, cfg.model_dim, DTYPE_SIZES[cfg.dtype], capacity, kept, cfg.routed)
    nbytes = size.moved_bytes(gates=args.gates and op != "permute")
    row = dict(
        base, op=op, capacity=capacity, kept=kept, dropped=cfg.routed - kept if padded else 0, bytes=nbytes
    )
    row["gates"] = bool(args.gates and op != "permute")
    need = size.footprint_bytes(nbytes)
    row["footprint_gib"] = need / 2**30
    budget = args.max_gib * 2**30
    if need > budget:
        reason = f"needs about {need / 2**30:.1f} GiB > --max-gib {args.max_gib:g}"
        say(
            f"# skipped: {op} T={cfg.tokens} E={cfg.experts} k={cfg.top_k} M={cfg.model_dim} {cfg.dtype}: {reason}"
        )
        return dict(row, skipped=reason, wrong=0)

    gates = cfg.gates
    wrong = 0
    notes: list[str] = []
    if padded:
        routing = cfg.routing
        got_c = getattr(routing, "capacity", None)
        if got_c != cfg.ref.capacity:
            notes.append(f"a2a.route capacity {got_c} != {cfg.ref.capacity}")
            wrong += 1

    dt = env.dtype(cfg.dtype)
    out_rows = {"encode": cfg.experts * cfg.ref.capacity, "permute": cfg.routed}.get(op, cfg.tokens)

    def buffers() -> tuple[Any, Any]:
        """(a2a's out, the baseline's out), or (None, None) with --no-out."""
        if not args.out:
            return None, None
        return tuple(torch.empty((out_rows, cfg.model_dim), dtype=dt, device=env.device) for _ in range(2))

    # a2a's call and the torch index ops giving the same result, each into its out.
    k_out, i_out = buffers()
    if op == "encode":
        kernel = functools.partial(a2a.fast_encode, cfg.x, routing, gates, out=k_out)
        index = functools.partial(cfg.index_encode, cfg.x, i_out)
    elif op == "decode":
        d = cfg.dispatched()
        kernel = functools.partial(a2a.fast_decode, d, routing, gates, out=k_out)
        index = functools.partial(cfg.index_decode, d, i_out)
    elif op == "permute":
        permute = functools.partial(a2a.permute, cfg.x, cfg.indices, cfg.experts, out=k_out)

        def kernel() -> Any:
            return permute()[0]

        index = functools.partial(cfg.index_permute, cfg.x, i_out)
    else:
        y_sorted = cfg.y_sorted()
        perm = a2a.permute(cfg.x, cfg.indices, cfg.experts)[1]
        kernel = functools.partial(a2a.unpermute, y_sorted, perm, gates, out=k_out)
        index = functools.partial(cfg.index_unpermute, y_sorted, i_out)
    exact = op in ("encode", "permute")  # no sums: compared bit for bit

    # The check (also the first warm-up call of both).
    got, want = kernel(), index()
    env.clock.sync()
    got_t = env.as_torch(got)
    wrong += _count_wrong(got_t, want, exact, cfg.dtype, torch)
    del got, got_t, want

    # memcpy of the same bytes: bytes/2 read, bytes/2 written.
    half = max(1, nbytes // 2)
    cases = [Timed("a2a", kernel), Timed("index", index)]
    if env.device == "cpu":
        src_np = np.ones(half, dtype=np.uint8)
        dst_np = np.ones_like(src_np)  # touched now: no page faults in the timed copies
        src_t, dst_t = torch.from_numpy(src_np), torch.from_numpy(dst_np)
        cases.append(Timed("memcpy_numpy", lambda: np.copyto(dst_np, src_np)))
    else:
        src_t = torch.ones(half, dtype=torch.uint8, device=env.device)
        dst_t = torch.ones_like(src_t)
    cases.append(Timed("memcpy_torch", lambda: dst_t.copy_(src_t)))

    # The dense einsum, where it is cheap enough.
    macs = einsum_macs(cfg.tokens, cfg.experts, cfg.ref.capacity, cfg.model_dim) if padded else None
    einsum_skip = _einsum_skip(env, cfg, size, macs, need, budget)
    mask = None
    if einsum_skip is None:
        mask = cfg.dense_mask()
        operand = cfg.x if op == "encode" else cfg.dispatched()
        spec = "tec,tm->ecm" if op == "encode" else "tec,ecm->tm"
        cases.append(
            Timed("einsum", lambda: torch.einsum(spec, mask, operand), max_seconds=EINSUM_TIMING_MAX_S)
        )

    _measure(cases, env.clock, args)
    times = {c.name: c.median for c in cases}
    iters = {c.name: c.iters for c in cases}
    del cases
    cfg.release()  # the input of decode / unpermute: every op builds its own, so at most one is alive

    t = times["a2a"]
    memcpy_t = min(v for k, v in times.items() if k.startswith("memcpy"))
    row.update(
        time_us=t * 1e6,
        gbps=nbytes / t / 1e9,
        memcpy_us=memcpy_t * 1e6,
        memcpy_gbps=nbytes / memcpy_t / 1e9,
        memcpy_numpy_us=times["memcpy_numpy"] * 1e6 if "memcpy_numpy" in times else None,
        memcpy_torch_us=times["memcpy_torch"] * 1e6,
        vs_memcpy=memcpy_t / t,
        index_us=times["index"] * 1e6,
        vs_index=times["index"] / t,
        einsum_us=times["einsum"] * 1e6 if "einsum" in times else None,
        vs_einsum=times["einsum"] / t if "einsum" in times else None,
        einsum_macs=macs,
        einsum_skipped=einsum_skip,
        iters=iters,
        wrong=wrong,
        notes=notes,
        skipped=None,
    )
    for note in notes:
        say(
            f"# note: {op} T={cfg.tokens} E={cfg.experts} k={cfg.top_k} M={cfg.model_dim} {cfg.dtype}: {note}"
        )
    return row


_probe_cache: dict[tuple, float] = {}


def _einsum_skip(env: _Env, cfg: _Config, size: OpSize, macs: int | None, need: int, budget: float) -> str | None:
    """Why the einsum of this row is not run, or None."""
    args = env.args
    if macs is None:
        return "not applicable"
    if not args.einsum:
        return "--no-einsum"
    if macs > args.einsum_max:
        return f"{macs:.2g} MACs > --einsum-max {args.einsum_max:g}"
    extra = size.einsum_footprint_bytes()
    if need + extra > budget:
        return f"the dense mask needs about {(need + extra) / 2**30:.1f} GiB > --max-gib {args.max_gib:g}"
    rate = _einsum_rate(env, cfg, size.op)
    if macs / rate > args.einsum_max_seconds:
        return (
            f"a probe predicts {macs / rate:.0f} s per call ({rate / 1e9:.2g} GMAC/s) > "
            f"--einsum-max-seconds {args.einsum_max_seconds:g}"
        )
    return None


def _einsum_rate(env: _Env, cfg: _Config, op: str) -> float:
    """MACs per second of this einsum, timed on T/256 tokens, then 4x more at a
    time until a call takes EINSUM_PROBE_S (a matmul on few tokens is slower per
    MAC, so the estimate errs on the slow side)."""
    torch = env.torch
    e, c, m = cfg.experts, cfg.ref.capacity, cfg.model_dim
    key = (op, cfg.dtype, cfg.tokens, e, c, m)
    if key in _probe_cache:
        return _probe_cache[key]
    dt = env.dtype(cfg.dtype)
    probe_t = max(1, math.ceil(cfg.tokens / 256))
    while True:
        mask = torch.zeros((probe_t, e, c), dtype=dt, device=env.device)
        if op == "encode":
            operand = torch.zeros((probe_t, m), dtype=dt, device=env.device)
            spec = "tec,tm->ecm"
        else:
            operand = torch.zeros((e, c, m), dtype=dt, device=env.device)
            spec = "tec,ecm->tm"
        call = functools.partial(torch.einsum, spec, mask, operand)
        env.clock.time(call, 1)  # warm-up
        seconds = env.clock.time(call, 1)
        if seconds >= EINSUM_PROBE_S or probe_t >= cfg.tokens:
            break
        probe_t = min(cfg.tokens, probe_t * 4)
    rate = probe_t * e * c * m / max(seconds, 1e-9)
    _probe_cache[key] = rate
    return rate


def _device_description(env: _Env) -> str:
    if env.device == "cuda":
        torch = env.torch
        return f"cuda: {torch.cuda.get_device_name()} (device {torch.cuda.current_device()})"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"cpu: {cpu}, {os.cpu_count()} cores"


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    # The core reads A2A_NUM_THREADS once, at its first kernel call.
    if args.threads is not None:
        os.environ["A2A_NUM_THREADS"] = str(args.threads)
    try:
        import torch
    except ImportError:
        print("a2a.bench --op: needs torch (the baselines are torch ops): pip install torch", file=sys.stderr)
        return 2
    import a2a

    missing = [
        name
        for name in ("route", "fast_encode", "fast_decode", "permute", "unpermute")
        if not hasattr(a2a, name)
    ]
    if missing:
        print(f"a2a.bench --op: this a2a has no {', '.join(missing)}", file=sys.stderr)
        return 2
    error = common.resolve_device(args)
    if error:
        print(f"a2a.bench {error}", file=sys.stderr)
        return 2
    threads = args.threads or int(os.environ.get("A2A_NUM_THREADS") or 0) or (os.cpu_count() or 1)
    if args.device == "cpu":
        torch.set_num_threads(threads)
    env = _Env(args)

    def say(text: str = "") -> None:
        print(text, flush=True)

    command = common.command_line(argv)
    timestamp = common.utc_timestamp()
    iters = "auto (about 50 ms per timing)" if args.iters is None else str(args.iters)
    say(f"# a2a MoE kernel benchmark: {command}")
    say(
        f"# a2a {a2a.__version__}, torch {torch.__version__}, numpy {np.__version__}, Python {platform.python_version()}"
    )
    say(f"# device {_device_description(env)}")
    if args.device == "cpu":
        source = (
            f"A2A_NUM_THREADS={os.environ['A2A_NUM_THREADS']}"
            if os.environ.get("A2A_NUM_THREADS")
            else "every core"
        )
        say(
            f"# threads: {threads} for a2a ({source}), torch.set_num_threads({torch.get_num_threads()}) "
            "for the baselines"
        )
    say(
        f"# ops: {' '.join(args.ops)}; tokens {_join(args.tokens)}; experts {_join(args.experts)}; "
        f"model dim {_join(args.model_dim)}; top-k {_join(args.top_k)}; dtypes {' '.join(args.dtypes)}; "
        f"capacity factor {_join(args.capacity_factor)}; gates {'float32' if args.gates else 'none'}"
    )
    say(
        f"# repeats {args.repeats} (median; a2a, index, memcpy, einsum take turns), iters {iters}, warmup {args.warmup}"
    )
    say(
        "# outputs: "
        + (
            "preallocated (out=) for a2a and the index ops, as for memcpy"
            if args.out
            else "allocated by every call (--no-out)"
        )
    )
    say(
        "# bytes: read + written by the kernel (data rows, gates); GB = 1e9 B; vs memcpy = GB/s / memcpy GB/s"
    )
    say(
        "# memcpy: the faster of numpy.copyto and torch copy_ of bytes/2 into another buffer, in the same run"
    )
    say(
        "# vs index / vs einsum: time of the torch index ops / GShard dense einsum divided by a2a's (x faster)"
    )
    if args.einsum:
        say(
            f"# einsum: encode and decode; '-' above --einsum-max {args.einsum_max:g} MACs, a predicted "
            f"{args.einsum_max_seconds:g} s per call, or --max-gib"
        )
    say(f"# memory budget --max-gib {args.max_gib:g}")
    say("#")
    for line in header_lines():
        say(line)

    base = {
        "device": args.device,
        "threads": threads if args.device == "cpu" else None,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "out": args.out,
        "command": command,
        "timestamp": timestamp,
    }
    rows: list[dict] = []
    for dtype in args.dtypes:
        for tokens in args.tokens:
            for model_dim in args.model_dim:
                rows += _sweep_shape(env, tokens, model_dim, dtype, base, say)
    for line in footer_lines(rows, args.ops):
        say(line)
    if args.json:
        common.write_json(args.json, rows)
    return 1 if any(r["wrong"] for r in rows) else 0


def _sweep_shape(env: _Env, tokens: int, model_dim: int, dtype: str, base: dict, say: Callable) -> list[dict]:
    """The rows of one (T, M, dtype): every E, k, capacity factor and op, on one x."""
    torch, args = env.torch, env.args
    rows = []
    x_bytes = tokens * model_dim * DTYPE_SIZES[dtype]
    x = _random_data(env, tokens, model_dim, dtype) if x_bytes <= args.max_gib * 2**30 else None
    for experts in args.experts:
        for top_k in args.top_k:
            for factor in args.capacity_factor:
                shape = dict(base, tokens=tokens, experts=experts, top_k=top_k)
                shape.update(model_dim=model_dim, dtype=dtype, capacity_factor=factor)
                if x is None:
                    reason = f"x alone needs {x_bytes / 2**30:.1f} GiB > --max-gib {args.max_gib:g}"
                    for op in args.ops:
                        say(
                            f"# skipped: {op} T={tokens} E={experts} k={top_k} M={model_dim} {dtype}: {reason}"
                        )
                        rows.append(dict(shape, op=op, capacity=None, bytes=None, skipped=reason, wrong=0))
                    continue
                indices = _random_indices(env, tokens, experts, top_k)
                gates = None
                if args.gates:
                    gates = env.to_dev(torch.rand((tokens, top_k), generator=env.gen).softmax(dim=1))
                cfg = _Config(env, x, indices, gates, experts, dtype, factor)
                for op in args.ops:
                    row = _bench_op(env, cfg, op, shape, say)
                    if not row.get("skipped"):
                        say(format_row(row))
                    rows.append(row)
                del cfg
    return rows


def _join(values: list) -> str:
    return ",".join(f"{v:g}" if isinstance(v, float) else str(v) for v in values)
