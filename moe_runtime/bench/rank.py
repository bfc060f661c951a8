"""What the runtime's mode benchmarks (flex, hetero, flows) share on every rank:
the world's communicator, the slowest rank's time, and a timed forward + backward step."""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import numpy as np

from ..common.host_values import all_reduce_values

__all__ = ["RankRun", "slowest"]


def slowest(value: float, comm: Any) -> float:
    """The maximum of `value` over the ranks of `comm`, a host or a CUDA communicator."""
    return float(all_reduce_values(np.array([value], dtype=np.float64), comm, op="max")[0])


class RankRun:
    """One rank of a mode benchmark under mpirun: ``torch``, ``a2a``, the MPI world and its
    ``a2a.Comm``, and the parsed ``args``."""

    def __init__(self, args: argparse.Namespace, threads: int = 1):
        import torch
        from mpi4py import MPI

        import a2a

        torch.set_num_threads(threads)
        self.torch, self.a2a, self.world = torch, a2a, MPI.COMM_WORLD
        self.comm = a2a.Comm.from_mpi(self.world)
        self.args = args

    def slowest(self, value: float) -> float:
        """The maximum of `value` over the ranks (a step's time is its slowest rank's)."""
        return slowest(value, self.comm)

    def step(self, layer, tokens) -> float:
        """Seconds of one forward + backward of `tokens` (a fresh leaf) through `layer`, slowest rank."""
        x = tokens.clone().requires_grad_()
        self.world.Barrier()
        start = time.perf_counter()
        y = layer(x)
        (y.square().mean() + y.l_aux).backward()
        return self.slowest(time.perf_counter() - start)

    def median_step(self, layer, tokens, untimed: int) -> float:
        """The median of args.steps steps after `untimed` ones."""
        for _ in range(untimed):
            self.step(layer, tokens)
        return statistics.median(self.step(layer, tokens) for _ in range(self.args.steps))
