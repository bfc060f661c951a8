"""The command line of the collectives sweep (nccl-tests' flags and ours):
its parser; ``collectives.parse_args`` reads and checks it."""

from __future__ import annotations

import argparse

from . import common, plot
from .collectives_data import DTYPES

__all__ = ["ALGOS", "DEFAULT_LOCAL_SIZE", "DEFAULT_NP", "PREDICT_PRESETS", "build_parser", "check_cluster",
           "parse_cluster"]

# a2a.sim's presets (tests check they stay the same)
PREDICT_PRESETS = ("local", "a100", "h100", "cluster", "cluster-10g", "cluster-1g")
DEFAULT_NP = 4
DEFAULT_LOCAL_SIZE = 2  # with the embedded --np default only: 2 emulated nodes of 2 ranks
ALGOS = ("linear", "2dh", "flex", "combine", "v", "v-plan", "fp8")  # fp8: not in "all"


def parse_cluster(text: str) -> tuple[int, int]:
    """``4x2`` -> (4 nodes, 2 ranks per node)."""
    nodes, _, local = text.lower().partition("x")
    if not (nodes.isdigit() and local.isdigit() and int(nodes) >= 1 and int(local) >= 1):
        raise argparse.ArgumentTypeError(f"expected NODESxRANKS_PER_NODE such as 4x2, got {text!r}")
    return int(nodes), int(local)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m a2a.bench",
        description="nccl-tests alltoall_perf-compatible sweep of the a2a all-to-all collectives, "
        "with an MPI_Alltoall baseline (and, with --baseline mpi,gloo, torch.distributed gloo) measured in the same run.",
        epilog="--op encode|decode|permute|unpermute|all benchmarks the MoE kernels instead, in this process "
        "(see python -m a2a.bench --op all --help); --layout the layout kernels (--layout --help).",
        allow_abbrev=False,
    )
    for flag, name, default, which in (("-b", "--minbytes", "1K", "smallest"), ("-e", "--maxbytes", "64M", "largest")):
        help_text = f"{which} size per rank (default {default})"
        p.add_argument(flag, name, type=common.parse_size, default=common.parse_size(default), help=help_text)
    p.add_argument(
        "-f", "--stepfactor", type=float, default=None, help="multiply the size by this (default 4)"
    )
    p.add_argument(
        "-i", "--stepbytes", type=common.parse_size, default=None, help="add this to the size (used when -f is 1)"
    )
    p.add_argument("-n", "--iters", type=int, default=20, help="timed iterations (default 20)")
    p.add_argument(
        "-r", "--repeats", type=int, default=5, help="timed repetitions of -n calls; rows show the median (default 5)"
    )
    p.add_argument("-w", "--warmup_iters", type=int, default=5, help="warm-up iterations (default 5)")
    p.add_argument(
        "-c", "--check", type=int, default=1, help="validation rounds per row; 0 disables (default 1)"
    )
    p.add_argument("-d", "--datatype", default="float", help=f"{', '.join(DTYPES)} or all (default float)")
    p.add_argument("--algo", default="all", help="linear, 2dh, flex, combine, v, v-plan, fp8 (flex's tokens as FP8), all (but fp8), or a comma list "
                   "(default all)")
    p.add_argument(
        "--inner-algo",
        choices=("linear", "2dh"),
        default="linear",
        help="the algorithm flex and v run on (default linear)",
    )
    p.add_argument(
        "--np",
        type=int,
        default=None,
        help=f"ranks to launch under mpirun when not under it (default {DEFAULT_NP})",
    )
    p.add_argument("--local-size", type=int, default=None, help="emulated ranks per node (A2A_LOCAL_SIZE)")
    p.add_argument(
        "--cluster",
        metavar="NxL",
        type=parse_cluster,
        default=None,
        help="run on N nodes of L ranks of the namespace cluster (a2a.cluster; root): TCP between nodes, "
        "shared memory within, the topology detected (instead of --np / --local-size)",
    )
    p.add_argument("--rate", default=None, help="--cluster: shape every node's link to this rate (1gbit, 10gbit; "
                   "default unshaped)")
    p.add_argument("--experts-per-rank", type=int, default=2, help="flex: experts per rank (default 2)")
    p.add_argument(
        "--hidden", type=int, default=1024, help="flex: model dim M (default 1024; less for small sizes)"
    )
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu: host buffers over MPI; cuda: torch CUDA tensors, one GPU per rank (local_rank %% GPUs), "
        "1 rank by default, baseline a device-to-device copy (default cpu)",
    )
    p.add_argument(
        "--transport",
        choices=("nccl", "mpi"),
        default=None,
        help="--device cuda: nccl (default) or mpi (staged through host memory; ranks may share a GPU)",
    )
    p.add_argument(
        "--baseline",
        metavar="LIST",
        default=None,
        help="baselines measured in the same run, a comma list: mpi (MPI_Alltoall, the cpu default), gloo "
        "(torch.distributed all_to_all_single over gloo on CPU tensors; needs torch), d2d (a device-to-device "
        "copy, the cuda default), or none. One ratio column per baseline, in the order given",
    )
    p.add_argument("--no-baseline", action="store_true", help="skip the baseline rows (the same as --baseline none)")
    p.add_argument("--json", metavar="FILE", help="write the rows as JSON to FILE (rank 0)")
    p.add_argument(
        "--counters",
        action="store_true",
        help="after each a2a row, what one call costs (a2a.counters, rank 0's, the mean of 3 calls): rounds and "
        "messages on the data and control paths, the cross-rank check's own rounds, host waits, device "
        "operations, allocations; also in the JSON rows (counters)",
    )
    p.add_argument(
        "--plot",
        metavar="FILE.png",
        help=f"draw busbw against size per algorithm and baseline, and the ratios, to FILE.png (rank 0; needs "
        f"matplotlib: {plot.INSTALL_HINT})",
    )
    p.add_argument(
        "--predict",
        metavar="PRESET",
        default=None,
        help="the scale model (a2a.sim) preset whose predicted busbw of linear and 2dh is drawn beside the "
        "measured lines in --plot, at this run's ranks and ranks per node: local, a100, h100, or none "
        "(default: local on cpu, none on cuda, which has no fitted preset for its GPU)",
    )
    return p


def check_cluster(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--cluster and --rate against the flags they exclude (exits 2 with the parser's message)."""
    if args.cluster is None:
        if args.rate is not None:
            parser.error("--rate shapes the namespace cluster's links: it needs --cluster NxL")
        return
    clash = [flag for flag, given in (("--np", args.np is not None), ("--local-size", args.local_size is not None),
                                      ("--device cuda", args.device == "cuda")) if given]
    if clash:
        parser.error(f"--cluster {args.cluster[0]}x{args.cluster[1]} chooses the ranks and their nodes: "
                     f"drop {', '.join(clash)}")
    if args.rate is not None:
        from a2a.cluster import parse_rate

        try:
            parse_rate(args.rate)
        except ValueError as error:
            parser.error(str(error))
