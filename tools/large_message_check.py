"""Moves one message larger than 2^31 bytes through a2a.all_to_all_v and
checks every byte: MPI's int counts must not overflow (a2a sends such
messages as derived datatypes). Needs about 5 GiB of memory on 2 ranks:

    python -m a2a.launch --np 2 -- python tools/large_message_check.py

Not part of `make test` (too much memory for CI); the same code path is
tested there with a lowered threshold (A2A_MPI_MAX_COUNT)."""

from __future__ import annotations

import sys
import time

import numpy as np
from mpi4py import MPI

import a2a

BYTES = (1 << 31) + (1 << 20) + 7  # just over 2 GiB, and odd


STEP = 1 << 26  # bytes per chunk when filling and checking (keeps int64 temporaries small)


def pattern(start: int, stop: int) -> np.ndarray:
    return (np.arange(start, stop, dtype=np.int64) % 251).astype(np.uint8)


def filled(nbytes: int) -> np.ndarray:
    out = np.empty(nbytes, dtype=np.uint8)
    for lo in range(0, nbytes, STEP):
        hi = min(nbytes, lo + STEP)
        out[lo:hi] = pattern(lo, hi)
    return out


def main() -> int:
    comm = a2a.Comm.from_mpi()
    if comm.size != 2:
        print("run on exactly 2 ranks", file=sys.stderr)
        return 2
    # Rank 0 sends BYTES to rank 1 and nothing to itself; rank 1 sends nothing.
    if comm.rank == 0:
        send = filled(BYTES)
        counts = [0, BYTES]
    else:
        send = np.empty(0, dtype=np.uint8)
        counts = [0, 0]
    start = time.perf_counter()
    recv, recv_counts = a2a.all_to_all_v(send, counts, comm=comm)
    seconds = time.perf_counter() - start
    wrong = 0
    if comm.rank == 1:
        assert list(recv_counts) == [BYTES, 0], recv_counts
        for lo in range(0, BYTES, STEP):
            hi = min(BYTES, lo + STEP)
            wrong += int(np.count_nonzero(recv[lo:hi] != pattern(lo, hi)))
    wrong = MPI.COMM_WORLD.allreduce(wrong)
    if comm.rank == 0:
        print(f"all_to_all_v of one {BYTES}-byte message: {seconds:.2f} s, #wrong {wrong}")
    return 0 if wrong == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
