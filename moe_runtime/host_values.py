"""Small host arrays (counts, flags, seconds) through an ``a2a.Comm`` of either device.

The collectives of a CUDA communicator take CUDA tensors only (a NumPy array
there is refused), so on one the values travel as a tensor on its GPU and come
back to the host: one small copy each way, and a wait for the stream, which
the caller pays anyway since it reads them. On a host communicator they go as
they are."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

import a2a

__all__ = ["all_gather_host", "all_reduce_host", "torch_device"]


def torch_device(comm: a2a.Comm) -> torch.device:
    """Where `comm` moves memory, as torch names it: cpu, or its GPU."""
    return torch.device("cpu") if comm.device == "cpu" else torch.device("cuda", comm.cuda_device)


def _where(values: np.ndarray, comm: a2a.Comm) -> Any:
    if comm.device == "cpu":
        return values
    return torch.from_numpy(np.ascontiguousarray(values)).to(torch_device(comm))


def _back(result: Any) -> np.ndarray:
    return result if isinstance(result, np.ndarray) else result.cpu().numpy()


def all_gather_host(values: np.ndarray, comm: a2a.Comm) -> np.ndarray:
    """``a2a.all_gather`` of `values` (rows stacked by rank), on the host."""
    return _back(a2a.all_gather(_where(values, comm), comm=comm))


def all_reduce_host(values: np.ndarray, comm: a2a.Comm, op: str = "sum") -> np.ndarray:
    """``a2a.all_reduce`` of `values` (``op``: sum, max, min), on the host."""
    return _back(a2a.all_reduce(_where(values, comm), comm=comm, op=op))
