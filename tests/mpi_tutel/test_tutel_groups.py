"""group= under mpirun: the job's communicator with nothing initialized
(the MPI world), and torch.distributed gloo groups mapped onto the MPI
sub-communicator of the same ranks in group order, as a CPU job launched by
mpirun with gloo initialized (Tutel's system.init_data_model_parallel) has
them. The module initializes torch.distributed itself, last."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from launcher import init_gloo_under_mpirun

from moe_runtime import moe as tutel_moe
from moe_runtime.moe.communicator import communicator
from moe_runtime.reference import moe_reference

MODEL_DIM, HIDDEN = 8, 16


def layer(**options):
    return tutel_moe.moe_layer(gate_type={"type": "top", "k": 2}, model_dim=MODEL_DIM,
                               experts={"type": "ffn", "num_experts_per_device": 1, "hidden_size_per_expert": HIDDEN},
                               seeds=(3, 4, 5), **options).double()


def tokens(rank: int) -> torch.Tensor:
    return torch.randn(4 + rank, MODEL_DIM, generator=torch.Generator().manual_seed(50 + rank), dtype=torch.float64)


def check_against_reference(moe, members: list[int], my_index: int) -> None:
    """The layer's output on this rank's tokens against the float64 reference over the members' tokens."""
    whole = moe.gather_experts()
    xs = [tokens(rank) for rank in members]
    ys, _, _ = moe_reference(xs, moe.gates[0].wg.weight.detach(), whole, top_k=2, capacity_factor=1.0)
    torch.testing.assert_close(moe(xs[my_index]), ys[my_index], rtol=0, atol=1e-12)


def test_with_nothing_initialized_the_layer_runs_on_the_mpi_world(world):
    assert not dist.is_initialized()
    moe = layer()
    assert (moe.comm.size, moe.comm.rank) == (world.Get_size(), world.Get_rank())
    assert moe.global_expert_count(1) == world.Get_size()
    check_against_reference(moe, list(range(world.Get_size())), world.Get_rank())
    assert layer().comm is moe.comm  # one communicator per group and device


def test_gloo_groups_under_mpirun_map_onto_mpi_sub_communicators(world):
    size, mpi_rank = world.Get_size(), world.Get_rank()
    if size < 2:
        pytest.skip("needs 2 ranks")
    # torch's ranks in another order than MPI's: the mapping must follow torch's.
    torch_rank = (mpi_rank + 1) % size
    init_gloo_under_mpirun(world, torch_rank)
    try:
        moe = layer()
        assert (moe.comm.size, moe.comm.rank) == (size, torch_rank), "the default group, in torch's rank order"
        members = [0, size - 1] if size > 2 else [0, 1]  # torch ranks
        group = dist.new_group(members)  # collective over the whole world
        if torch_rank in members:
            sub = layer(group=group)
            assert (sub.comm.size, sub.comm.rank) == (2, members.index(torch_rank))
            assert sub.global_expert_count(1, group=group) == 2
            assert communicator(group, "cpu") is sub.comm
            xs_ranks = members  # the reference's tokens by torch rank
            whole = sub.gather_experts()
            xs = [tokens(r) for r in xs_ranks]
            ys, _, _ = moe_reference(xs, sub.gates[0].wg.weight.detach(), whole, top_k=2, capacity_factor=1.0)
            i = members.index(torch_rank)
            torch.testing.assert_close(sub(xs[i]), ys[i], rtol=0, atol=1e-12)
        dist.barrier()
    finally:
        dist.destroy_process_group()
