"""What a layer's training step costs in rounds and waits (a2a.counters, over
the process: the layer's flows use communicators of their own), held as
budgets: with whole experts on every rank (E >= W), on an MPI communicator
no check round in the forward or the backward (the call agreement's
all-gather and the exchanges carry their check; experts sharded over ranks,
E < W, reduce their gradients with a2a.all_reduce / reduce_scatter, whose
check is a round of its own), at most one host wait per step (route's scan, where a GPU waits for
its counts; counted on the CPU at the same place), and the same costs step
after step. On CUDA (the staged transport) every call pays its check by
round and the staged waits: there the budget is the count of collectives."""

from __future__ import annotations

import pytest
import torch
from runtime_util import DEVICE, random_rows, two_level, whole_expert_cases
from test_runtime_layer import make_layer

import a2a


def step_costs(layer, x, algo):
    with a2a.counting() as forward:
        y = layer(x, algo=algo)
    with a2a.counting() as backward:
        (y.sum() + layer.l_aux).backward()
    return forward.counters, backward.counters


@pytest.mark.parametrize("algo", ["linear", "2dh"])
def test_a_training_step_pays_no_round_for_the_check(comm, algo):
    if algo == "2dh" and not two_level(comm):
        pytest.skip("2dh differs from linear with more than one node and rank per node")
    layer = make_layer(comm, whole_expert_cases(comm)[0], torch.float32, parallel_type="adaptive:1")
    x = random_rows(16, seed=comm.rank, dtype=torch.float32).requires_grad_()
    layer(x, algo=algo)  # the first step sets up what later steps reuse
    costs = [step_costs(layer, x, algo) for _ in range(3)]
    forward, backward = costs[-1]
    assert all(c == costs[-1] for c in costs), costs  # steady: every step costs the same
    assert forward.collectives >= 2 and backward.collectives >= 1, costs[-1]
    if DEVICE.type == "cuda":  # the staged transport: a check round per collective
        assert forward.check_rounds == forward.collectives and backward.check_rounds == backward.collectives
        return
    assert (forward.check_rounds, backward.check_rounds) == (0, 0), costs[-1]
    assert forward.host_waits + backward.host_waits <= 1, costs[-1]
