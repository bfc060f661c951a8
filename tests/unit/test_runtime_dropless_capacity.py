"""MoELayer(dropless_capacity=): the capacity at capacity factor 0, counted
(the largest expert's count, read back: "largest") or the worst case (T,
read from no tensor: "worst_case"). One rank; the ranks' agreement on it,
with unequal token counts, is tests/mpi_runtime/test_runtime_layer.py's."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import moe_runtime
from moe_runtime.bench.dispatched import DispatchedOps
from moe_runtime.gating import capacity

T, M, H = 13, 32, 16


def layer_of(comm, dynamic, factor=0.0, **options):
    gate = {"type": "top", "k": 2, "capacity_factor": factor}
    experts = {"type": "ffn", "num_experts_per_device": 4, "hidden_size_per_expert": H}
    return moe_runtime.MoELayer(gate, M, experts, comm=comm, seeds=(1, 2), dropless_capacity=dynamic, **options)


def step(layer, **call):
    x = torch.randn(T, M, generator=torch.Generator().manual_seed(3), requires_grad=True)
    y = layer(x, **call)
    (y.sum() + y.l_aux).backward()
    return y.detach(), x.grad, {name: p.grad for name, p in layer.named_parameters()}


@pytest.mark.parametrize("options,call", [({}, {}), ({}, {"a2a_ffn_overlap_degree": 2}),
                                          ({"batch_prioritized_routing": True}, {}),
                                          ({"is_postscore": False}, {}), ({"capacity_rule": "a2a"}, {})],
                         ids=["default", "d=2", "prioritized", "prescore", "a2a-rule"])
def test_the_worst_case_computes_what_the_counted_capacity_does(comm, options, call):
    counted, worst = layer_of(comm, "largest", **options), layer_of(comm, "worst_case", **options)
    (y, x_grad, grads), (y_w, x_grad_w, grads_w) = step(counted, **call), step(worst, **call)
    # Nothing is dropped either way; the padding rows of the larger buffer are computed and never read.
    assert torch.equal(y, y_w) and torch.equal(x_grad, x_grad_w)
    for name, grad in grads.items():  # pipelined chunks of other sizes sum the weights' gradients in other orders
        torch.testing.assert_close(grads_w[name], grad, rtol=1e-6, atol=1e-6, msg=name)
    assert worst.last_plan.capacity == T and worst.last_plan.dropped == 0
    assert counted.last_plan.capacity < T  # the counted capacity: 13 tokens' 26 choices over 4 experts


def test_the_worst_case_reads_nothing_back(comm):
    layer = layer_of(comm, "worst_case")
    step(layer)
    ops = DispatchedOps()
    with ops:
        step(layer)
    assert ops.ops["_local_scalar_dense"] == 0, dict(ops.ops)


@pytest.mark.parametrize("factor", [-0.5, 1.0])
def test_a_bound_or_a_positive_factor_is_unchanged(comm, factor):
    """f < 0 still counts (its bound and the counts together decide), f > 0 never counts: the same layer."""
    counted, worst = layer_of(comm, "largest", factor), layer_of(comm, "worst_case", factor)
    assert torch.equal(step(counted)[0], step(worst)[0])
    assert counted.last_plan.capacity == worst.last_plan.capacity


def test_tutels_surface_takes_it(comm):
    from moe_runtime import moe as tutel_moe

    layer = tutel_moe.moe_layer(gate_type={"type": "top", "k": 2, "capacity_factor": 0.0}, model_dim=M,
                                experts={"type": "ffn", "count_per_node": 4, "hidden_size_per_expert": H},
                                group=comm, seeds=(1, 2), a2a_ffn_overlap_degree=2, dropless_capacity="worst_case")
    step(layer)
    assert layer.last_plan.capacity == 14  # T, rounded up to Tutel's alignment s d = 2


def test_the_local_capacity_of_each_setting():
    indices = torch.tensor([[0, 1], [0, 2], [0, 3]])
    assert capacity.local_capacity("tutel", 0.0, indices, 4) == 3  # expert 0's count
    assert capacity.local_capacity("tutel", 0.0, indices, 4, "worst_case") == 3  # T
    assert capacity.local_capacity("tutel", 0.0, indices[:, 1:], 4, "worst_case") == 3  # T, not the count 1
    assert capacity.local_capacity("tutel", 0.0, indices[:0], 4, "worst_case") == 1  # at least 1
    assert [capacity.set_by_tokens(f, d) for f, d in ((1.0, "largest"), (0.0, "largest"), (0.0, "worst_case"),
                                                      (-1.0, "worst_case"))] == [True, False, True, False]


def test_bad_settings_are_refused(comm):
    with pytest.raises(ValueError, match=r"dropless_capacity must be one of \('largest', 'worst_case'\), got 'max'"):
        layer_of(comm, "max")
    with pytest.raises(ValueError, match="flow='dropless'.*routes without a capacity.*dropless_capacity='worst_case'"):
        layer_of(comm, "worst_case", flow="dropless")
    with pytest.raises(ValueError, match="data_centric.*dropless_capacity"):
        layer_of(comm, "worst_case", flow="data_centric")
