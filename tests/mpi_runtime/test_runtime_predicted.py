"""The layer on the arrangement of MPI and NCCL, with host memory (the test
factory's "predicted" communicator: docs/algorithms.md, "The predicted
check"): once its steps repeat, every collective of a training step posts its
check instead of a round, and the training equals, bit for bit, that of a
twin layer on an MPI communicator; a rank whose tokens change costs a round
of every rank's next calls, which agree."""

from __future__ import annotations

import pytest
import torch
from checks import predicted_comm
from runtime_util import DEVICE, make_layer, random_rows, suite_comm, train_step, whole_expert_cases

import a2a


@pytest.mark.parametrize("degree", [1, 2])
def test_training_posts_every_check_and_equals_mpi(world, degree):
    if world.Get_size() < 2 or DEVICE.type != "cpu":
        pytest.skip("a check between ranks, on host memory")
    comm = predicted_comm(world)
    num_experts = whole_expert_cases(comm)[0]
    layers = [make_layer(c, num_experts, a2a_ffn_overlap_degree=degree) for c in (comm, suite_comm(world))]
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05) for m in layers]
    x = random_rows(12, seed=comm.rank)
    rounds = []
    for step in range(6):
        if step == 4:  # a rank's tokens change: every rank's next calls change alike, and agree by round
            x = random_rows(9 if comm.rank == comm.size - 1 else 12, seed=50 + comm.rank)
        with a2a.counting() as cost:
            ys = [train_step(m, x, o) for m, o in zip(layers, optimizers, strict=True)]
        assert torch.equal(ys[0], ys[1]), f"step {step}: the predicted check changed the result"
        rounds.append(cost.counters.check_rounds)
    comm.check()
    # The MPI twin checks in its messages (no check round): every round counted is the predicted comm's.
    assert rounds[3] == 0, rounds  # steps repeat from the second on: every call of the fourth predicted
    assert rounds[4] > 0, rounds  # the changed step's calls were not predicted


def test_the_call_agreement_crosses_mpi_alone(world):
    # The layer agrees on its call over its host twin (moe_runtime/common/host_values.py), not on the
    # predicted communicator: on a GPU its row of host values then makes no copy to the device and back,
    # each a wait for the stream. The exchanges run on the layer's split of the communicator, so nothing
    # of a training step runs on the communicator itself.
    if world.Get_size() < 2 or DEVICE.type != "cpu":
        pytest.skip("a check between ranks, on host memory")
    comm = predicted_comm(world)
    layer = make_layer(comm, whole_expert_cases(comm)[0])
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.05)
    x = random_rows(12, seed=comm.rank)
    for step in range(4):
        with a2a.counting(comm) as on_comm:
            train_step(layer, x, optimizer)
        assert on_comm.counters.collectives == 0, (step, on_comm.counters)
    comm.check()
