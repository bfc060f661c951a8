"""The command line of the layer mode of ``python -m moe_runtime.bench``:
its presets (the full run, ``--quick``, ``--gpu-step``), its parser and the
checks that refuse a run before it starts (moe_runtime/bench/layer.py
describes every flag's meaning)."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from a2a import launch, sim
from a2a.bench import common

__all__ = ["DEFAULTS", "GPU_STEP", "ISSUE_SIZE", "QUICK", "Case", "build_parser", "cases", "default_np", "layout_error",
           "parse_args"]

DEFAULT_NP = 4  # --device cpu; --device cuda: 1 (one GPU per rank, as python -m a2a.bench)
DEFAULT_LOCAL_SIZE = 2  # with neither --np nor --local-size nor A2A_LOCAL_SIZE: 2 emulated nodes of 2 ranks
ALGOS = ("linear", "2dh")
DTYPES = {"float": "float32", "float32": "float32", "fp32": "float32", "double": "float64",
          "float64": "float64", "fp64": "float64", "bfloat16": "bfloat16", "bf16": "bfloat16"}

# The issue's size: the comparison with GShard, and --gpu-step.
ISSUE_SIZE = {"tokens": 4096, "model_dim": 1024, "hidden": 1024, "experts": 8, "top_k": 2, "factor": 1.0}

# Sizes and counts: the full run, and --quick.
DEFAULTS = {
    "tokens": 256, "model_dim": 1024, "hidden": 1024, "experts": 8, "top_k": 2, "factors": [1.0, 2.0, 4.0, 8.0],
    "degrees": [1, 2, 4, 8], "algos": list(ALGOS), "warmup": 1, "repeats": 3, "tune_repeats": 3,
    "peer_tokens": [4096], "peer_factors": [1.0], "switch_pairs": 15, "dropless_factors": [1.25, 2.0, 4.0],
    "dynamic_steps": 8, "profile": 0,
}
QUICK = {
    "tokens": 64, "model_dim": 32, "hidden": 64, "experts": 8, "top_k": 2, "factors": [1.0, 2.0],
    "degrees": [1, 2], "algos": list(ALGOS), "warmup": 1, "repeats": 1, "tune_repeats": 1,
    "peer_tokens": [128], "peer_factors": [1.0], "switch_pairs": 2, "dropless_factors": [1.25],
    "dynamic_steps": 2, "profile": 0,
}
# --gpu-step: the issue's comparison on one GPU alone, 1 rank (T = 4096 and
# 16384: the step, its expert compute, the graphed step, Tutel, Megatron-Core
# and GShard), bfloat16, no sweep, no dropless or dynamic rows; flags given
# with it still win.
GPU_STEP = {
    **DEFAULTS, "device": "cuda", "np": 1, "dtype": "bfloat16", "tokens": 0,
    "peer_tokens": [ISSUE_SIZE["tokens"], 16384],
    "model_dim": ISSUE_SIZE["model_dim"], "hidden": ISSUE_SIZE["hidden"], "experts": ISSUE_SIZE["experts"],
    "top_k": ISSUE_SIZE["top_k"], "peer_factors": [ISSUE_SIZE["factor"]], "warmup": 3, "repeats": 10,
    "switch_pairs": 0, "dropless_factors": [], "dynamic_steps": 0, "profile": 12,
}


def _int_list(text: str) -> list[int]:
    try:
        return [int(item) for item in text.split(",") if item.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of integers, got {text!r}") from None


def _float_list(text: str) -> list[float]:
    try:
        return [float(item) for item in text.split(",") if item.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of numbers, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m moe_runtime.bench",
        description="Step time (forward + backward) of moe_runtime.MoELayer for every (r, d, algorithm), "
        "the adaptive dictionary's choice, the expert compute alone and a GShard-style peer, in one run.",
        allow_abbrev=False,
    )
    d = DEFAULTS
    p.add_argument("-T", "--tokens", type=int, help=f"tokens per rank of the sweep (default {d['tokens']}; 0: no "
                   "sweep, and no dropless or dynamic rows, which run at these tokens)")
    p.add_argument("-M", "--model-dim", type=int, help=f"model dim M (default {d['model_dim']})")
    p.add_argument("-H", "--hidden", type=int, help=f"hidden size per expert H (default {d['hidden']})")
    p.add_argument("-E", "--experts", type=int,
                   help=f"experts in all, a multiple or a divisor of the ranks (default {d['experts']})")
    p.add_argument("-k", "--top-k", type=int, help=f"experts per token (default {d['top_k']})")
    p.add_argument("-f", "--factors", type=_float_list, help="capacity factors of the sweep, comma list "
                   f"(default {','.join(f'{f:g}' for f in d['factors'])})")
    p.add_argument("--degrees", type=_int_list,
                   help=f"pipelining degrees d, comma list (default {','.join(map(str, d['degrees']))})")
    p.add_argument("--algos", help="all-to-all algorithms, comma list of linear, 2dh (default linear,2dh)")
    p.add_argument("--peer-tokens", type=_int_list, help="tokens per rank of the comparison's cases (GShard, "
                   f"and on one rank Tutel and Megatron-Core), comma list (default "
                   f"{','.join(map(str, d['peer_tokens']))}; 0: none)")
    p.add_argument("--peer-factors", type=_float_list,
                   help=f"capacity factors of those cases (default {','.join(f'{f:g}' for f in d['peer_factors'])})")
    p.add_argument("--dropless-factors", type=_float_list, help="capacity factors at which the capacity "
                   "dispatcher (r1/d1/linear) is timed against the dropless one at --tokens, comma list (default "
                   f"{','.join(f'{f:g}' for f in d['dropless_factors'])}; empty: none)")
    p.add_argument("--dynamic-steps", type=int, help="steps of the skewed routing on which the per-expert dynamic "
                   "capacity is timed against the no-drop static factor and dropless (default "
                   f"{d['dynamic_steps']}; 0: none)")
    p.add_argument("--profile", type=int, metavar="N", help="after each comparison case's timings, where one step "
                   "of each layer spends its time: the N kernels (CUDA) or ops (CPU) with the most self time, "
                   "torch.profiler (default 0: none; --gpu-step 12)")
    p.add_argument("--no-peer", action="store_true", help="skip the GShard peer (its check, rows and cases)")
    p.add_argument("-w", "--warmup", type=int, help=f"untimed steps of each configuration (default {d['warmup']})")
    p.add_argument("-r", "--repeats", type=int,
                   help=f"timed rounds; rows show the median (default {d['repeats']})")
    p.add_argument("--tune-repeats", type=int, help="the dictionary's steps per trial after its one warm-up "
                   f"step (AdaptiveDictionary repeats; default {d['tune_repeats']})")
    p.add_argument("--prior", choices=tuple(sim.PRESETS), help="give the dictionary the scale model's prior "
                   "(a2a.sim preset; default: none) and report the trials it saved")
    p.add_argument("--prior-factor", type=float, default=4.0, help="the prior leaves out (d, algo) predicted more "
                   "than this many times slower than the best of their r (default 4)")
    p.add_argument("--switch-pairs", type=int, help="switches per r that time switching r: a step right after a "
                   "step at another r, then two at the same r (default "
                   f"{d['switch_pairs']}; 0: none)")
    p.add_argument("-d", "--dtype", help="float, bfloat16 or double (default float)")
    p.add_argument("--device", choices=("cpu", "cuda"), help="where the layers, tokens and buffers live: cpu (default) "
                   "or cuda (one GPU per rank, by its rank on its node; default 1 rank)")
    p.add_argument("--transport", choices=("nccl", "mpi"), help="--device cuda: how the exchanges move, nccl "
                   "(default) or mpi (staged through host memory; ranks may share a GPU)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads and A2A_NUM_THREADS per rank (default 1: the ranks share the cores)")
    p.add_argument("--np", type=int, help="ranks to launch under mpirun when not under it (default "
                   f"{DEFAULT_NP}; 1 with --device cuda)")
    p.add_argument("--local-size", type=int, help="emulated ranks per node (A2A_LOCAL_SIZE)")
    presets = p.add_mutually_exclusive_group()
    presets.add_argument("--quick", action="store_true", help="small sizes and counts, for a test run in seconds")
    presets.add_argument("--gpu-step", action="store_true", help="the issue's comparison on a GPU alone: --device "
                         "cuda, 1 rank, bfloat16, T = 4096 (no sweep), M = H = 1024, E = 8, k = 2, f = 1: the step, its "
                         "expert compute and GShard, 10 rounds; no dropless or dynamic rows")
    p.add_argument("--json", metavar="FILE", help="write the run as JSON to FILE (rank 0)")
    p.add_argument("--plot", metavar="FILE.png", help="draw step time against (r, d) per case to FILE.png (rank 0)")
    return p


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    preset = QUICK if args.quick else GPU_STEP if args.gpu_step else DEFAULTS
    for name, value in {"device": "cpu", "dtype": "float", **preset}.items():
        if getattr(args, name, None) is None:
            setattr(args, name, list(value) if isinstance(value, list) else value)
    if isinstance(args.algos, str):
        args.algos = [a.strip().lower() for a in args.algos.split(",") if a.strip()]
    for name in args.algos:
        if name not in ALGOS:
            parser.error(f"--algos: unknown algorithm {name!r}; expected linear or 2dh")
    for flag, values in (("--algos", args.algos), ("--degrees", args.degrees), ("--factors", args.factors)):
        if not values:
            parser.error(f"{flag} must not be empty")
        if len(set(values)) != len(values):
            parser.error(f"{flag} has duplicates: {','.join(map(str, values))}")
    if len(set(args.peer_factors)) != len(args.peer_factors):
        parser.error("--peer-factors has duplicates")
    common.require_at_least(parser, (
        ("--tokens", args.tokens, 0),
        ("--model-dim", args.model_dim, 1),
        ("--hidden", args.hidden, 1),
        ("--experts", args.experts, 1),
        ("--top-k", args.top_k, 1),
        *(("--peer-tokens", tokens, 0) for tokens in args.peer_tokens),
        ("--warmup", args.warmup, 0),
        ("--repeats", args.repeats, 1),
        ("--tune-repeats", args.tune_repeats, 1),
        ("--switch-pairs", args.switch_pairs, 0),
        ("--dynamic-steps", args.dynamic_steps, 0),
        ("--profile", args.profile, 0),
        ("--threads", args.threads, 1),
        *(("--degrees", degree, 1) for degree in args.degrees),
    ))
    for flag, values in (("--factors", args.factors), ("--peer-factors", args.peer_factors),
                         ("--dropless-factors", args.dropless_factors)):
        if any(not (f > 0 and math.isfinite(f)) for f in values):
            parser.error(f"{flag}: capacity factors must be positive and finite, got {','.join(map(str, values))}")
    if not args.prior_factor > 1:
        parser.error(f"--prior-factor must be > 1, got {args.prior_factor}")
    if args.top_k > args.experts:
        parser.error(f"--top-k {args.top_k} is more than the {args.experts} experts")
    key = args.dtype.strip().lower()
    if key not in DTYPES:
        parser.error(f"unknown --dtype {args.dtype!r}; expected float, bfloat16 or double")
    args.dtype = DTYPES[key]
    if args.np is not None and args.np < 1:
        parser.error(f"--np must be positive, got {args.np}")
    if args.transport is not None and args.device != "cuda":
        parser.error("--transport chooses how CUDA buffers move: it needs --device cuda")
    if args.local_size is not None:
        if args.local_size < 1:
            parser.error(f"--local-size must be positive, got {args.local_size}")
        if args.np is not None and args.np % args.local_size:
            parser.error(f"--np {args.np} is not divisible by --local-size {args.local_size}")
    error = layout_error(args, args.np if args.np is not None else default_np(args))
    if error and not launch.under_mpirun():
        parser.error(error)
    if args.plot:
        from a2a.bench import plot

        missing = plot.matplotlib_missing()
        if missing is not None:  # refused now, not after a sweep of minutes
            parser.error(missing)
    args.peer_tokens = [tokens for tokens in args.peer_tokens if tokens]  # 0: none
    if args.no_peer or not args.peer_factors:
        args.peer_tokens = []
    if not args.tokens:  # no sweep: the dropless and dynamic rows run at its tokens
        args.dropless_factors, args.dynamic_steps = [], 0
        if not args.peer_tokens:
            parser.error("--tokens 0 and no comparison cases (--peer-tokens 0, --no-peer or no --peer-factors): "
                         "nothing to measure")
    return args


def default_np(args: argparse.Namespace) -> int:
    """Ranks when --np is not given: 1 on CUDA (one GPU per rank), else DEFAULT_NP."""
    return 1 if args.device == "cuda" else DEFAULT_NP


def layout_error(args: argparse.Namespace, ranks: int) -> str | None:
    """Why the experts do not fit `ranks` ranks, or None."""
    if args.experts % ranks and ranks % args.experts:
        return f"--experts {args.experts} must be a multiple or a divisor of the {ranks} ranks"
    sharers = ranks // args.experts if args.experts < ranks else 1
    if args.hidden % sharers:
        return f"--hidden {args.hidden} must be a multiple of the {sharers} ranks that share an expert"
    return None


@dataclass(frozen=True)
class Case:
    """One (T, f) the run measures: a sweep case, or a comparison with GShard."""

    tokens: int
    factor: float
    comparison: bool  # one of the --peer-tokens cases


def cases(args: argparse.Namespace) -> list[Case]:
    """The sweep's cases (--tokens at every --factors), then the comparison's
    (--peer-tokens at every --peer-factors)."""
    found = [Case(args.tokens, f, False) for f in args.factors] if args.tokens else []
    found += [Case(tokens, f, True) for tokens in args.peer_tokens for f in args.peer_factors]
    return found
