"""The dropless flow (MoELayer(flow="dropless")): every routed choice
reaches its expert. Against the float64 reference with a capacity large
enough that nothing drops, and against the expert flow (Tutel's capacity
flow) at such a capacity; its errors."""

from __future__ import annotations

import pytest
import torch
from checks import counting_alone
from runtime_util import (
    DEVICE,
    NOTHING_DROPS,
    assert_matches,
    make_layer,
    reference,
    run_layer,
    tokens_of,
    whole_expert_cases,
    whole_expert_runs,
)

import moe_runtime
from moe_runtime import FlexConfig
from moe_runtime.common.host_values import all_reduce_values


@pytest.mark.parametrize("dtype, tolerance", [(torch.float64, 1e-12), (torch.float32, 1e-5)], ids=["f64", "f32"])
@pytest.mark.parametrize("k", [1, 2])
def test_dropless_equals_the_reference_that_drops_nothing(comm, dtype, tolerance, k):
    for layer, what in whole_expert_runs(comm, "dropless", dtype, tolerance, k):
        assert layer.last_plan.dropped == 0 and (layer.last_plan.r, layer.last_plan.d) == (1, 1), what


def test_dropless_equals_the_expert_flow_when_nothing_drops(comm):
    num_experts = whole_expert_cases(comm)[0]
    padded = make_layer(comm, num_experts, capacity_factor=NOTHING_DROPS)
    dropless = make_layer(comm, num_experts, flow="dropless")
    a, b = (run_layer(layer, comm, torch.float64) for layer in (padded, dropless))
    assert padded.last_plan.dropped == 0
    assert_matches(b, (*a, None), 1e-12, "dropless against capacity")
    plan, world = padded.last_plan, comm.size
    assert plan.rows_sent == num_experts * plan.buffer_capacity * (world - 1) // world  # every other rank's blocks


def test_a_capacity_that_drops_is_not_what_dropless_computes(comm):
    """At f = 0.25 the expert flow drops choices; dropless serves them
    all: it equals the reference without drops, not the one with."""
    num_experts = whole_expert_cases(comm)[0]
    padded = make_layer(comm, num_experts, capacity_factor=0.25)
    dropless = make_layer(comm, num_experts, flow="dropless")
    run_layer(padded, comm, torch.float64)
    dropped = all_reduce_values([padded.last_plan.dropped], comm)
    assert int(dropped[0]) > 0
    got = run_layer(dropless, comm, torch.float64)
    assert_matches(got, reference(dropless, comm, torch.float64, capacity_factor=NOTHING_DROPS), 1e-12, "dropless")
    y_padded = run_layer(padded, comm, torch.float64)[0]
    difference = float((y_padded - got[0]).abs().max())
    assert all_reduce_values([difference], comm, op="max")[0] > 1e-6  # some rank's tokens lost a choice


def test_every_rank_may_hold_a_different_number_of_tokens_and_experts_may_get_none(comm):
    """All tokens of every rank routed to expert 0 (a gate that only sees it):
    the other experts receive no rows, and nothing is lost."""
    num_experts = whole_expert_cases(comm)[0]
    layer = make_layer(comm, num_experts, k=1, flow="dropless")
    with torch.no_grad():
        layer.gates[0].wg.weight.zero_()
        layer.gates[0].wg.weight[0].fill_(1.0)  # with positive inputs, expert 0 always wins
    x = tokens_of(comm.rank, torch.float64).abs() + 0.1
    y = layer(x)
    experts = layer.gather_experts()
    hidden = torch.relu(x @ experts["batched_fc1_w"][0].T + experts["batched_fc1_bias"][0])
    gate = torch.softmax(layer.gates[0].wg(x), dim=1)[:, :1]  # k = 1: the gate is expert 0's score
    want = gate * (hidden @ experts["batched_fc2_w"][0] + experts["batched_fc2_bias"][0])
    assert torch.allclose(y, want, atol=1e-12)
    assert layer.last_plan.capacity == (sum(5 + 2 * i for i in range(comm.size)) if comm.rank == 0 else 0)
    assert layer.last_plan.rows_sent == (0 if comm.rank == 0 else x.shape[0])  # all to rank 0's expert 0


def test_dropless_errors(comm):
    num_experts = whole_expert_cases(comm)[0]
    layer = make_layer(comm, num_experts, flow="dropless")
    x = tokens_of(comm.rank, torch.float64)
    with pytest.raises(ValueError, match="r = 1 only"):
        layer(x, adaptive_r=0)
    with pytest.raises(ValueError, match="d = 1 only"):
        layer(x, a2a_ffn_overlap_degree=2)
    for options, match in [({"a2a_ffn_overlap_degree": 2}, "d = 1 only"), ({"parallel_type": "data"}, "r = 1"),
                           ({"parallel_type": "adaptive:auto"}, "nothing for the dictionary"),
                           ({"is_postscore": False}, "is_postscore"),
                           ({"batch_prioritized_routing": True}, "batch_prioritized_routing"),
                           ({"flow": "sorted"}, "flow must be one of")]:
        options = {"flow": "dropless", **options}
        with pytest.raises(ValueError, match=match):
            make_layer(comm, num_experts, **options)
    if comm.size > 1:  # E = W / 2: two ranks share each expert
        with pytest.raises(ValueError, match="whole experts on each rank"):
            make_layer(comm, comm.size // 2, flow="dropless")
        # No wait: one rank only (an exchange sizes its messages by the counts).
        with pytest.raises(ValueError, match=f"takes one rank.*here {comm.size} ranks"):
            make_layer(comm, num_experts, flow=moe_runtime.Dropless(wait=False))


@pytest.mark.parametrize("slots", [1, 2, 64], ids=["one-slot", "two-slots", "all-fit"])
def test_the_expert_cache_serves_inference_bitwise_equal_to_the_uncached_layer(comm, slots):
    """Inference with an ExpertCache equals the uncached dropless layer
    bitwise (on CUDA too, the misses copied on the cache's stream), whether
    the batch's experts fit the slots at once (fetched before the exchange)
    or not (fetched one at a time); training bypasses it, and an optimizer
    step rebinds it to the new weights."""
    num_experts = whole_expert_cases(comm)[0]
    local = num_experts // comm.size
    cache = moe_runtime.ExpertCache(min(slots, local), "lifo", record=True)
    cached = make_layer(comm, num_experts, flow=moe_runtime.Dropless(expert_cache=cache))
    plain = make_layer(comm, num_experts, flow="dropless")
    x = tokens_of(comm.rank, torch.float64)
    for step in range(3):
        with torch.no_grad():
            assert torch.equal(cached(x * (step + 1)), plain(x * (step + 1))), step
    assert len(cache.recorded) == 3 and all(batch <= set(range(local)) for batch in cache.recorded)
    # The slots are on the tokens' device; on CUDA the misses came from page-locked host copies on the
    # cache's own copy stream (the compute stream waited for them).
    assert all(pool.device == DEVICE for pool in cache.pool.values())
    assert (cache.copy_stream is not None) == (DEVICE.type == "cuda")
    assert all(w.device.type == "cpu" and (DEVICE.type != "cuda" or w.is_pinned()) for w in cache.host.values())
    report = cache.report()
    assert report["requests"] == sum(map(len, cache.recorded)) and report["hits"] + report["misses"] == report["requests"]
    if slots >= local:
        assert report["misses"] == len(set().union(*cache.recorded))  # cold misses only
    assert report["bytes_copied"] == report["misses"] * cache.bytes_per_expert  # every miss copied in

    # A recording call trains on the parameters, not the cache.
    requests = report["requests"]
    y = cached(x)
    assert y.requires_grad and cache.report()["requests"] == requests
    optimizer = torch.optim.SGD(cached.parameters(), lr=0.5)
    (y.square().sum()).backward()
    optimizer.step()
    with torch.no_grad():
        for p, q in zip(plain.parameters(), cached.parameters()):
            p.copy_(q)
        assert torch.equal(cached(x), plain(x))  # the cache holds the stepped weights


def test_the_expert_cache_must_be_an_expert_cache(comm):
    # expert_cache= without dispatcher="dropless" (deprecated keywords): tests/unit/test_runtime_settings.py
    num_experts = whole_expert_cases(comm)[0]
    with pytest.raises(TypeError, match="expert_cache must be a moe_runtime.ExpertCache"):
        make_layer(comm, num_experts, flow=moe_runtime.Dropless(expert_cache=2))


@pytest.mark.parametrize("flow", ["dropless", "flex"])
def test_a_step_waits_once_in_its_forward_and_never_in_its_backward(comm, flow):
    """The first permute's wait for the counts (they size the exchange), and no other: the local
    permutation after the exchange knows its counts and routes every row (permute(wait=False)); on CUDA
    the staged transport waits at every exchange as well."""
    if DEVICE.type == "cuda":
        pytest.skip("the staged MPI transport waits for the stream before every exchange")
    num_experts = whole_expert_cases(comm)[0]
    layer = make_layer(comm, num_experts, capacity_factor=0.0, flow=FlexConfig() if flow == "flex" else flow)
    x = tokens_of(comm.rank, torch.float64).requires_grad_()
    for _ in range(3):
        with counting_alone() as forward:
            y = layer(x)
        with counting_alone() as backward:
            (y.sum() + layer.l_aux).backward()
    assert (forward.counters.host_waits, backward.counters.host_waits) == (1, 0), (forward.counters,
                                                                                  backward.counters)
