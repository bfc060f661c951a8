"""One collective and one MoE layer step with an installed a2a, on every rank of an mpirun.

    python -m a2a.launch --np 2 -- python tests/install/smoke.py

Run by tests/install/run.py with the Python of a fresh venv that has only the built wheel (and
torch), from outside the source tree, so that what it imports is what was installed.
"""

from __future__ import annotations

import math

import numpy as np
from mpi4py import MPI

import a2a


def collective(comm: a2a.Comm) -> None:
    """all_to_all of NumPy rows: rank r sends rows [2j, 2j+2) of its array to rank j."""
    rows, columns = 2, 3
    x = np.arange(comm.size * rows * columns, dtype=np.float32).reshape(comm.size * rows, columns)
    x += 1000 * comm.rank
    y = a2a.all_to_all(x, comm=comm)
    block = x[rows * comm.rank : rows * (comm.rank + 1)] - 1000 * comm.rank
    expected = np.concatenate([block + 1000 * peer for peer in range(comm.size)])
    assert np.array_equal(y, expected), f"rank {comm.rank}: all_to_all gave\n{y}\nexpected\n{expected}"


def layer_step(comm: a2a.Comm) -> None:
    """Forward and backward of a top-2 MoELayer with two experts per rank."""
    import torch

    import moe_runtime

    model_dim = 16
    layer = moe_runtime.MoELayer(
        {"type": "top", "k": 2}, model_dim,
        {"type": "ffn", "num_experts_per_device": 2, "hidden_size_per_expert": 32},
        comm=comm, seeds=(1, 2),
    )
    generator = torch.Generator().manual_seed(10 + comm.rank)
    x = torch.randn(8 + comm.rank, model_dim, generator=generator, requires_grad=True)
    y = layer(x)
    (y.sum() + y.l_aux).backward()
    grads = {"x": x.grad, **{name: p.grad for name, p in layer.named_parameters()}}
    assert y.shape == x.shape and bool(torch.isfinite(y).all()), f"rank {comm.rank}: output {y}"
    for name, grad in grads.items():
        assert grad is not None and bool(torch.isfinite(grad).all()), f"rank {comm.rank}: gradient of {name}"
    assert math.isfinite(float(y.l_aux.detach())), f"rank {comm.rank}: l_aux {y.l_aux}"


def main() -> None:
    comm = a2a.Comm.from_mpi(MPI.COMM_WORLD)
    collective(comm)
    layer_step(comm)
    MPI.COMM_WORLD.Barrier()
    if comm.rank == 0:
        print(f"smoke: all_to_all and one MoELayer step on {comm.size} ranks, a2a from {a2a.__file__}")


if __name__ == "__main__":
    main()
