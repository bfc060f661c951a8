"""moe_runtime.moe.moe_layer in one process: Tutel's keywords, defaults,
refusals, attributes, call options and dtypes (the checkpoints and groups
under mpirun are in tests/mpi_tutel)."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

import a2a
from moe_runtime import moe as tutel_moe

M, H = 8, 16


def make(gate=None, experts=None, **options):
    return tutel_moe.moe_layer(gate_type=gate or {"type": "top", "k": 2}, model_dim=M,
                               experts=experts or {"type": "ffn", "num_experts_per_device": 2,
                                                   "hidden_size_per_expert": H},
                               seeds=(1, 2, 3), **options)


def tokens(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def test_tutel_defaults_k_1_and_capacity_factor_1(monkeypatch):
    layer = make(gate={"type": "top"})
    assert layer.gates[0].top_k == 1 and layer.gates[0].capacity_factor == 1.0
    monkeypatch.setenv("CAP_FACTOR", "2.5")
    assert make(gate={"type": "top"}).gates[0].capacity_factor == 2.5


def test_the_old_gate_string_and_a_list_of_gates():
    layer = make(gate="Top2Gate")
    assert layer.gates[0].top_k == 2
    layer = make(gate=[{"type": "top", "k": 1}, {"type": "cosine_top", "k": 2}])
    x = tokens(5, M)
    assert layer(x, gate_index=1).shape == x.shape


@pytest.mark.parametrize("options, message", [
    ({"not_a_keyword": 1}, r"unrecognized argument\(s\) \['not_a_keyword'\]"),
    ({"experts": {"type": "custom", "module": object}}, "only Tutel's 'ffn' experts"),
    ({"experts": {"type": "ffn", "hidden_size_per_expert": H, "output_dim": M + 2}}, "output_dim=10"),
    ({"experts": {"type": "ffn", "hidden_size_per_expert": H, "fused_custom_fn": None}}, "fused_custom_fn"),
    ({"gate": {"type": "custom", "module": object}}, "'module' must be the gate's class"),
    ({"gate": "Gate2"}, "give a dict"),
    ({"parallel_type": "hybrid"}, "Tutel's are 'adaptive:r'"),
    ({"parallel_type": "adaptive:x"}, "takes an integer r"),
    ({"seeds": (1,)}, "seeds must be"),
])
def test_what_cannot_be_honoured_is_refused_by_name(options, message):
    arguments = {"gate_type": options.pop("gate", {"type": "top", "k": 2}), "model_dim": M,
                 "experts": options.pop("experts", {"type": "ffn", "hidden_size_per_expert": H})}
    with pytest.raises((TypeError, ValueError), match=message):
        tutel_moe.moe_layer(**arguments, **options)


def test_odd_model_dim_is_refused_as_tutel_does():
    with pytest.raises(ValueError, match="even"):
        tutel_moe.moe_layer(gate_type={"type": "top"}, model_dim=7,
                            experts={"type": "ffn", "hidden_size_per_expert": H})


def test_pad_samples_is_accepted_and_ignored(caplog):
    with caplog.at_level(logging.WARNING):
        make(pad_samples=True)
    assert "pad_samples" in caplog.text


def test_seeds_scan_expert_func_and_the_parameter_iterators():
    scanned = []
    layer = make(scan_expert_func=lambda name, param: (scanned.append(name), setattr(param, "skip_allreduce", True)))
    after = torch.rand(3)
    torch.manual_seed(3)
    assert torch.equal(after, torch.rand(3)), "seeds[2] reseeds torch's generator after construction"
    experts = dict(layer.get_parameter_iterator("local_experts"))
    assert sorted(scanned) == sorted(experts) == sorted(
        ["batched_fc1_w", "batched_fc2_w", "batched_fc1_bias", "batched_fc2_bias"])
    assert all(p.skip_allreduce and p._tutel_expert for p in experts.values())
    assert list(dict(layer.get_parameter_iterator("gate"))) == ["0.wg.weight"]
    assert not hasattr(layer.gates[0].wg.weight, "skip_allreduce")
    with pytest.raises(ValueError, match="'gate' and 'local_experts'"):
        layer.get_parameter_iterator("experts")
    same = make()
    torch.testing.assert_close(same.experts.batched_fc1_w, layer.experts.batched_fc1_w)


def test_attributes_and_the_expert_count():
    layer = make()
    assert (layer.num_global_experts, layer.num_local_experts, layer.sharded_count, layer.world_size) == (2, 2, 1, 1)
    assert int(layer._num_global_experts) == 2
    assert tutel_moe.moe_layer.global_expert_count(4) == 4
    assert tutel_moe.global_expert_count(-1) == 1
    with pytest.raises(ValueError, match="must not be 0"):
        tutel_moe.moe_layer.global_expert_count(0)
    assert "Total-Experts = 2" in repr(layer)


def test_result_func_reserve_dims_and_l_aux():
    layer = make(result_func=lambda y: y * 2)
    x = tokens(3, 4, M)
    y = layer(x)
    plain = make()(x)
    torch.testing.assert_close(y, plain * 2)
    assert layer.l_aux is not None
    square = tutel_moe.moe_layer(gate_type={"type": "top", "k": 2}, model_dim=M,
                                 experts={"type": "ffn", "num_experts_per_device": 2, "hidden_size_per_expert": H},
                                 seeds=(1, 2))
    z = square(tokens(3, 2, 4), reserve_dims=2)  # (3, 2, 4): tokens of 2 x 4 = M values
    assert z.shape == (3, 2, 4)
    with pytest.raises(ValueError, match="reserve_dims=3"):
        square(tokens(2, 4), reserve_dims=3)


def test_call_options_persist_as_in_tutel():
    layer = make()
    x = tokens(6, M)
    layer(x, a2a_ffn_overlap_degree=2)
    layer(x)
    assert layer.a2a_ffn_overlap_degree == 2 and (layer.last_plan.r, layer.last_plan.d) == (1, 2)
    layer(x, adaptive_r=0)
    layer(x)
    assert layer.adaptive_degree == 0 and layer.last_plan.r == 0


def test_megablocks_and_inequivalent_tokens_give_the_same_result():
    layer = make()
    x = tokens(9, M)
    want = layer(x)
    torch.testing.assert_close(layer(x, megablocks_size=16), want, rtol=0, atol=0)
    torch.testing.assert_close(layer(x, inequivalent_tokens=True), want, rtol=0, atol=0)
    with pytest.raises(ValueError, match="megablocks_size"):
        layer(x, megablocks_size=-1)


def test_skip_moe(monkeypatch):
    monkeypatch.setenv("SKIP_MOE", "1")
    layer = make()
    x = tokens(4, M)
    assert layer(x) is x and x.l_aux is None


def test_activation_fn_with_self():
    seen = []
    layer = make(experts={"type": "ffn", "num_experts_per_device": 2, "hidden_size_per_expert": H,
                          "activation_fn_with_self": lambda x, experts: (seen.append(experts), F.gelu(x))[1]})
    layer(tokens(4, M))
    assert seen and seen[0] is layer.experts


def test_float64_bfloat16_and_autocast_in_bfloat16_and_float16_with_an_fp32_gate():
    x = tokens(6, 5, M)
    want = make().double()(x.double())
    assert want.dtype == torch.float64
    layer = make(gate={"type": "top", "k": 2, "fp32_gate": True})
    full = layer(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = layer(x)
    assert mixed.dtype == torch.float32
    torch.testing.assert_close(mixed, full, rtol=0.05, atol=0.05)
    with torch.autocast("cpu", dtype=torch.float16):
        mixed16 = layer(x)
    assert mixed16.dtype == torch.float32
    torch.testing.assert_close(mixed16, full, rtol=0.01, atol=0.01)
    halved = make().to(torch.bfloat16)
    y = halved(x.bfloat16())
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), make()(x), rtol=0.05, atol=0.05)
    x64 = x.double().requires_grad_()
    mixed64 = make()(x64)  # float32 experts take float64 tokens in float32 and answer in float64, as Tutel
    assert mixed64.dtype == torch.float64
    mixed64.sum().backward()
    assert x64.grad.dtype == torch.float64


def test_group_may_be_an_a2a_comm():
    from mpi4py import MPI

    comm = a2a.Comm.from_mpi(MPI.COMM_WORLD)
    layer = make(group=comm)
    assert layer.comm is comm and layer(tokens(3, M)).shape == (3, M)


def test_a_refused_r_or_d_does_not_stick():
    layer = make()
    x = tokens(6, M)
    with pytest.raises(ValueError, match="valid r"):
        layer(x, adaptive_r=3)
    with pytest.raises(ValueError):
        layer(x, a2a_ffn_overlap_degree=0)
    layer(x)
    assert (layer.last_plan.r, layer.last_plan.d) == (1, 1)


def test_tutel_environment_switches(monkeypatch):
    monkeypatch.setenv("BATCH_PRIO", "1")
    assert make().batch_prioritized_routing
    monkeypatch.delenv("BATCH_PRIO")
    monkeypatch.setenv("SKIP_EXPERT", "1")
    with pytest.raises(ValueError, match="SKIP_EXPERT"):
        make()


def test_tutel_shapes_of_the_cosine_gate_and_the_expert_counts():
    layer = make(gate={"type": "cosine_top", "k": 1})
    assert layer.gates[0].cosine_projector.weight.shape == (256, M)  # Tutel's proj_dim
    with pytest.raises(ValueError, match="not both"):
        make(experts={"type": "ffn", "count_per_node": 1, "num_experts_per_device": 2, "hidden_size_per_expert": H})


def test_a_checkpoint_without_an_expert_tensor_loads_zeros(caplog):
    layer = make()
    state = {k: v for k, v in layer.state_dict().items() if k != "experts.batched_fc2_bias"}
    with caplog.at_level(logging.WARNING):
        layer.load_state_dict(state, strict=True)
    assert "batched_fc2_bias" in caplog.text and not layer.experts.batched_fc2_bias.any()
