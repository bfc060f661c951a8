"""Small host values (counts, flags, agreed settings) exchanged over a communicator of either device.

The collectives of a CUDA communicator take memory of its device only (a
NumPy array fails the call on every rank), so the runtime's agreements --
NumPy rows of a few int64 or float64 -- travel there as a tensor on the
communicator's device and come back as NumPy. On a host communicator they
go as they are (and torch is not needed). The exchanges are collective
over ``comm``; on one rank they move nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

import a2a

__all__ = ["all_gather_values", "all_reduce_values", "all_to_all_values", "torch_device", "uploaded"]


def torch_device(comm: a2a.Comm) -> Any:
    """Where `comm` moves memory, as torch names it: cpu, or its GPU."""
    import torch  # a CUDA communicator's caller has torch (the runtime); a host one's need not

    return torch.device("cpu") if comm.device == "cpu" else torch.device("cuda", comm.cuda_device)


def _exchanged(collective: Callable[..., Any], values: Any, comm: a2a.Comm, **options: Any) -> np.ndarray:
    values = np.ascontiguousarray(values)
    if comm.size == 1:  # every rank's values are these: no collective (on a GPU, no copy there and back)
        return values.copy()
    if comm.device == "cpu":
        return collective(values, comm=comm, **options)
    import torch

    # Up through page-locked memory (no wait for the stream), so that the read back below is the one wait.
    result = collective(uploaded(torch.from_numpy(values), torch_device(comm)), comm=comm, **options)
    # Where the check of this call was posted (a.Comm.predicts_check), it completes before the host waits for
    # the stream: a rank that left the call would leave this wait, unbounded, behind the NCCL work it never meets.
    if comm.predicts_check:
        comm.check()
    return result.cpu().numpy()


def all_gather_values(values: Any, comm: a2a.Comm) -> np.ndarray:
    """Every rank's `values` (an array of n numbers), rank after rank: (W n,) NumPy."""
    return _exchanged(a2a.all_gather, values, comm)


def all_to_all_values(values: Any, comm: a2a.Comm) -> np.ndarray:
    """`values` (W blocks of n numbers, block j for rank j) exchanged: block
    i of every rank, rank after rank, (W n,) NumPy."""
    return _exchanged(a2a.all_to_all, values, comm)


def all_reduce_values(values: Any, comm: a2a.Comm, op: str = "sum") -> np.ndarray:
    """`values` (an array of n numbers) reduced elementwise over the ranks by `op`: (n,) NumPy."""
    return _exchanged(a2a.all_reduce, values, comm, op=op)


def uploaded(host: Any, device: Any) -> Any:
    """A host tensor on `device`; to a GPU through page-locked memory, so
    that the copy is queued on the stream instead of waiting for it (torch's
    copy from pageable memory synchronizes the stream)."""
    if host.device == device or getattr(device, "type", device) == "cpu":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
