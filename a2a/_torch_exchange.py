"""all_to_all and all_to_all_flex on torch tensors without views: the checks
of the general path (a2a._collectives) told from the tensors themselves, for
the calls that pass them all. A view costs microseconds, and a GPU step pays
the host's time per exchange (docs/benchmarks.md: a one-rank exchange on the
H200 took 16 us of host work over its copy). Anything unusual returns None,
and the general path then checks it and reports it to every rank.
"""

from __future__ import annotations

from typing import Any

from ._arrays import (
    DTYPE_CODES,
    _torch,
    _torch_stream,
    is_torch_tensor,
    mark_written,
    torch_dtype_named,
    torch_on,
    view,
)
from ._comm import Comm
from ._counters import note_allocation

__all__ = ["torch_exchange"]


def torch_exchange(x: Any, out: Any, comm: Any, shape: tuple[int, ...], workspace_size: Any) -> tuple | None:
    """(result, input address, result address, dtype code, workspace, workspace bytes) of an exchange of
    the torch tensor `x` into `out` (or a new tensor) of `shape`, on the communicator's device and
    torch's current stream; ``workspace_size(dtype code)`` gives the bytes the core asks for. None where
    a check might fail (the caller checked the algorithm's name and `shape`'s divisibility). The caller
    runs the exchange after its error-reporting block, as the general path does."""
    if type(comm) is not Comm or not is_torch_tensor(x) or not x.is_contiguous() or x.is_neg():
        return None
    code = DTYPE_CODES.get(torch_dtype_named(x.dtype)[0])
    cuda = comm.cuda_device
    if code is None or not torch_on(x, cuda):
        return None
    if out is not None and not (is_torch_tensor(out) and out.dtype == x.dtype and out.is_contiguous() and not out.is_neg()
                                and not out.requires_grad
                                and torch_on(out, cuda) and tuple(out.shape) == shape):
        return None
    try:
        nbytes = workspace_size(code)
    except Exception:  # noqa: BLE001 -- the general path asks again and reports it to every rank
        return None
    if cuda is not None:
        comm._use_stream(_torch_stream(cuda))
    workspace = comm.workspace(nbytes, None if cuda is None or nbytes == 0 else view(x, "input"))
    result = out
    if result is None:
        note_allocation()
        result = _torch().empty(shape, dtype=x.dtype, device=x.device)
    else:
        mark_written(out)
    return (result, x.data_ptr(), result.data_ptr(), code, *workspace)
