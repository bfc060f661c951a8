"""What a layer's training step costs in rounds and waits (a2a.counters, over
the process: the layer's flows use communicators of their own), held as
budgets: on an MPI communicator no check round in the forward or the
backward, with whole experts on every rank (E >= W) and with experts sharded
over ranks (E < W, whose gradients a2a.all_reduce / reduce_scatter reduce):
the exchanges and the reductions carry their check, and the call
agreement's all-gather is kept from the third equal step (whole experts);
no host wait in a step (at f > 0, and at f = 0 with
dropless_capacity="worst_case", route reads nothing back: a2a.route's
wait=False; the CPU counts where a GPU would wait), and the same costs step
after step. On CUDA (the staged transport) every call pays its check by
round and the staged waits: there the budget is the count of collectives."""

from __future__ import annotations

import pytest
import torch
from checks import counting_alone
from launcher import TORCHRUN
from runtime_util import DEVICE, experts_cases, random_rows, two_level, whole_expert_cases
from test_runtime_layer import make_layer


def step_costs(layer, x, algo):
    with counting_alone() as forward:
        y = layer(x, algo=algo)
    with counting_alone() as backward:
        (y.sum() + layer.l_aux).backward()
    return forward.counters, backward.counters


def differences(step, last):
    """The fields in which a step's (forward, backward) costs differ from the last step's."""
    return {
        f"{phase}.{name}": (a, b)
        for phase, one, other in (("forward", step[0], last[0]), ("backward", step[1], last[1]))
        for name, a in one.as_dict().items()
        if (b := getattr(other, name)) != a
    }


def sharded_case(comm):
    """E < W: every expert sharded over W / E ranks (None where W is 1)."""
    return next((e for e in experts_cases(comm.size) if e < comm.size), None)


# The capacity: f = 1, or f = 0 at its worst case (T: read from no tensor, so the agreement is kept too).
CAPACITIES = {"f=1": {}, "f=0 worst_case": {"capacity_factor": 0.0, "dropless_capacity": "worst_case"}}


@pytest.mark.parametrize("capacity", list(CAPACITIES))
@pytest.mark.parametrize("experts", ["whole", "sharded"])
@pytest.mark.parametrize("algo", ["linear", "2dh"])
def test_a_training_step_pays_no_round_for_the_check(comm, algo, experts, capacity):
    if algo == "2dh" and not two_level(comm):
        pytest.skip("2dh differs from linear with more than one node and rank per node")
    num_experts = whole_expert_cases(comm)[0] if experts == "whole" else sharded_case(comm)
    if num_experts is None:
        pytest.skip("no expert can be sharded over one rank")
    layer = make_layer(comm, num_experts, torch.float32, parallel_type="adaptive:1", **CAPACITIES[capacity])
    x = random_rows(16, seed=comm.rank, dtype=torch.float32).requires_grad_()
    # The first step sets up what later steps reuse (buffers, scratch); from the third the layer keeps its
    # agreement (moe_runtime/flows/kept.py: no all-gather while every rank's row repeats).
    for _ in range(2):
        step_costs(layer, x, algo)
    costs = [step_costs(layer, x, algo) for _ in range(3)]
    forward, backward = costs[-1]
    steady = [differences(c, costs[-1]) for c in costs]
    assert not any(steady), steady  # steady: every step costs the same
    assert forward.collectives >= 2 and backward.collectives >= 1, costs[-1]
    if DEVICE.type == "cuda":  # the staged transport: a check round per collective on the CUDA communicators,
        # none for the call agreement's all-gather where it runs (not kept): on the layer's host twin, in band
        assert forward.collectives - forward.check_rounds in (0, 1) and backward.check_rounds == backward.collectives
        return
    assert forward.host_waits + backward.host_waits == 0, costs[-1]  # route reads nothing back
    if TORCHRUN:  # over gloo, which cannot label messages, every collective's check is a round of its own
        assert (forward.check_rounds, backward.check_rounds) == (forward.collectives, backward.collectives)
        return
    assert (forward.check_rounds, backward.check_rounds) == (0, 0), costs[-1]
