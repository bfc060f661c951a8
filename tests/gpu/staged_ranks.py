"""One rank of tests/gpu/test_staged_mpi_gpu.py (run under mpirun, every
rank on the same GPU): every algorithm through the staged MPI transport on
CUDA tensors, compared bitwise with the host communicator on the same data.
Prints `#wrong N` per case on rank 0 and exits non-zero on any difference."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np
import reference as ref
import torch
from mpi4py import MPI

import a2a


def main() -> int:
    world = MPI.COMM_WORLD
    local_size = int(os.environ.get("STAGED_LOCAL_SIZE", "2"))
    host = a2a.Comm.from_mpi(world, local_size=local_size)
    cuda = a2a.Comm.from_mpi(world, device="cuda", transport="mpi", local_size=local_size, cuda_device=0)
    rank, size = host.rank, host.size
    wrong_total = 0
    lines = []

    def compare(name: str, got, want) -> None:
        nonlocal wrong_total
        g, w = ref.raw_bytes(got.cpu()), ref.raw_bytes(want)
        wrong = int(np.count_nonzero(g != w)) if g.shape == w.shape else max(g.size, w.size)
        wrong = int(world.allreduce(wrong))
        wrong_total += wrong
        lines.append(f"{name:<40} #wrong {wrong}")

    for algo in ("linear", "2dh"):
        for dtype in ("float32", "bfloat16", "int8"):
            for rows in (1, 333):
                x = ref.a2a_input(f"staged{rows}", rank, size, (size * rows, 7), dtype)
                want = a2a.all_to_all(ref.to_framework(x, dtype, "torch"), comm=host, algo=algo)
                got = a2a.all_to_all(ref.to_framework(x, dtype, "torch").cuda(), comm=cuda, algo=algo)
                compare(f"all_to_all {algo} {dtype} rows={rows}", got, want)
        for shape, split, concat in (((2, size * 3, 5), 1, 0), ((size * 2, 3, 5), 0, 1), ((3, size, 4), 1, 2)):
            x = ref.flex_input("staged-flex", rank, size, shape, split, "float32")
            want = a2a.all_to_all_flex(x, comm=host, split_axis=split, concat_axis=concat, algo=algo)
            t = torch.from_numpy(x).cuda()
            got = a2a.all_to_all_flex(t, comm=cuda, split_axis=split, concat_axis=concat, algo=algo)
            compare(f"all_to_all_flex {algo} {shape} {split}->{concat}", got, torch.from_numpy(want))
        for pattern in ref.V_PATTERNS:
            matrix = ref.v_counts(pattern, size)
            counts = matrix[rank]
            x = ref.v_input(pattern, rank, matrix, (3,), "float64")
            want, _ = a2a.all_to_all_v(x, counts, comm=host, algo=algo)
            got, _ = a2a.all_to_all_v(torch.from_numpy(x).cuda(), counts, comm=cuda, algo=algo)
            compare(f"all_to_all_v {algo} {pattern}", got, torch.from_numpy(want))
    torch.cuda.synchronize()
    if rank == 0:
        print("\n".join(lines))
        print(f"staged MPI on one GPU, {size} ranks, local_size {local_size}: total #wrong {wrong_total}")
    return 0 if wrong_total == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
