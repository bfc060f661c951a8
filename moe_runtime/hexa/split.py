"""Hexa-MoE's heterogeneous split (Section 3.4): work in proportion to speed.

Each rank measures its latency on a proxy task (Appendix C: a loop of large
matmuls), the latencies are all-gathered so that every rank holds the same
list, and every rank computes the same split of a total:

- data-centric (Equation 1): the global batch B into per-rank batches
  B_i = B (1/l_i) / sum_j (1/l_j);
- model-centric (Equation 2): the experts' hidden size H into per-rank
  slices H_i = H (1/l_i) / sum_j (1/l_j).

The parts sum to the total exactly, rounded the same way on every rank
(moe_runtime.experts.split, where the arithmetic lives: the even split of
Tutel's shared experts uses it too).

A part may be 0: a total smaller than the number of ranks, or a rank far
slower than the others, leaves a rank without work. That is the right split
of a batch (the rank computes no tokens); a caller that needs every part
positive (the model-centric layer, whose every rank must hold a hidden
slice) checks it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

import a2a

from ..common.host_values import all_gather_values
from ..experts.split import check_count, check_latencies, offsets, split_by_latency, uniform_split

__all__ = ["local_batch", "measure_latency", "offsets", "rank_latencies", "split_by_latency", "uniform_split"]












def local_batch(batch: Any, latencies: Sequence[float], rank: int, multiple: int = 1) -> Any:
    """Rank `rank`'s rows of a global batch under Equation 1: the batch (any
    array or tensor, split along its first dimension) into
    ``split_by_latency(len(batch), latencies, multiple)`` consecutive parts.
    Every rank passes the same batch and latencies and takes its own rows,
    which are a view (no copy) of the batch."""
    ranks = len(latencies)
    if not isinstance(rank, (int, np.integer)) or isinstance(rank, bool) or not 0 <= rank < ranks:
        raise ValueError(f"rank must be in [0, {ranks}) for {ranks} latencies, got {rank!r}")
    multiple = check_count("multiple", multiple, 1)
    rows = batch.shape[0] if hasattr(batch, "shape") else len(batch)
    if rows % multiple != 0:
        raise ValueError(f"local_batch: the global batch has {rows} rows, not a multiple of multiple={multiple}")
    starts = offsets(split_by_latency(rows, latencies, multiple))
    return batch[starts[rank] : starts[rank + 1]]


def measure_latency(device: Any = "cpu", size: int = 1024, repeats: int = 10, warmup: int = 2,
                    dtype: Any = None) -> float:
    """The proxy task of Appendix C: seconds per (size x size) @ (size x size)
    matmul on `device`, averaged over `repeats` matmuls after `warmup` of
    them (which pay for first-touch allocation and library start-up). On
    CUDA the clock reads after a synchronize, so it times the kernels, not
    their launches. ``dtype``: a torch dtype, float32 by default."""
    import torch

    size = check_count("size", size, 1)
    repeats = check_count("repeats", repeats, 1)
    warmup = check_count("warmup", warmup, 0)
    device = torch.device(device)
    dtype = torch.float32 if dtype is None else dtype
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=generator, dtype=torch.float32).to(device=device, dtype=dtype)
    b = torch.randn(size, size, generator=generator, dtype=torch.float32).to(device=device, dtype=dtype)
    out = torch.empty(size, size, device=device, dtype=dtype)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(warmup):
        torch.matmul(a, b, out=out)
    sync()
    start = time.perf_counter()
    for _ in range(repeats):
        torch.matmul(a, b, out=out)
    sync()
    return (time.perf_counter() - start) / repeats


def rank_latencies(comm: a2a.Comm, latency: float) -> list[float]:
    """Every rank's `latency` (collective): the same list, indexed by rank,
    on every rank, so that every rank computes the same split. A latency that
    is not finite and positive raises ValueError on every rank, naming it."""
    if not isinstance(comm, a2a.Comm):
        raise TypeError(f"rank_latencies: comm must be an a2a.Comm, got {type(comm).__name__}")
    try:
        mine = float(latency)
    except (TypeError, ValueError):
        mine = math.nan  # reported after the gather, on every rank
    gathered = all_gather_values(np.array([mine], dtype=np.float64), comm)
    values = [float(value) for value in gathered]
    check_latencies(values)
    return values
