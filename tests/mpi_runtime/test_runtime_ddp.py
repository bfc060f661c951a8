"""A model holding the layer, wrapped in torch's DistributedDataParallel
after moe_runtime.ddp_ignore_experts(model): DDP leaves every rank's expert
shards alone and all-reduces the rest, so that training equals the layer's
own path (sync_shared_gradients). Without the call, DDP's construction
overwrites every rank's experts with rank 0's (the hazard the call exists
for). Over a gloo group: torchrun's (torchrun configurations), else one made
for the test over TCP under mpirun, and destroyed after it."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from launcher import ON_NAMESPACE_CLUSTER, init_gloo_under_mpirun
from runtime_util import DEVICE, MODEL_DIM, random_rows

import moe_runtime

pytestmark = pytest.mark.skipif(DEVICE.type != "cpu", reason="a gloo group moves CPU tensors")


@pytest.fixture
def gloo(comm):
    """torch.distributed's default group over the communicator's ranks, in its order."""
    if dist.is_initialized():
        yield
        return
    if ON_NAMESPACE_CLUSTER:  # DDP's semantics do not depend on the network; this group's address does
        pytest.skip("a gloo group over the loopback: each namespace node has its own (run without --cluster)")
    from mpi4py import MPI

    init_gloo_under_mpirun(MPI.COMM_WORLD, comm.rank)
    try:
        yield
    finally:
        dist.destroy_process_group()


class Model(torch.nn.Module):
    def __init__(self, comm):
        super().__init__()
        torch.manual_seed(7)  # the dense parts alike on every rank, as a DDP user builds them
        self.pre = torch.nn.Linear(MODEL_DIM, MODEL_DIM).double()
        self.moe = moe_runtime.MoELayer({"type": "top", "k": 2, "capacity_factor": 1.0}, MODEL_DIM,
                                        {"type": "ffn", "num_experts_per_device": 2, "hidden_size_per_expert": 16},
                                        comm=comm, seeds=(1, 100 + comm.rank)).double()  # experts per rank
        self.post = torch.nn.Linear(MODEL_DIM, MODEL_DIM).double()

    def forward(self, x):
        y = self.moe(self.pre(x))
        return self.post(y), y.l_aux


def train(model, step_gradients, comm, steps=3):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        optimizer.zero_grad()
        y, l_aux = model(random_rows(6 + comm.rank + step, 50 * step + comm.rank))
        (y.square().mean() + 0.01 * l_aux).backward()
        step_gradients()
        optimizer.step()


def test_ddp_after_ddp_ignore_experts_trains_as_sync_shared_gradients(comm, gloo):
    wrapped, own = Model(comm), Model(comm)
    experts = {name: p.detach().clone() for name, p in wrapped.named_parameters() if name.startswith("moe.experts")}
    ignored = moe_runtime.ddp_ignore_experts(wrapped)
    assert sorted(ignored) == sorted(experts)
    ddp = torch.nn.parallel.DistributedDataParallel(wrapped)
    for name, before in experts.items():  # DDP's construction left this rank's shards alone
        assert torch.equal(wrapped.get_parameter(name), before), name
    train(ddp, lambda: None, comm)
    train(own, lambda: moe_runtime.sync_shared_gradients(own, comm), comm)
    for (name, got), want in zip(wrapped.named_parameters(), own.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=name)


def test_without_it_ddp_overwrites_the_experts_with_rank_0s(comm, gloo):
    if comm.size < 2:
        pytest.skip("rank 0's experts are this rank's own")
    model = Model(comm)
    before = model.moe.experts.batched_fc1_w.detach().clone()
    torch.nn.parallel.DistributedDataParallel(model)
    kept = torch.equal(model.moe.experts.batched_fc1_w, before)
    assert kept == (comm.rank == 0)
