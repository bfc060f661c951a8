"""What the mpirun scripts of tests/gpu check on every rank (staged_ranks.py:
ranks sharing one GPU through the staged MPI transport; nccl_ranks.py: NCCL
communicators made over MPI and from a torch.distributed NCCL group): every
algorithm on CUDA tensors, compared bitwise with the host communicator on
the same data, `#wrong` counted over all ranks per case; and the fixed-size
collectives captured into a CUDA graph and replayed. `run_under_mpirun` is
how the tests start such a script and judge it."""

from __future__ import annotations

import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np
import reference as ref
import torch

import a2a
from a2a import launch

HERE = os.path.dirname(os.path.abspath(__file__))


class Tally:
    """#wrong per case, summed over the ranks of `world` (an mpi4py communicator)."""

    def __init__(self, world):
        self.world = world
        self.lines: list[str] = []
        self.wrong = 0

    def compare(self, name: str, got, want) -> None:
        g, w = ref.raw_bytes(got.cpu() if hasattr(got, "cpu") else got), ref.raw_bytes(want)
        wrong = int(np.count_nonzero(g != w)) if g.shape == w.shape else max(g.size, w.size)
        wrong = int(self.world.allreduce(wrong))
        self.wrong += wrong
        self.lines.append(f"{name:<48} #wrong {wrong}")

    def finish(self, what: str) -> int:
        """Prints the cases and the total on rank 0; the exit status."""
        torch.cuda.synchronize()
        if self.world.rank == 0:
            print("\n".join(self.lines))
            print(f"{what}: total #wrong {self.wrong}")
        return 0 if self.wrong == 0 else 1


def every_algorithm(tally: Tally, label: str, host: a2a.Comm, cuda: a2a.Comm, algos=("linear", "2dh")) -> None:
    """all_to_all (3 dtypes, 1 and 333 rows), all_to_all_flex (3 layouts) and
    all_to_all_v (every count pattern) on `cuda` against `host`."""
    rank, size = host.rank, host.size
    for algo in algos:
        for dtype in ("float32", "bfloat16", "int8"):
            for rows in (1, 333):
                x = ref.a2a_input(f"gpu{rows}", rank, size, (size * rows, 7), dtype)
                want = a2a.all_to_all(ref.to_framework(x, dtype, "torch"), comm=host, algo=algo)
                got = a2a.all_to_all(ref.to_framework(x, dtype, "torch").cuda(), comm=cuda, algo=algo)
                tally.compare(f"{label} all_to_all {algo} {dtype} rows={rows}", got, want)
        for shape, split, concat in (((2, size * 3, 5), 1, 0), ((size * 2, 3, 5), 0, 1), ((3, size, 4), 1, 2)):
            x = ref.flex_input("gpu-flex", rank, size, shape, split, "float32")
            want = a2a.all_to_all_flex(x, comm=host, split_axis=split, concat_axis=concat, algo=algo)
            got = a2a.all_to_all_flex(torch.from_numpy(x).cuda(), comm=cuda, split_axis=split, concat_axis=concat,
                                      algo=algo)
            tally.compare(f"{label} all_to_all_flex {algo} {shape} {split}->{concat}", got, torch.from_numpy(want))
        for pattern in ref.V_PATTERNS:
            matrix = ref.v_counts(pattern, size)
            x = ref.v_input(pattern, rank, matrix, (3,), "float64")
            want, _ = a2a.all_to_all_v(x, matrix[rank], comm=host, algo=algo)
            got, _ = a2a.all_to_all_v(torch.from_numpy(x).cuda(), matrix[rank], comm=cuda, algo=algo)
            tally.compare(f"{label} all_to_all_v {algo} {pattern}", got, torch.from_numpy(want))


def graph_replay(tally: Tally, label: str, host: a2a.Comm, cuda: a2a.Comm) -> None:
    """all_to_all and all_to_all_flex captured after a warm-up call (workspace,
    connections), the outputs zeroed, the graph replayed."""
    rank, size = host.rank, host.size
    x = ref.a2a_input("gpu-graph", rank, size, (size * 64, 3), "float32")
    y = ref.flex_input("gpu-graph-flex", rank, size, (4, size * 6, 8), 1, "float32")
    want = (a2a.all_to_all(x, comm=host), a2a.all_to_all_flex(y, comm=host, split_axis=1, concat_axis=0))
    src = (torch.from_numpy(x).cuda(), torch.from_numpy(y).cuda())
    out = (torch.empty_like(src[0]), torch.empty((4 * size, 6, 8), device="cuda"))

    def calls() -> None:
        a2a.all_to_all(src[0], comm=cuda, out=out[0])
        a2a.all_to_all_flex(src[1], comm=cuda, split_axis=1, concat_axis=0, out=out[1])

    calls()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        calls()
    for o in out:
        o.zero_()
    graph.replay()
    torch.cuda.synchronize()
    tally.compare(f"{label} graph replay all_to_all", out[0], np.asarray(want[0]))
    tally.compare(f"{label} graph replay all_to_all_flex", out[1], np.asarray(want[1]))


def run_under_mpirun(np_: int, script: str, timeout_s: int, **env: str) -> None:
    """Runs tests/gpu/`script` on `np_` ranks (bounded waits, no inherited
    A2A_LOCAL_SIZE, `env` added) and asserts that it exited 0 with a total
    #wrong of 0; prints its output."""
    env = dict(os.environ, A2A_TIMEOUT_S="120", **env)
    env.pop("A2A_LOCAL_SIZE", None)
    command = launch.mpirun_command(np_, [sys.executable, os.path.join(HERE, script)])
    result = subprocess.run(command, check=False, env=env, capture_output=True, text=True, timeout=timeout_s)
    print(result.stdout[-6000:])
    assert result.returncode == 0, f"mpirun exited {result.returncode}\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    assert "total #wrong 0" in result.stdout
