"""Tutel's ``tutel.net`` over a2a: its collectives (with and without
autograd), its process groups (moe/groups.py) and its sharded optimizer, by
Tutel's names, arguments and results. A Tutel program changes its import::

    from tutel import net                # before
    from moe_runtime.moe import net      # after

``group`` is what Tutel takes (a torch.distributed group, None for the job)
or an ``a2a.Comm``; the bytes move over the group's a2a communicator
(moe/communicator.py: MPI under mpirun, the gloo group's own messages under
torchrun on CPUs, NCCL on CUDA), shared with the layers of that group. With
no torch.distributed started, None is the MPI world, as for the layer.

What differs from Tutel (docs/runtime.md, "tutel.net"): every function runs on
any device and group (Tutel's batch_*_v only on CUDA and the default group);
``background=True`` completes the exchange at the call (the callable returns
its result); ``allreduce_forward`` honours ``op`` (Tutel sums whatever op);
bad shapes raise on every rank of the group (a2a's errors, naming the rank
and the sizes; a ValueError here where nothing is exchanged), where Tutel asserts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import a2a
import a2a.torch as a2a_torch

from .communicator import communicator, group_place, group_size
from .groups import create_groups_from_world, create_standalone_group

__all__ = [
    "TutelDistributedOptimizer", "all_gather", "all_to_all", "all_to_all_single", "allreduce_backward",
    "allreduce_forward", "barrier", "batch_all_gather_v", "batch_all_to_all_v", "create_groups_from_world",
    "create_standalone_group", "get_world_rank", "get_world_size", "reduce_scatter", "simple_all_gather",
    "simple_all_reduce", "simple_all_to_all", "simple_reduce_scatter", "simple_split", "spatial_split",
    "zero_gather", "zero_scatter",
]

SUM = dist.ReduceOp.SUM


# -- the group -------------------------------------------------------------------------------------

def get_world_size(group: Any = None) -> int:
    return group_size(group)


def get_world_rank(group: Any = None) -> int:
    return group_place(group)[0]


def barrier(group: Any = None) -> None:
    if get_world_size(group) == 1:
        return
    if isinstance(group, a2a.Comm):
        a2a.all_reduce(torch.zeros(1, device=group.device), comm=group)
    elif group is not None or dist.is_initialized():
        dist.barrier(group=group)
    else:
        from mpi4py import MPI

        MPI.COMM_WORLD.Barrier()


def _comm(group: Any, tensor: torch.Tensor) -> a2a.Comm:
    return communicator(group, tensor.device.type)


def _op(op: Any, name: str) -> str:
    """a2a's name of a torch.distributed.ReduceOp (or "sum", "max", "min")."""
    for key, value in ((dist.ReduceOp.SUM, "sum"), (dist.ReduceOp.MAX, "max"), (dist.ReduceOp.MIN, "min")):
        if op == key:
            return value
    if isinstance(op, str) and op.lower() in ("sum", "max", "min"):
        return op.lower()
    raise ValueError(f"{name}: op {op!r} is not supported; use ReduceOp.SUM, MAX or MIN")


# -- without backward (Tutel's simple_*) ---------------------------------------------------------------

def simple_all_reduce(input: torch.Tensor, group: Any = None, op: Any = SUM, inplace: bool = False) -> torch.Tensor:
    """The element-wise reduction over the group; `inplace` writes it into `input`."""
    if get_world_size(group) == 1:
        return input
    reduced = a2a.all_reduce(input.detach().contiguous(), comm=_comm(group, input), op=_op(op, "simple_all_reduce"))
    if not inplace:
        return reduced
    with torch.no_grad():
        return input.copy_(reduced)


def simple_all_to_all(input: torch.Tensor, group: Any = None, background: bool = False) -> Any:
    """Slice r of dim 0 to rank r; the slices received in rank order. With
    `background`, (output, wait) (the exchange is done: wait does nothing)."""
    input = input.contiguous()
    if get_world_size(group) > 1:
        input = a2a.all_to_all(input.detach(), comm=_comm(group, input))
    return (input, _done) if background else input


def simple_split(input: torch.Tensor, group: Any = None) -> torch.Tensor:
    """This rank's slice of dim 0 (no communication)."""
    world = get_world_size(group)
    if world == 1:
        return input
    if input.dim() == 0 or input.shape[0] % world:  # only here: the collectives leave the check to a2a's
        raise ValueError(f"simple_split: dim 0 of a {tuple(input.shape)} tensor does not split into {world} equal "
                         "slices (one per rank of the group)")
    return input.contiguous().chunk(world, dim=0)[get_world_rank(group)]


def simple_reduce_scatter(input: torch.Tensor, group: Any = None, op: Any = SUM) -> torch.Tensor:
    """This rank's slice of dim 0 of the reduction over the group."""
    if get_world_size(group) == 1:
        return input
    return a2a.reduce_scatter(input.detach().contiguous(), comm=_comm(group, input),
                              op=_op(op, "simple_reduce_scatter"))


def simple_all_gather(input: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Every rank's `input` concatenated along dim 0, in rank order (a 0-d input gives (W,))."""
    if get_world_size(group) == 1:
        return input
    flat = input.detach().contiguous().reshape(1, -1)
    gathered = a2a.all_gather(flat, comm=_comm(group, input))
    return gathered.view([-1, *input.shape[1:]])


def _done(*_: Any) -> None:
    """The wait of an exchange already complete."""


# -- with backward ---------------------------------------------------------------------------------

def _new(output: torch.Tensor, input: torch.Tensor) -> torch.Tensor:
    """A Function's output: a view where a one-rank group returned the input itself."""
    return output.view_as(output) if output is input else output


class _AllGather(torch.autograd.Function):
    """Gather along dim 0; backward: the reduce-scatter (`fused`) or this rank's slice (Tutel's choice:
    every rank's gradient is assumed equal)."""

    @staticmethod
    def forward(ctx, input, fused, group):
        ctx.fused, ctx.group = fused, group
        return _new(simple_all_gather(input, group), input)

    @staticmethod
    def backward(ctx, grad):
        return (simple_reduce_scatter if ctx.fused else simple_split)(grad, ctx.group), None, None


class _Split(torch.autograd.Function):
    """This rank's slice of dim 0; backward: the gradients gathered."""

    @staticmethod
    def forward(ctx, input, group):
        ctx.group = group
        return _new(simple_split(input, group), input)

    @staticmethod
    def backward(ctx, grad):
        return simple_all_gather(grad, ctx.group), None


class _ForwardAllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, op, group):
        return _new(simple_all_reduce(input, group, op), input)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _BackwardAllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, op, group):
        ctx.op, ctx.group = op, group
        return input.view_as(input)

    @staticmethod
    def backward(ctx, grad):
        return simple_all_reduce(grad, ctx.group, ctx.op), None, None


def _along(input: torch.Tensor, dim: int, name: str, run: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """run() along `dim`: dim swapped to the front and back."""
    if input.dim() == 0:
        raise ValueError(f"{name}: a 0-d tensor has no dim {dim}")
    dim = _axis(dim, input.dim(), name, "dim")
    swapped = input if dim == 0 else input.transpose(0, dim)
    out = run(swapped.contiguous())
    return out if dim == 0 else out.transpose(0, dim)


def _axis(axis: int, ndim: int, name: str, what: str) -> int:
    if isinstance(axis, bool) or not isinstance(axis, int) or not -ndim <= axis < ndim:
        raise ValueError(f"{name}: {what} {axis!r} is not a dim of a {ndim}-d tensor")
    return axis % ndim


def all_to_all(input: torch.Tensor, input_dim: int, output_dim: int, group: Any = None, background: bool = False,
               use_2dh: bool = False) -> Any:
    """Tutel's flexible all-to-all with backward: dim `output_dim` split into
    W slices, slice r to rank r; the slices received concatenated along
    `input_dim`, in rank order (the layer's dispatch is all_to_all(x, 1, 0):
    (E, C, M) -> (E / W, W C, M)). Equal dims: `input` itself, as in Tutel.
    `use_2dh`: Tutel's two-level algorithm. `background`: a callable that
    returns the result (the exchange is done at the call)."""
    if use_2dh and background:
        raise ValueError("all_to_all: background=True with use_2dh=True is not supported (nor in Tutel)")
    input_dim = _axis(input_dim, input.dim(), "all_to_all", "input_dim")
    output_dim = _axis(output_dim, input.dim(), "all_to_all", "output_dim")
    if input_dim != output_dim and get_world_size(group) > 1:
        input = a2a_torch.all_to_all_flex(input.contiguous(), comm=_comm(group, input), split_axis=output_dim,
                                          concat_axis=input_dim, algo="2dh" if use_2dh else "linear")
    return (lambda *_: input) if background else input


def all_to_all_single(input: torch.Tensor, group: Any = None) -> torch.Tensor:
    """simple_all_to_all with backward (the reverse exchange)."""
    if get_world_size(group) == 1:
        return input
    return a2a_torch.all_to_all(input.contiguous(), comm=_comm(group, input))


def all_gather(input: torch.Tensor, dim: int, fused: bool = False, group: Any = None) -> torch.Tensor:
    """Every rank's `input` concatenated along `dim`; backward: the
    reduce-scatter when `fused`, else this rank's slice (Tutel's)."""
    return _along(input, dim, "all_gather", lambda x: _AllGather.apply(x, fused, group))


def reduce_scatter(input: torch.Tensor, dim: int, group: Any = None) -> torch.Tensor:
    """This rank's slice along `dim` of the sum over the group; backward: the gradients gathered."""
    def run(x: torch.Tensor) -> torch.Tensor:
        return x if get_world_size(group) == 1 else a2a_torch.reduce_scatter(x, comm=_comm(group, x))

    return _along(input, dim, "reduce_scatter", run)


def spatial_split(input: torch.Tensor, dim: int, group: Any = None) -> torch.Tensor:
    """This rank's slice along `dim`; backward: the gradients gathered."""
    return _along(input, dim, "spatial_split", lambda x: _Split.apply(x, group))


def allreduce_forward(input: torch.Tensor, op: Any = SUM, group: Any = None) -> torch.Tensor:
    """The reduction over the group; backward: the gradient as it is."""
    _op(op, "allreduce_forward")
    return _ForwardAllReduce.apply(input, op, group)


def allreduce_backward(input: torch.Tensor, op: Any = SUM, group: Any = None) -> torch.Tensor:
    """`input` as it is; backward: the gradients reduced over the group."""
    _op(op, "allreduce_backward")
    return _BackwardAllReduce.apply(input, op, group)


def zero_gather(input: torch.Tensor, full_shape: Sequence[int] | None = None, group: Any = None) -> torch.Tensor:
    """The slices of zero_scatter gathered (fused backward), cut to `full_shape`
    (default: dim 0 times the group's size)."""
    if not full_shape:
        full_shape = [input.shape[0] * get_world_size(group), *input.shape[1:]]
    numel = int(np.prod([int(n) for n in full_shape], dtype=np.int64))
    gathered = _AllGather.apply(input, True, group).reshape(-1)
    if gathered.numel() < numel:
        raise ValueError(f"zero_gather: the group's slices hold {gathered.numel()} elements, fewer than the "
                         f"{numel} of full_shape {list(full_shape)}")
    return gathered[:numel].view(list(full_shape))


def zero_scatter(input: torch.Tensor, scatter_fn: Callable[..., torch.Tensor],
                 group: Any = None) -> tuple[torch.Tensor, torch.Size]:
    """(scatter_fn(flat, group=group), input.shape): `input` flattened, padded
    with zeros to a multiple of the group's size."""
    world = get_world_size(group)
    flat = input.reshape(-1)
    if flat.numel() % world:
        padded = flat.new_zeros([-(-flat.numel() // world) * world])
        padded[: flat.numel()] = flat
        flat = padded
    return scatter_fn(flat, group=group), input.shape


# -- uneven, batched (Tutel's batch_*_v) ---------------------------------------------------------

def _flat_list(datas: Any, name: str) -> list[torch.Tensor]:
    if not isinstance(datas, (list, tuple)) or not datas:
        raise TypeError(f"{name}: datas must be a non-empty list or tuple of tensors, got {type(datas).__name__}")
    return [data.contiguous().view(-1) for data in datas]


def batch_all_to_all_v(datas: Sequence[torch.Tensor], partition_sizes: Any,
                       group: Any = None) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Each tensor of `datas` flattened: its first partition_sizes[0]
    elements to rank 0, the next partition_sizes[1] to rank 1, ...; returns
    (the received elements of each, flat, in rank order; the sizes received
    from each rank, (W,) int64)."""
    flats = _flat_list(datas, "batch_all_to_all_v")
    sizes = torch.as_tensor(partition_sizes).to(device=flats[0].device, dtype=torch.int64).reshape(-1)
    counts = sizes.cpu().numpy()
    if get_world_size(group) == 1:  # at W > 1 a2a's exchanges check the sizes, and tell every rank
        for i, flat in enumerate(flats):
            if counts.shape != (1,) or int(counts.sum()) != flat.numel():
                raise ValueError(f"batch_all_to_all_v: datas[{i}] has {flat.numel()} elements, but partition_sizes "
                                 f"is {counts.tolist()} (one size per rank of a group of 1)")
        return list(flats), sizes
    received_sizes = simple_all_to_all(sizes, group)
    return [a2a.all_to_all_v(flat.detach(), counts, comm=_comm(group, flat))[0] for flat in flats], received_sizes


def batch_all_gather_v(datas: Sequence[torch.Tensor], group: Any = None) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Each tensor of `datas` flattened (all of one length on a rank, any
    length across ranks), every rank's concatenated in rank order; returns
    (those, each rank's length, (W,) int64)."""
    flats = _flat_list(datas, "batch_all_gather_v")
    size = torch.tensor([flats[0].numel()], dtype=torch.int64, device=flats[0].device)
    if get_world_size(group) == 1:  # at W > 1 a2a's all-gather checks the sizes, and tells every rank
        lengths = {flat.numel() for flat in flats}
        if len(lengths) != 1:
            raise ValueError(f"batch_all_gather_v: the tensors of datas differ in size ({sorted(lengths)} elements)")
        return list(flats), size
    sizes = simple_all_gather(size, group)
    counts = sizes.cpu().numpy()
    return [a2a.all_gather_v(flat.detach(), counts, comm=_comm(group, flat)) for flat in flats], sizes


# -- the sharded optimizer ---------------------------------------------------------------------------

class TutelDistributedOptimizer:
    """Tutel's ZeRO-style optimizer: every parameter but the experts' (those
    marked ``_tutel_expert``, as moe_layer marks them) is kept as this rank's
    slice; step() reduce-scatters their gradients (averaged over the group
    with `average_shared`), steps the local optimizer on the slices and the
    experts, and gathers the parameters back.

        optimizer = TutelDistributedOptimizer(model.parameters(), group).warp_local(torch.optim.SGD, lr=0.1)
    """

    def __init__(self, params: Any, group: Any = None, average_shared: bool = False):
        params = list(params)
        self.params = [p for p in params if not hasattr(p, "_tutel_expert")]
        self.expert_params = [p for p in params if hasattr(p, "_tutel_expert")]
        self.shapes = [p.shape for p in self.params]
        self.group, self.average_shared = group, average_shared
        self.virt_params: list[torch.Tensor] = []
        self.local_optim: torch.optim.Optimizer | None = None

    def chunk_param(self) -> None:
        """This rank's slice of each shared parameter, as a new leaf."""
        self.virt_params = [zero_scatter(p.detach(), simple_split, self.group)[0].clone().requires_grad_(True)
                            for p in self.params]

    def chunk_grad(self) -> None:
        """Each slice's gradient: the reduce-scatter of the parameter's. A
        parameter with a gradient on some ranks only (used by their forwards
        alone) counts zeros on the others, so every rank joins its
        reduce-scatter (Tutel's ranks would wait); one with none anywhere
        keeps none. Where gradients are has one small all-reduce of its own."""
        world = get_world_size(self.group)
        if not self.params:
            return
        mine = torch.tensor([p.grad is not None for p in self.params], dtype=torch.int32,
                            device=self.params[0].device)
        anywhere = simple_all_reduce(mine, self.group, op=dist.ReduceOp.MAX).tolist()
        for p, virt, some in zip(self.params, self.virt_params, anywhere, strict=True):
            if not some:
                virt.grad = None
                continue
            grad = (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
            virt.grad = zero_scatter(grad / world if self.average_shared else grad, simple_reduce_scatter,
                                     self.group)[0]

    def restore(self) -> None:
        """The parameters from every rank's slice."""
        with torch.no_grad():
            for p, virt, shape in zip(self.params, self.virt_params, self.shapes, strict=True):
                p.copy_(simple_all_gather(virt.detach(), self.group).reshape(-1)[: shape.numel()].view(shape))

    def warp_local(self, local_optim: Callable[..., torch.optim.Optimizer], *args: Any,
                   **kwargs: Any) -> TutelDistributedOptimizer:
        """Builds `local_optim(slices + experts, *args, **kwargs)`; returns self."""
        self.chunk_param()
        self.local_optim = local_optim(self.virt_params + self.expert_params, *args, **kwargs)
        return self

    def zero_grad(self) -> None:
        for p in self.params + self.expert_params:
            if p.grad is not None:
                p.grad.detach_()
                p.grad.zero_()

    def step(self) -> None:
        if self.local_optim is None:
            raise RuntimeError("TutelDistributedOptimizer.step: call warp_local(optimizer_class, ...) first")
        with torch.no_grad():  # the parameters as they are now (a checkpoint loaded since), no communication
            for p, virt in zip(self.params, self.virt_params, strict=True):
                virt.copy_(zero_scatter(p.detach(), simple_split, self.group)[0])
        self.chunk_grad()
        self.local_optim.step()
        self.restore()
