"""Benchmark of the low-latency dispatch and combine: ``python -m a2a.bench --low-latency``.

    python -m a2a.bench --low-latency [--np 4] [--tokens 1,8,64,128] [-M 1024] [-E 16] [-k 8]
                                      [--dtype bfloat16] [--fp8] [-r 9] [-n 20] [--json F]

Under mpirun (started plainly it relaunches itself on ``--np`` ranks, 4 by
default). For every T (tokens per rank), with uniformly random top-k
distinct experts per token, it times, in turns (a2a.bench.common.take_turns):

* ``ll``: ``buffer.dispatch(x, indices)`` then ``buffer.combine(expert_x,
  gates)`` of an ``a2a.LowLatencyBuffer`` made once (the experts return
  their input: no compute), FP8 rows with ``--fp8``;
* ``normal``: the same exchange as a2a's dropless path makes it: ``permute``
  (the FP8 pair with ``--fp8``), ``all_to_all_v`` (its counts exchanged in
  the call), ``all_to_all_v`` back of the rows in the tokens' dtype, and
  ``unpermute`` with the gates;
* ``mpi``: one ``MPI_Alltoall`` of the bytes one dispatch sends (each
  rank's rows spread evenly over the peers), and ``2 x mpi`` for both
  directions.

A sample is the slowest rank's mean over ``-n`` back-to-back calls after a
barrier; rows show the median of ``-r``. Columns (us): ``ll``, ``normal``,
``mpi``; then ``ll / normal`` (the issue's target: <= 0.5), ``ll / mpi``
(<= 1.2) and ``ll / 2 mpi``. ``#wrong``: output elements of the low-latency
call that differ from the normal path's beyond rounding (exit status 1 if
any).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

from . import common

__all__ = ["is_low_latency_mode", "main", "parse_args"]

FLAG = "--low-latency"
DEFAULT_NP = 4


def is_low_latency_mode(argv: list[str]) -> bool:
    return FLAG in argv


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m a2a.bench --low-latency", description=__doc__.split("\n\n")[0],
                                allow_abbrev=False)
    p.add_argument("--np", type=int, help=f"ranks to launch under mpirun when not under it (default {DEFAULT_NP})")
    p.add_argument("--local-size", type=int, help="emulated ranks per node (A2A_LOCAL_SIZE)")
    p.add_argument("--tokens", type=lambda s: [int(v) for v in s.split(",") if v], default=[1, 8, 64, 128],
                   help="tokens per rank, comma list (default 1,8,64,128)")
    p.add_argument("-M", "--model-dim", type=int, default=1024)
    p.add_argument("-E", "--experts", type=int, default=None, help="experts (default 4 per rank)")
    p.add_argument("-k", "--top-k", type=int, default=8)
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--fp8", action="store_true", help="dispatch FP8 rows (e4m3, block 128)")
    p.add_argument("-r", "--repeats", type=int, default=9)
    p.add_argument("-n", "--iters", type=int, default=20)
    p.add_argument("-w", "--warmup", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="a2a's CPU threads per rank (default 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="FILE", help="write the rows as JSON to FILE (rank 0)")
    return p


def parse_args(argv: list[str]) -> argparse.Namespace:
    args = build_parser().parse_args([a for a in argv if a != FLAG])
    if not args.tokens or min(args.tokens) < 1:
        build_parser().error("--tokens must be positive integers")
    return args


class _Case:
    """One T: the inputs, and each path as a function."""

    def __init__(self, a2a: Any, torch: Any, comm: Any, args: argparse.Namespace, tokens: int, buffer: Any):
        world, rank = comm.size, comm.rank
        self.a2a, self.torch, self.comm, self.buffer = a2a, torch, comm, buffer
        experts = args.experts or 4 * world
        gen = torch.Generator().manual_seed(args.seed + 1000 * rank + tokens)
        dtype = getattr(torch, args.dtype)
        self.x = torch.randn(tokens, args.model_dim, generator=gen).to(dtype)
        k = min(args.top_k, experts)
        self.indices = torch.rand(tokens, experts, generator=gen).argsort(dim=1)[:, :k].contiguous()
        self.gates = torch.rand(tokens, k, generator=gen).softmax(dim=1)
        self.experts, self.fp8 = experts, args.fp8
        ranks = (self.indices // (experts // world))
        self.send_counts = torch.stack([(ranks == p).sum() for p in range(world)]).numpy()
        element = self.x.element_size()
        row = (a2a.pack_fp8(*a2a.quantize_fp8(self.x[:1])).shape[-1] if args.fp8 else args.model_dim * element)
        per_peer = max(1, -(-int(self.send_counts.sum()) * row // world))  # the dispatch's bytes, spread evenly
        self.mpi_send = torch.zeros(world * per_peer, dtype=torch.uint8).numpy()
        self.mpi_recv = self.mpi_send.copy()

    def ll(self) -> Any:
        expert_x, _ = self.buffer.dispatch(self.x, self.indices)
        return self.buffer.combine(expert_x, self.gates)

    def normal(self) -> Any:
        a2a = self.a2a
        source = a2a.quantize_fp8(self.x) if self.fp8 else self.x
        rows, perm = a2a.permute(source, self.indices, self.experts)
        arrived, counts = a2a.all_to_all_v(rows, self.send_counts, comm=self.comm)
        if self.fp8:
            arrived = a2a.dequantize_fp8(*arrived, dtype=str(self.x.dtype).removeprefix("torch."))
        back, _ = a2a.all_to_all_v(arrived, counts, comm=self.comm)
        return a2a.unpermute(back, perm, self.gates)

    def mpi(self) -> None:
        self.comm.mpi_comm.Alltoall(self.mpi_send, self.mpi_recv)


def _bench(args: argparse.Namespace, argv: list[str]) -> int:
    import torch
    from mpi4py import MPI

    import a2a

    world = MPI.COMM_WORLD
    comm = a2a.Comm.from_mpi(world)
    experts = args.experts or 4 * comm.size
    buffer = a2a.LowLatencyBuffer(comm, max(args.tokens), args.model_dim, experts, min(args.top_k, experts),
                                  args.dtype, dispatch_dtype="float8_e4m3fn" if args.fp8 else None)

    def timed(fn) -> float:
        world.Barrier()
        start = time.perf_counter()
        for _ in range(args.iters):
            fn()
        return world.allreduce((time.perf_counter() - start) / args.iters, op=MPI.MAX)

    rows, failed = [], False
    for tokens in args.tokens:
        case = _Case(a2a, torch, comm, args, tokens, buffer)
        got, want = case.ll().float(), case.normal().float()
        tolerance = 2e-2 if args.dtype == "bfloat16" else 1e-5
        wrong = int((~torch.isclose(got, want, rtol=tolerance, atol=tolerance)).sum())
        wrong = int(world.allreduce(wrong, op=MPI.SUM))
        failed |= wrong > 0
        paths = [case.ll, case.normal, case.mpi]
        for fn in paths:
            for _ in range(args.warmup):
                fn()
        ll, normal, mpi = (statistics.median(s) for s in common.take_turns([lambda fn=fn: timed(fn) for fn in paths],
                                                                            args.repeats))
        rows.append({"tokens": tokens, "ll_us": ll * 1e6, "normal_us": normal * 1e6, "mpi_us": mpi * 1e6,
                     "ll_vs_normal": ll / normal, "ll_vs_mpi": ll / mpi, "ll_vs_2mpi": ll / (2 * mpi),
                     "mpi_bytes_per_peer": int(case.mpi_send.size // comm.size), "wrong": wrong})
    if comm.rank == 0:
        print(f"# {common.command_line(argv)}")
        print(f"# {comm.size} ranks ({comm.num_nodes} nodes x {comm.local_size}), M = {args.model_dim}, E = {experts}, "
              f"k = {min(args.top_k, experts)}, {args.dtype}{', FP8 dispatch' if args.fp8 else ''}; slowest rank's "
              f"mean of {args.iters} calls, median of {args.repeats} (us)")
        print(f"# {'T':>5} {'ll':>9} {'normal':>9} {'mpi':>9} {'mpi B/peer':>10} {'ll/normal':>9} {'ll/mpi':>7} "
              f"{'ll/2mpi':>7} {'#wrong':>6}")
        for r in rows:
            print(f"  {r['tokens']:>5} {r['ll_us']:>9.1f} {r['normal_us']:>9.1f} {r['mpi_us']:>9.1f} "
                  f"{r['mpi_bytes_per_peer']:>10} {r['ll_vs_normal']:>9.2f} {r['ll_vs_mpi']:>7.2f} "
                  f"{r['ll_vs_2mpi']:>7.2f} {r['wrong']:>6}")
        if args.json:
            with open(args.json, "w") as out:
                json.dump({"command": common.command_line(argv), "ranks": comm.size, "config": vars(args),
                           "rows": rows}, out, indent=1)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    return common.run_mode("a2a.bench", FLAG, [a for a in argv if a != FLAG], args, DEFAULT_NP, args.threads, _bench)
