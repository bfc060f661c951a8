"""The dictionary's other flows on an expert-parallel layer
(MoELayer(..., parallel_type="adaptive:auto", flows=...)): every flow on the
one parameter layout (Tutel's whole experts) against the float64 reference
and each other, with W dividing H and not, after a placement; the
dictionary trying the flows and settling on the fastest under a fake clock,
the same on every rank; the errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from runtime_util import (
    HIDDEN,
    MODEL_DIM,
    NOTHING_DROPS,
    assert_matches,
    experts_spec,
    on_device,
    reference,
    run_layer,
    tokens_of,
    whole_expert_cases,
)

import a2a
import moe_runtime
from moe_runtime.common.host_values import all_gather_values
from moe_runtime.hexa.cache import PipelineSharedCache
from moe_runtime.registry import DICTIONARY_FLOWS as OTHER_FLOWS

TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5}
ALL_FLOWS = ("expert", *OTHER_FLOWS)


def flows_layer(comm, num_experts, dtype=torch.float64, *, k=2, hidden=HIDDEN, extra=None, **options):
    """An adaptive layer with every other flow, the capacity that drops nothing, its own cache."""
    options.setdefault("adaptive", moe_runtime.AdaptiveDictionary(degrees=(1, 2), warmup=0, repeats=1))
    spec = {**experts_spec(num_experts, comm.size), "hidden_size_per_expert": hidden, **(extra or {})}
    flows = [moe_runtime.DataCentric(shared_cache=PipelineSharedCache()) if flow == "data_centric" else flow
             for flow in OTHER_FLOWS]
    layer = moe_runtime.MoELayer({"type": "top", "k": k, "capacity_factor": 0.0}, MODEL_DIM, spec, comm=comm,
                                 seeds=(21, 22), flows=flows, **options)
    return on_device(layer, dtype)


def forced_runs(comm):
    """Each flow, and the expert flow at r = 0 and r = 1 with d = 2: (name, call arguments)."""
    runs = [(flow, {"flow": flow}) for flow in OTHER_FLOWS]
    return runs + [("expert r=0", {"flow": "expert", "adaptive_r": 0}),
                   ("expert r=1 d=2", {"adaptive_r": 1, "a2a_ffn_overlap_degree": 2})]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("k", [1, 2])
def test_every_flow_equals_the_reference(comm, k, dtype):
    for num_experts in whole_expert_cases(comm):
        layer = flows_layer(comm, num_experts, dtype, k=k)
        want = reference(layer, comm, dtype, capacity_factor=NOTHING_DROPS)
        for name, call in forced_runs(comm):
            what = f"{name} E={num_experts} k={k} {dtype}"
            assert_matches(run_layer(layer, comm, dtype, **call), want, TOLERANCE[dtype], what)
            plan = layer.last_plan
            assert plan.flow == call.get("flow", "expert") and plan.dropped == 0, what
        # Data-centric: the forward gathered into the layer's cache, the backward found it there.
        assert (layer.shared_cache.gathers, layer.shared_cache.reuses) == (1, 1)


@pytest.mark.parametrize("case", ["uneven-hidden", "gelu-summed", "no-biases"])
def test_hidden_not_divided_by_the_ranks_other_activations_and_biases(comm, case):
    """H = 17 (not a multiple of any W > 1: model-centric's all_to_all_v path), gelu with summed
    expert gradients, and experts without biases."""
    extra, options, activation = {}, {}, torch.relu
    if case == "gelu-summed":
        extra, options, activation = {"activation_fn": torch.nn.functional.gelu}, {"expert_gradient": "sum"}, \
            torch.nn.functional.gelu
    elif case == "no-biases":
        extra = {"has_fc1_bias": False, "has_fc2_bias": False}
    hidden = HIDDEN + 1 if case == "uneven-hidden" else HIDDEN
    layer = flows_layer(comm, comm.size, hidden=hidden, extra=extra, **options)
    want = reference(layer, comm, torch.float64, capacity_factor=NOTHING_DROPS, activation=activation)
    assert set(want[3]) == set(layer.gather_experts())
    for name, call in forced_runs(comm):
        assert_matches(run_layer(layer, comm, torch.float64, **call), want, 1e-12, f"{name} {case}")


def test_every_flow_after_a_placement(comm):
    """The layer's experts moved to other ranks (place): every flow reads the
    positions the gate's choices are mapped to, and still computes the reference."""
    num_experts = 2 * comm.size
    layer = flows_layer(comm, num_experts)
    layer.place(np.roll(np.arange(num_experts), 3).reshape(comm.size, 2))
    want = reference(layer, comm, torch.float64, capacity_factor=NOTHING_DROPS)
    for name, call in forced_runs(comm):
        assert_matches(run_layer(layer, comm, torch.float64, **call), want, 1e-12, f"{name} after place")


class FlowClock:
    """The layer reads the clock at the start of a step and when its backward
    ends: every second reading advances by the cost of what ran, plus this
    rank's noise (the layer agrees on the maximum)."""

    def __init__(self, layer_ref: list, fastest: str, rank: int):
        self.layer_ref, self.fastest, self.now, self.started = layer_ref, fastest, 0.0, False
        self.noise = np.random.default_rng(rank)

    def cost(self, plan) -> float:
        if plan.flow == self.fastest:
            return 1.0
        return 2.0 + plan.r + plan.d / 10 + {"expert": 0.0, "dropless": 0.3, "data_centric": 0.2,
                                             "model_centric": 0.1}[plan.flow]

    def __call__(self) -> float:
        if self.started:
            self.now += self.cost(self.layer_ref[0].last_plan) * (1.0 + 0.01 * self.noise.random())
        self.started = not self.started
        return self.now


def plans_everywhere(comm, plans) -> np.ndarray:
    codes = np.array([ALL_FLOWS.index(f) * 10000 + r * 100 + d * 10 + ("linear", "2dh").index(a)
                      for f, r, d, a in plans], dtype=np.int64)
    return all_gather_values(codes, comm).reshape(comm.size, -1)


@pytest.mark.parametrize("fastest", ALL_FLOWS)
def test_the_dictionary_tries_every_flow_and_settles_on_the_fastest(comm, fastest):
    ref: list = []
    dictionary = moe_runtime.AdaptiveDictionary(degrees=(1, 2), warmup=0, repeats=1)
    layer = flows_layer(comm, comm.size, adaptive=dictionary, timer=FlowClock(ref, fastest, comm.rank))
    ref.append(layer)
    x = tokens_of(comm.rank, torch.float64)
    plans = []
    for _ in range(14):
        y = layer(x)
        (y.sum() + y.l_aux).backward()
        plan = layer.last_plan
        plans.append((plan.flow, plan.r, plan.d, plan.algo))
    table = plans_everywhere(comm, plans)
    assert (table == table[0]).all(), "the ranks ran different flows"
    capacity = layer.last_plan.capacity
    assert not dictionary.tuning(capacity)
    assert {flow for flow, *_ in plans} == set(ALL_FLOWS)  # every flow was tried
    assert plans[-1][0] == fastest and plans[-2][0] == fastest  # and the fastest kept
    entry = dictionary.entries[capacity // 128]
    assert entry.config.flow == fastest
    two_level = comm.num_nodes > 1 and comm.local_size > 1
    assert entry.trials == 1 + 2 * (2 if two_level else 1) + len(OTHER_FLOWS)  # r = 0, r = 1 x (d, algo), flows
    # The dictionary's JSON restores the choice without a trial.
    restored = moe_runtime.AdaptiveDictionary.from_json(dictionary.to_json(), degrees=(1, 2), warmup=0, repeats=1)
    again = flows_layer(comm, comm.size, adaptive=restored)
    again(x).sum().backward()
    assert again.last_plan.flow == fastest and not restored.tuning(capacity)


def test_construction_errors(comm):
    spec = experts_spec(comm.size, comm.size)

    def build(gate=None, experts=None, **options):
        options.setdefault("parallel_type", "adaptive:auto")
        options.setdefault("flows", OTHER_FLOWS)
        return moe_runtime.MoELayer(gate or {"type": "top", "k": 2, "capacity_factor": 0.0}, MODEL_DIM,
                                    experts or spec, comm=comm, seeds=(1, 2), **options)

    cases = [
        ({"parallel_type": "adaptive:1"}, "choices of the dictionary"),
        ({"gate": {"type": "top", "k": 2, "capacity_factor": 1.0}}, "capacity_factor=1.0.*drops nothing"),
        ({"gate": {"type": "top", "k": 2, "capacity_factor": -1.0}}, "negative factor caps it"),
        ({"is_postscore": False}, "is_postscore must be True"),
        ({"batch_prioritized_routing": True}, "batch_prioritized_routing"),
        ({"flows": ("dropless", "ring")}, "unknown flow 'ring'"),
        ({"flows": ("dropless", "dropless")}, "duplicates"),
        ({"flows": ("data_centric",), "flow": "dropless"}, "flow='expert'"),
        ({"flows": ("dropless",), "flow": moe_runtime.DataCentric(), "parallel_type": "adaptive:1"}, "'flows'"),
        # shared_cache= beside flows= without "data_centric" (deprecated keywords): tests/unit/test_runtime_settings.py
    ]
    if comm.size > 1:
        cases.append(({"experts": experts_spec(1, comm.size)}, "whole experts on every rank"))
        cases.append(({"experts": {**spec, "hidden_size_per_expert": comm.size - 1}, "flows": ("model_centric",)},
                      "smaller than the"))
    for options, message in cases:
        with pytest.raises(ValueError, match=message):
            build(**options)
    with pytest.raises(TypeError, match="flows must be a list or tuple"):
        build(flows="dropless")


def test_call_errors(comm):
    layer = flows_layer(comm, comm.size)
    x = tokens_of(comm.rank, torch.float64)
    with pytest.raises(ValueError, match="capacity_factor=1.0 may drop"):
        layer(x, capacity_factor=1.0)
    with pytest.raises(ValueError, match="flow='ring'"):
        layer(x, flow="ring")
    with pytest.raises(ValueError, match="no r or pipelining degree"):
        layer(x, flow="data_centric", adaptive_r=1)
    with pytest.raises(ValueError, match="exchanges no rows by all-to-all"):
        layer(x, flow="model_centric", algo="linear")
    y = layer(x, flow="dropless", algo="linear")  # the dropless flow takes an algorithm
    assert layer.last_plan.flow == "dropless" and y.shape == x.shape
    if comm.size > 1:
        with pytest.raises(a2a.MismatchError, match="different flow"):
            layer(x, flow="dropless" if comm.rank == 0 else "expert")
    plain = moe_runtime.MoELayer({"type": "top", "k": 2}, MODEL_DIM, experts_spec(comm.size, comm.size), comm=comm,
                                 seeds=(1, 2), parallel_type="adaptive:auto")
    with pytest.raises(ValueError, match="constructed with flows="):
        plain(x, flow="dropless")
    assert "flows=('dropless', 'data_centric', 'model_centric')" in repr(layer)
