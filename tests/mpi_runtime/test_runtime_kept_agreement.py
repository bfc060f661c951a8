"""The layer's agreement kept while every rank's row repeats
(moe_runtime/flows/kept.py): no all-gather from the third equal call on;
training equal, bit for bit, to a twin layer on a communicator without the
cross-rank check (which never keeps it); a rank whose tokens change is met
by the others' first exchange, and the call still computes the right thing;
a rank whose arguments or input differ once the agreement is kept still
raises on every rank, naming the cause; where the flow cannot be met in its
first exchange (sharded experts, a capacity from the routing) every call
gathers; with d = 2 the agreement is kept too (the first chunk's exchange
meets a changed rank, and the chunks behind it do not start)."""

from __future__ import annotations

import pytest
import torch
from checks import counting_alone
from runtime_util import experts_cases, make_layer, random_rows, suite_comm, train_step, whole_expert_cases

import a2a


@pytest.fixture(scope="module")
def unchecked_comm(world):
    return suite_comm(world, cross_check=False)


def forward_collectives(layer, x, **options):
    with counting_alone() as cost:
        y = layer(x, **options)
    return y, cost.counters.collectives


def needs_two_ranks(comm):
    if comm.size < 2:
        pytest.skip("a kept agreement needs two ranks (one rank agrees with nobody)")


DEGREES = pytest.mark.parametrize("degree", [1, 2])  # a2a_ffn_overlap_degree: one chunk, or a pipeline


@DEGREES
def test_from_the_third_equal_call_no_all_gather_and_the_same_training(comm, unchecked_comm, degree):
    needs_two_ranks(comm)
    num_experts = whole_expert_cases(comm)[0]
    layer = make_layer(comm, num_experts, a2a_ffn_overlap_degree=degree)
    twin = make_layer(unchecked_comm, num_experts, a2a_ffn_overlap_degree=degree)  # never keeps the agreement
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (layer, twin)]
    x = random_rows(12, seed=comm.rank)
    counts = []
    for step in range(5):
        ys = [train_step(m, x, o) for m, o in zip((layer, twin), optimizers, strict=True)]
        assert torch.equal(ys[0], ys[1]), f"step {step}: the kept agreement changed the result"
        counts.append(forward_collectives(layer, x)[1])
    # The forward's calls: gathered at the first two calls (counts[0] is the second step's extra
    # forward), kept from the third: one collective fewer, the all-gather.
    assert counts[-1] == counts[-2] == counts[0] - 1, counts


@DEGREES
def test_a_rank_whose_tokens_change_is_met_and_the_call_is_right(comm, unchecked_comm, degree):
    needs_two_ranks(comm)
    num_experts = whole_expert_cases(comm)[0]
    layer = make_layer(comm, num_experts, a2a_ffn_overlap_degree=degree)
    twin = make_layer(unchecked_comm, num_experts, a2a_ffn_overlap_degree=degree)
    x = random_rows(10, seed=comm.rank)
    for _ in range(3):
        layer(x), twin(x)
    _, kept = forward_collectives(layer, x)
    changed = random_rows(7 if comm.rank == comm.size - 1 else 10, seed=100 + comm.rank)
    y, collectives = forward_collectives(layer, changed)
    assert torch.equal(y, twin(changed))
    # The changed call: the first exchange that met the changed rank's all-gather, then the all-gather of
    # every rank, then the call's own collectives: more than a kept call's.
    assert collectives > kept, (collectives, kept)
    for _ in range(3):
        y, collectives = forward_collectives(layer, changed)
    assert torch.equal(y, twin(changed)) and collectives == kept, (collectives, kept)


@pytest.mark.parametrize("argument, values", [
    ("top_k", lambda rank: 1 + rank % 2),
    ("algo", lambda rank: ("linear", "2dh")[rank % 2]),
])
@DEGREES
def test_a_rank_that_differs_once_the_agreement_is_kept_raises_on_every_rank(comm, argument, values, degree):
    needs_two_ranks(comm)
    layer = make_layer(comm, whole_expert_cases(comm)[0], a2a_ffn_overlap_degree=degree)
    x = random_rows(8, seed=comm.rank)
    for _ in range(3):
        layer(x)
    with pytest.raises(a2a.MismatchError, match=argument):
        layer(x, **{argument: values(comm.rank)})
    assert layer(x).shape == x.shape  # the layer still works afterwards


def test_a_rank_with_a_bad_argument_once_the_agreement_is_kept_fails_on_every_rank(comm):
    needs_two_ranks(comm)
    layer = make_layer(comm, whole_expert_cases(comm)[0])
    x = random_rows(8, seed=comm.rank)
    for _ in range(3):
        layer(x)
    bad = comm.rank == comm.size - 1
    with pytest.raises(ValueError if bad else a2a.RemoteError, match="gate_index" if bad else "rank"):
        layer(x, gate_index=5 if bad else 0)  # the layer has one gate: this rank's own error
    assert layer(x).shape == x.shape


@pytest.mark.parametrize("case", ["sharded", "dropless capacity", "unchecked"])
def test_where_the_first_exchange_cannot_meet_a_changed_rank_every_call_gathers(comm, unchecked_comm, case):
    needs_two_ranks(comm)
    num_experts = whole_expert_cases(comm)[0]
    options = {}
    if case == "sharded":
        num_experts = next((e for e in experts_cases(comm.size) if e < comm.size), None)
        if num_experts is None:
            pytest.skip("no expert can be sharded here")
    elif case == "dropless capacity":
        options["capacity_factor"] = 0.0
    layer = make_layer(unchecked_comm if case == "unchecked" else comm, num_experts, **options)
    x = random_rows(8, seed=comm.rank)
    counts = [forward_collectives(layer, x)[1] for _ in range(4)]
    assert len(set(counts)) == 1, counts
