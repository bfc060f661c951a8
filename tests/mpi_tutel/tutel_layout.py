"""Tutel's checkpoint layout, written from Tutel's documented parameter
names and shapes (tutel/impls/moe_layer.py, tutel/experts/ffn.py,
tutel/gates/top.py), with no Tutel dependency:

    _num_global_experts       ()                 the layer's E (int64)
    gates.<g>.wg.weight       (E, M)             logits = x @ wg^T
    experts.batched_fc1_w     (n_l, H/s, M)      h = act(x @ fc1_w^T + fc1_bias)
    experts.batched_fc2_w     (n_l, H/s, M)      y = h @ fc2_w + fc2_bias
    experts.batched_fc1_bias  (n_l, H/s)
    experts.batched_fc2_bias  (n_l, ceil(M/s))

with n = num_experts_per_device: n > 0 gives E = n W, rank i holding
experts [i n, (i+1) n) whole (n_l = n, s = 1); n = -s < 0 gives E = W / s,
rank i = e s + j holding hidden units [j H/s, (j+1) H/s) of expert e and
columns [j ceil(M/s), (j+1) ceil(M/s)) of its fc2 bias, zero-padded past M
(n_l = 1)."""

from __future__ import annotations

import math

import torch

__all__ = ["expert_count", "global_model", "tutel_state_dict"]


def expert_count(n: int, world: int) -> int:
    return n * world if n > 0 else world // -n


def global_model(num_experts: int, model_dim: int, hidden: int, seed: int) -> dict[str, torch.Tensor]:
    """A whole model in float64, the same on every rank: the gate and every expert."""
    generator = torch.Generator().manual_seed(seed)

    def draw(*shape, scale):
        return (torch.rand(*shape, generator=generator, dtype=torch.float64) * 2 - 1) * scale

    return {
        "wg": draw(num_experts, model_dim, scale=1 / math.sqrt(model_dim)),
        "batched_fc1_w": draw(num_experts, hidden, model_dim, scale=1 / math.sqrt(model_dim)),
        "batched_fc1_bias": draw(num_experts, hidden, scale=1 / math.sqrt(model_dim)),
        "batched_fc2_w": draw(num_experts, hidden, model_dim, scale=1 / math.sqrt(hidden)),
        "batched_fc2_bias": draw(num_experts, model_dim, scale=1 / math.sqrt(hidden)),
    }


def tutel_state_dict(model: dict[str, torch.Tensor], n: int, rank: int, world: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s state_dict of Tutel's moe_layer holding `model`."""
    num_experts, hidden, model_dim = model["batched_fc1_w"].shape
    state = {"_num_global_experts": torch.tensor(num_experts), "gates.0.wg.weight": model["wg"].clone()}
    if n > 0:
        mine = slice(rank * n, (rank + 1) * n)
        for name in ("batched_fc1_w", "batched_fc2_w", "batched_fc1_bias", "batched_fc2_bias"):
            state["experts." + name] = model[name][mine].clone()
        return state
    share = -n
    expert, part = divmod(rank, share)
    rows = slice(part * hidden // share, (part + 1) * hidden // share)
    width = -(-model_dim // share)
    padded = torch.zeros(share * width, dtype=torch.float64)
    padded[:model_dim] = model["batched_fc2_bias"][expert]
    state["experts.batched_fc1_w"] = model["batched_fc1_w"][expert, rows].unsqueeze(0).clone()
    state["experts.batched_fc2_w"] = model["batched_fc2_w"][expert, rows].unsqueeze(0).clone()
    state["experts.batched_fc1_bias"] = model["batched_fc1_bias"][expert, rows].unsqueeze(0).clone()
    state["experts.batched_fc2_bias"] = padded[part * width:(part + 1) * width].unsqueeze(0).clone()
    return state
