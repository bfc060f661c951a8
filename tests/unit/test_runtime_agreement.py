"""The ranks' agreement on a layer's construction and call (moe_runtime.common.
agreement, moe_runtime.construction) on one rank: values as texts, the
messages of a mismatch (the other ranks stood in for by the all-gather),
and the normalization of the layer's fields. tests/mpi_runtime/
test_runtime_one_model.py runs them over real ranks."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F

import a2a
import moe_runtime
from moe_runtime.common import agreement
from moe_runtime.common.agreement import CallFields, agree_construction, callable_name, describe
from moe_runtime.construction import layer_fields


class _Plain:
    pass


def test_values_become_the_same_text_in_every_process():
    assert callable_name(F.silu) == "torch.nn.functional.silu"
    assert callable_name(F.gelu) == "torch._C._nn.gelu"  # a builtin: where it lives
    assert callable_name(F.relu) == "torch.nn.functional.relu"
    assert callable_name(lambda x: x) == "an unnamed function"

    def local(x):
        return x

    assert callable_name(local) == "an unnamed function"
    assert callable_name(torch.nn.GELU("tanh")) == "GELU(approximate='tanh')"
    assert describe(_Plain()) == "a _Plain"  # never the default repr's address
    assert describe(("dropless",)) == "('dropless',)"
    assert describe([1, 2.5]) == "(1, 2.5)"
    assert describe({"k": 2, "type": "top"}) == "{k: 2, type: 'top'}"
    assert describe(torch.float32) == "torch.float32"
    assert describe(moe_runtime.FlexConfig()).startswith("FlexConfig(slots_per_rank=None")


THREE_RANKS = SimpleNamespace(rank=0, size=3)  # what the agreement reads of a communicator


def _ranks_stand_in(monkeypatch, mine, rank1):
    """The agreement's all-gathers answer as if 3 ranks had called, ranks 0
    and 2 with `mine` and rank 1 with `rank1`; returns the dtypes gathered."""
    differing = [name for name in mine if describe(mine[name]) != describe(rank1.get(name))]
    calls = []

    def all_gather_values(values, _comm):
        values = np.asarray(values)
        calls.append(values.dtype)
        if values.dtype == np.int64:  # the digests
            other = agreement._digest_row(list(rank1), [describe(value) for value in rank1.values()])
        else:  # the texts of the differing fields
            other = agreement._text_rows([describe(rank1[name]) for name in differing])
        return np.concatenate([values, other, values])

    monkeypatch.setattr(agreement, "all_gather_values", all_gather_values)
    return calls


def test_a_construction_mismatch_names_each_field_and_every_rank_value(comm, monkeypatch):
    mine = {"model_dim": 8, "hidden_size_per_expert": 64, "dispatcher": "capacity"}
    agree_construction(comm, "MoELayer", mine)  # one rank agrees with itself
    calls = _ranks_stand_in(monkeypatch, mine, {**mine, "hidden_size_per_expert": 32, "dispatcher": "dropless"})
    with pytest.raises(a2a.MismatchError) as caught:
        agree_construction(THREE_RANKS, "MoELayer", mine)
    assert str(caught.value) == (
        "MoELayer on rank 0: the ranks were constructed with different hidden_size_per_expert (rank 0: 64, "
        "rank 1: 32, rank 2: 64); and dispatcher (rank 0: 'capacity', rank 1: 'dropless', rank 2: 'capacity'); "
        "every rank must construct the MoELayer with the same settings")
    assert calls == [np.int64, np.uint8]  # the values travel only when they differ


def test_fields_of_another_code_version_are_named_as_such(monkeypatch):
    _ranks_stand_in(monkeypatch, {"model_dim": 8, "hidden": 1}, {"model_dim": 8, "other": 1})
    with pytest.raises(a2a.MismatchError, match="check different configuration fields"):
        agree_construction(THREE_RANKS, "MoELayer", {"model_dim": 8, "hidden": 1})


def test_a_long_value_is_cut_in_the_message(monkeypatch):
    _ranks_stand_in(monkeypatch, {"flex": "x" * 500}, {"flex": "y" * 500})
    with pytest.raises(a2a.MismatchError) as caught:
        agree_construction(THREE_RANKS, "Layer", {"flex": "x" * 500})
    assert f"rank 1: '{'y' * (agreement.TEXT_LIMIT - 4)}..." in str(caught.value)


def _call_table(*rows):
    return np.array(rows, dtype=np.int64)


def test_a_call_mismatch_names_the_model_dim_and_dtype_of_every_rank():
    call = CallFields(torch.zeros(4, 8), 8, "MoELayer on rank 0")
    f32, f64 = call.columns()[1], CallFields(torch.zeros(1, 8, dtype=torch.float64), 8, "").columns()[1]
    call.check(_call_table([8, f32, 0], [8, f32, 0]))
    with pytest.raises(a2a.MismatchError) as caught:
        call.check(_call_table([8, f32, 0], [9, f64, 1], [8, f32, 0]))
    assert str(caught.value) == (
        "MoELayer on rank 0: the ranks passed tokens of different model_dim (rank 0: 8, rank 1: 9, rank 2: 8); "
        "and dtype (rank 0: torch.float32, rank 1: torch.float64, rank 2: torch.float32); every rank must pass "
        "tokens of the same model dim (last dimension) and dtype")


def test_a_rank_that_cannot_route_raises_its_own_error_and_the_others_a_remote_one():
    bad = CallFields(torch.zeros(4, 9), 8, "MoELayer on rank 1")
    assert isinstance(bad.error, ValueError) and bad.columns()[0] == 9 and bad.columns()[2] == 1
    assert bad.tokens(torch.zeros(2, 3, 9)).shape == (6, 9)
    row = bad.columns()
    with pytest.raises(ValueError, match=r"input \(4, 9\) must end with model_dim 8"):
        bad.check(_call_table(row, row))  # every rank passed the same wrong width: each its own error
    good = CallFields(torch.zeros(4, 9), 9, "MoELayer on rank 0")
    assert good.attempt(lambda: 1 / 0) is None and isinstance(good.error, ZeroDivisionError)
    healthy = CallFields(torch.zeros(4, 9), 9, "MoELayer on rank 0")
    with pytest.raises(a2a.RemoteError, match=r"rank\(s\) \[1\] could not route"):
        healthy.check(_call_table(healthy.columns(), good.columns()))
    with pytest.raises(ValueError, match="model_dim"):
        CallFields(torch.tensor(1.0), 8, "MoELayer on rank 0").check(_call_table([-1, 0, 1]))


def test_layer_fields_read_one_setting_the_same_whatever_its_spelling():
    spec = {"type": "ffn", "num_experts_per_device": 2, "hidden_size_per_expert": 4}
    plain = layer_fields({"type": "top"}, 8, spec, dispatcher="capacity", adaptive=None)
    spelled = layer_fields({"type": "top", "k": 2, "capacity_factor": 0, "fp32_gate": 0}, 8,
                           {"count_per_node": 2, "hidden_size_per_expert": 4, "activation_fn": F.relu,
                            "has_fc1_bias": 1}, dispatcher="capacity", adaptive=None)
    assert {k: describe(v) for k, v in plain.items()} == {k: describe(v) for k, v in spelled.items()}
    assert plain["activation_fn"] == "torch.nn.functional.relu" and plain["dtype"] == torch.get_default_dtype()
    assert plain["k"] == 2 and plain["capacity_factor"] == 0.0 and plain["adaptive"] is False
    two = layer_fields([{"type": "top", "k": 1}, {"type": "cosine_top"}], 8, spec)
    assert two["gate_type"] == ("top", "cosine_top") and two["k"] == (1, 2)
    assert two["gate_options"][1]["init_t"] == 0.5
    odd = layer_fields("top", "eight", None)  # invalid values are shown, not raised here
    assert odd["model_dim"] == "eight" and odd["gate_type"] == ("top",) and odd["experts_type"] is None
    assert list(odd) == list(two)  # the same fields whatever the values: one all-gather's row


def test_a_call_refuses_tokens_that_are_not_floating_point_and_capacity_factors_that_are_no_finite_number(comm):
    layer = moe_runtime.MoELayer({"type": "top", "k": 2, "capacity_factor": 1.0}, 6,
                                 {"type": "ffn", "num_experts_per_device": 4, "hidden_size_per_expert": 8},
                                 comm=comm, seeds=(1, 2))
    for dtype in (torch.int64, torch.complex64, torch.bool):
        with pytest.raises(TypeError, match=f"input of dtype {dtype}; the layer takes floating-point tokens"):
            layer(torch.ones(5, 6, dtype=dtype))
    with pytest.raises(TypeError, match="the tokens must be a torch.Tensor, got ndarray"):
        layer(np.ones((5, 6), np.float32))
    for factor in (float("nan"), float("inf"), -float("inf"), "0.5", True):
        with pytest.raises(ValueError, match=r"capacity_factor must be a finite real number .* got " + repr(factor)):
            layer(torch.randn(5, 6), capacity_factor=factor)
    assert layer(torch.randn(5, 6), capacity_factor=np.float32(0.5)).shape == (5, 6)  # any real number
    assert layer(torch.randn(5, 6), capacity_factor=0).shape == (5, 6)
