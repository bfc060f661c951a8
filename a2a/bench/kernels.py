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

The sizes (capacity, bytes, footprint) are in kernels_sizes.py, the parser
in kernels_options.py, the table in kernels_table.py, the torch baselines
and the reference results in kernels_baselines.py; here, the timing, the
check and the run.
"""

from __future__ import annotations

import argparse
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
from .kernels_baselines import Config, Env, random_data, random_indices
from .kernels_options import OPS, build_parser, parse_args
from .kernels_sizes import DTYPE_SIZES, OpSize, capacity_for, einsum_macs, moved_bytes
from .kernels_table import footer_lines, format_row, header_lines

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

# Tolerances of the decode / unpermute check: (rtol, atol). Both sides
# accumulate in float32 (float64) and round once; they may differ by an FMA
# and one rounding of the result.
TOLERANCES = {
    "float32": (1e-5, 1e-6),
    "float64": (1e-12, 1e-14),
    "bfloat16": (1e-2, 1e-3),
    "float16": (2e-3, 1e-4),
}
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


def _bench_op(env: Env, cfg: Config, op: str, base: dict, say: Callable[[str], None]) -> dict:
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


def _einsum_skip(env: Env, cfg: Config, size: OpSize, macs: int | None, need: int, budget: float) -> str | None:
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


def _einsum_rate(env: Env, cfg: Config, op: str) -> float:
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


def _device_description(env: Env) -> str:
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
    env = Env(args)

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


def _sweep_shape(env: Env, tokens: int, model_dim: int, dtype: str, base: dict, say: Callable) -> list[dict]:
    """The rows of one (T, M, dtype): every E, k, capacity factor and op, on one x."""
    torch, args = env.torch, env.args
    rows = []
    x_bytes = tokens * model_dim * DTYPE_SIZES[dtype]
    x = random_data(env, tokens, model_dim, dtype) if x_bytes <= args.max_gib * 2**30 else None
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
                indices = random_indices(env, tokens, experts, top_k)
                gates = None
                if args.gates:
                    gates = env.to_dev(torch.rand((tokens, top_k), generator=env.gen).softmax(dim=1))
                cfg = Config(env, x, indices, gates, experts, dtype, factor)
                for op in args.ops:
                    row = _bench_op(env, cfg, op, shape, say)
                    if not row.get("skipped"):
                        say(format_row(row))
                    rows.append(row)
                del cfg
    return rows


def _join(values: list) -> str:
    return ",".join(f"{v:g}" if isinstance(v, float) else str(v) for v in values)
