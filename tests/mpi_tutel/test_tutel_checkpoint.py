"""Tutel's checkpoints both ways, under mpirun: a state_dict in Tutel's
layout (tutel_layout.py) loads into moe_runtime.moe.moe_layer with
strict=True and gives the float64 reference's outputs and gradients on the
same tokens, for num_experts_per_device > 0 and < 0 and every
parallel_type; the layer saves exactly Tutel's names, shapes and values."""

from __future__ import annotations

import io
import logging

import pytest
import torch
from tutel_layout import expert_count, global_model, tutel_state_dict

from moe_runtime import moe as tutel_moe
from moe_runtime.reference import moe_reference

MODEL_DIM = 10  # even (Tutel's rule); ceil(10 / 4) = 3 pads the fc2 bias of 4 sharers
HIDDEN = 24  # a multiple of every number of sharers here
TOLERANCE = 1e-12  # float64 against float64


def tokens(rank: int, seed: int) -> torch.Tensor:
    """Rank i's tokens, (2, 3 + i, M): as many as Tutel needs (the same on every rank), or a different count."""
    generator = torch.Generator().manual_seed(seed + rank)
    return torch.randn(2, 3 + rank, MODEL_DIM, generator=generator, dtype=torch.float64)


def layouts(world: int) -> list[int]:
    return [2] + [-s for s in range(2, world + 1) if world % s == 0]


def parallel_types(n: int, world: int) -> list[str]:
    share = max(1, -n)
    return ["adaptive:0", "adaptive:1", f"adaptive:{share}", "data", "model", "auto"]


def make_layer(n: int, parallel_type: str, rank: int, **options) -> torch.nn.Module:
    return tutel_moe.moe_layer(
        gate_type={"type": "top", "k": 2, "capacity_factor": 1.0}, model_dim=MODEL_DIM,
        experts={"type": "ffn", "num_experts_per_device": n, "hidden_size_per_expert": HIDDEN},
        scan_expert_func=lambda name, param: setattr(param, "skip_allreduce", True),
        seeds=(1, rank + 1, 1), parallel_type=parallel_type, **options).double()


def expert_slices(model, n, rank, world):
    """Rank `rank`'s parts of the reference's expert gradients, in Tutel's layout (as tutel_state_dict)."""
    state = tutel_state_dict({k: v for k, v in model.items()}, n, rank, world)
    return {name.removeprefix("experts."): value for name, value in state.items() if name.startswith("experts.")}


@pytest.mark.parametrize("n", [2, -2])
def test_a_tutel_checkpoint_loads_and_gives_the_reference_outputs_and_gradients(world, n):
    rank, size = world.Get_rank(), world.Get_size()
    if size % -min(n, -1) and n < 0:
        pytest.skip("the world is not a multiple of the sharers")
    for share in ([n] if n > 0 else layouts(size)[1:]):
        num_experts = expert_count(share, size)
        model = global_model(num_experts, MODEL_DIM, HIDDEN, seed=7)
        # Tutel's capacity is rounded up to a multiple of s d: d = 3 makes that bite for every s.
        cases = [(parallel_type, False, 1) for parallel_type in parallel_types(share, size)] + \
                [("adaptive:1", True, 1), ("adaptive:1", False, 3)]
        for parallel_type, use_2dh, degree in cases:
            what = f"n={share} parallel_type={parallel_type!r} use_2dh={use_2dh} d={degree} on {size} ranks"
            layer = make_layer(share, parallel_type, rank, use_2dh=use_2dh, a2a_ffn_overlap_degree=degree)
            layer.load_state_dict(tutel_state_dict(model, share, rank, size), strict=True)
            x = tokens(rank, 100).requires_grad_()
            upstream = tokens(rank, 200)
            y = layer(x)
            (y * upstream).sum().backward()

            # The reference: every rank's tokens through the whole model, in one process.
            whole = {name: value.clone().requires_grad_() for name, value in model.items()}
            xs = [tokens(i, 100).reshape(-1, MODEL_DIM).requires_grad_() for i in range(size)]
            ys, l_auxes, _ = moe_reference(xs, whole["wg"], {k: v for k, v in whole.items() if k != "wg"},
                                           top_k=2, capacity_factor=1.0, capacity_alignment=max(1, -share) * degree)
            sum((yi * tokens(i, 200).reshape(-1, MODEL_DIM)).sum() for i, yi in enumerate(ys)).backward()
            torch.testing.assert_close(y.reshape(-1, MODEL_DIM), ys[rank].detach(), rtol=0, atol=TOLERANCE,
                                       msg=f"output, {what}")
            torch.testing.assert_close(x.grad.reshape(-1, MODEL_DIM), xs[rank].grad, rtol=0, atol=TOLERANCE,
                                       msg=f"input gradient, {what}")
            torch.testing.assert_close(y.l_aux.detach(), l_auxes[rank].detach(), rtol=0, atol=TOLERANCE,
                                       msg=f"l_aux, {what}")
            # Expert gradients: summed over every rank's tokens (Tutel's), on this rank's shard.
            want = expert_slices({k: v.grad for k, v in whole.items() if k != "wg"} | {"wg": whole["wg"].grad},
                                 share, rank, size)
            for name, parameter in layer.get_parameter_iterator("local_experts"):
                torch.testing.assert_close(parameter.grad, want[name], rtol=0, atol=TOLERANCE,
                                           msg=f"{name} gradient, {what}")
            # The gate's: this rank's tokens only; the program all-reduces it (Tutel's helloworld).
            gate_grad = layer.gates[0].wg.weight.grad.clone()
            world.Allreduce(gate_grad.numpy().copy(), gate_grad.numpy())
            torch.testing.assert_close(gate_grad, whole["wg"].grad, rtol=0, atol=TOLERANCE,
                                       msg=f"gate gradient summed over ranks, {what}")


@pytest.mark.parametrize("n", [2, -2, -1])
def test_the_layer_saves_what_tutel_loads(world, n):
    rank, size = world.Get_rank(), world.Get_size()
    if n < -1 and size % -n:
        pytest.skip("the world is not a multiple of the sharers")
    model = global_model(expert_count(n if n != -1 else 1, size), MODEL_DIM, HIDDEN, seed=11)
    tutel_n = n if n != -1 else 1  # Tutel reads -1 as one expert per rank
    layer = make_layer(n, "adaptive:1", rank)
    layer.load_state_dict(tutel_state_dict(model, tutel_n, rank, size), strict=True)
    saved = layer.state_dict()
    want = tutel_state_dict(model, tutel_n, rank, size)
    assert sorted(saved) == sorted(want), f"keys {sorted(saved)} != Tutel's {sorted(want)}"
    for name, value in want.items():
        assert saved[name].shape == value.shape and saved[name].dtype == value.dtype or name.startswith("_"), name
        torch.testing.assert_close(saved[name].to(value.dtype), value, rtol=0, atol=0, msg=name)
    # Through a file, into a fresh layer built with other seeds: the same function.
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    buffer.seek(0)
    fresh = make_layer(n, "adaptive:1", rank + 10)
    fresh.load_state_dict(torch.load(buffer), strict=True)
    x = tokens(rank, 300)
    torch.testing.assert_close(fresh(x), layer(x), rtol=0, atol=0)


def test_the_expert_count_is_checked_on_load(world, caplog):
    rank, size = world.Get_rank(), world.Get_size()
    model = global_model(expert_count(2, size), MODEL_DIM, HIDDEN, seed=5)
    state = tutel_state_dict(model, 2, rank, size)
    layer = make_layer(2, "adaptive:1", rank)
    wrong = dict(state, _num_global_experts=torch.tensor(3 * size))
    with pytest.raises(ValueError, match=f"checkpoint's layer has {3 * size} experts, this one {2 * size}"):
        layer.load_state_dict(wrong, strict=True)
    older = {k: v for k, v in state.items() if k != "_num_global_experts"}
    with caplog.at_level(logging.WARNING):
        layer.load_state_dict(older, strict=True)
    assert "_num_global_experts" in caplog.text
    # Expert tensors of the right size but another shape (an older layout) are reshaped, as Tutel does.
    flat = dict(state, **{"experts.batched_fc1_w": state["experts.batched_fc1_w"].reshape(-1)})
    layer.load_state_dict(flat, strict=True)
    torch.testing.assert_close(layer.experts.batched_fc1_w.detach(), state["experts.batched_fc1_w"])
