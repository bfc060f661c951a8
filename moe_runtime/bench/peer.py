"""The peer of ``python -m moe_runtime.bench``: a GShard-style MoE layer, as
Fairseq's ``MOELayer`` with ``Top2Gate`` computes it, over the same gate and
experts as a :class:`moe_runtime.MoELayer`.

Per rank, T tokens, E experts (n_l = E / W on each of the W ranks), top-k,
capacity C (the layer's rule, so that both drop the same choices)::

    logits = x @ wg^T (T, E); scores = softmax; top-k; gates (normalized
        over the k choices, as the layer does: before any choice is dropped)
    masks (T, E) per choice; locations = cumsum over tokens, each choice
        after every earlier choice (choice-major, as a2a.route); kept < C
    combine weights (T, E, C) = sum over choices of gate * mask x one_hot(location)
    dispatch mask (T, E, C) = the same without the gates
    dispatched = einsum("tec,tm->ecm", dispatch mask, x)          (E, C, M)
    all-to-all along dim 0 -> (W, n_l, C, M): the rows of every source rank
    each local expert on its (W, C, M) rows: relu(x fc1^T + b1) fc2 + b2
    all-to-all back -> (E, C, M)
    y = einsum("tec,ecm->tm", combine weights, expert output)     (T, M)

Both einsums and the (T, E, C) tensors grow with T * E * C = k f T^2: that is
the cost a sparse dispatch removes. Autograd differentiates everything (the
exchanges through :func:`a2a.torch.all_to_all`, whose backward is itself).

:func:`check_peer` runs both layers on the same tokens and weights and
returns how far apart their outputs and input gradients are: a peer that
computes something else would be no peer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

import a2a
import a2a.torch as a2a_torch

from ..common.host_values import all_reduce_values, torch_device
from ..gating.capacity import rule_capacity
from ..gating.losses import gshard_loss
from ..layer import MoELayer

__all__ = ["GShardPeer", "PeerCheck", "check_peer"]


class GShardPeer(torch.nn.Module):
    """Dense einsum dispatch and combine around the experts of `layer`
    (copies of its gate and of this rank's expert shards).

    Needs every expert whole on one rank (E >= W: ``num_experts_per_device``
    > 0), as Fairseq does. Call: ``peer(x, capacity_factor)`` -> y (T, M)
    with ``y.l_aux``."""

    def __init__(self, layer: MoELayer):
        super().__init__()
        experts = layer.experts
        if experts.sharers != 1:
            raise ValueError(
                f"the GShard peer needs whole experts on each rank; {experts.sharers} ranks share each expert here"
            )
        self.comm = layer.comm
        self.num_experts, self.model_dim = layer.num_global_experts, layer.model_dim
        self.top_k = layer.gates[0].top_k
        self.normalize_gate, self.capacity_rule = layer.normalize_gate, layer.capacity_rule
        self.activation = experts.activation_fn

        def copy(parameter: torch.Tensor | None) -> torch.nn.Parameter | None:
            return None if parameter is None else torch.nn.Parameter(parameter.detach().clone())

        self.wg = copy(layer.gates[0].wg.weight)  # (E, M)
        self.fc1_w = copy(experts.batched_fc1_w)  # (n_l, H, M)
        self.fc2_w = copy(experts.batched_fc2_w)  # (n_l, H, M)
        self.fc1_bias = copy(experts.batched_fc1_bias)  # (n_l, H)
        self.fc2_bias = copy(experts.batched_fc2_bias)  # (n_l, M)

    def capacity(self, num_tokens: int, capacity_factor: float) -> int:
        """The layer's capacity for T tokens (equal on every rank when T is)."""
        return rule_capacity(self.capacity_rule, capacity_factor, num_tokens, self.num_experts, self.top_k)

    def forward(self, x: torch.Tensor, capacity_factor: float) -> torch.Tensor:
        num_tokens = x.shape[0]
        num_experts, k = self.num_experts, min(self.top_k, self.num_experts)
        capacity = self.capacity(num_tokens, capacity_factor)

        scores = F.softmax(F.linear(x, self.wg), dim=1)
        chosen = torch.topk(scores, k, dim=1).indices  # (T, k)
        gates = scores.gather(1, chosen)
        if self.normalize_gate and k > 1:
            gates = gates / gates.sum(dim=1, keepdim=True).clamp(min=torch.finfo(gates.dtype).eps)
        l_aux = gshard_loss(scores, chosen)

        combine = x.new_zeros(num_tokens, num_experts, capacity)
        dispatch = x.new_zeros(num_tokens, num_experts, capacity)
        taken = torch.zeros(num_experts, dtype=torch.long, device=x.device)  # slots used by the earlier choices
        for choice in range(k):
            mask = F.one_hot(chosen[:, choice], num_experts)  # (T, E)
            locations = torch.cumsum(mask, dim=0) - 1 + taken
            taken = taken + mask.sum(dim=0)
            mask = mask * (locations < capacity)
            location = (locations * mask).sum(dim=1)  # (T,): 0 where dropped (the mask is 0 there)
            slot = F.one_hot(location, capacity).to(x.dtype)  # (T, C)
            kept = mask.to(x.dtype)
            dispatch = dispatch + kept.unsqueeze(2) * slot.unsqueeze(1)
            combine = combine + (gates[:, choice : choice + 1] * kept).unsqueeze(2) * slot.unsqueeze(1)

        dispatched = torch.einsum("tec,tm->ecm", dispatch, x)
        received = a2a_torch.all_to_all(dispatched.contiguous(), comm=self.comm)
        world, local = self.comm.size, self.fc1_w.shape[0]
        by_source = received.view(world, local, capacity, self.model_dim)
        outputs = []
        for e in range(local):
            rows = by_source[:, e]  # (W, C, M): expert e's rows from every rank
            bias1 = None if self.fc1_bias is None else self.fc1_bias[e]
            hidden = self.activation(F.linear(rows, self.fc1_w[e], bias1))
            out = torch.matmul(hidden, self.fc2_w[e])
            outputs.append(out if self.fc2_bias is None else out + self.fc2_bias[e])
        expert_output = torch.stack(outputs, dim=1).reshape(num_experts, capacity, self.model_dim)
        returned = a2a_torch.all_to_all(expert_output.contiguous(), comm=self.comm)
        y = torch.einsum("tec,ecm->tm", combine, returned)
        y.l_aux = l_aux
        return y


@dataclass(frozen=True)
class PeerCheck:
    """How far the peer is from the layer (max over ranks and factors)."""

    tokens: int
    model_dim: int
    hidden: int
    factors: tuple[float, ...]
    dtype: str
    output_error: float  # max |y_layer - y_peer|
    grad_error: float  # max |dx_layer - dx_peer| for loss = sum(y * w) + l_aux
    loss_error: float  # max |l_aux_layer - l_aux_peer|
    tolerance: float

    @property
    def passed(self) -> bool:
        return max(self.output_error, self.grad_error, self.loss_error) <= self.tolerance


def check_peer(comm: a2a.Comm, *, experts: int, top_k: int, factors: tuple[float, ...], tokens: int = 48,
               model_dim: int = 16, hidden: int = 32, tolerance: float = 1e-10) -> PeerCheck:
    """Runs a small float64 MoELayer (r = 1, d = 1, linear) and its peer on
    the same tokens at every factor; collective. Few tokens per expert, so
    that some choices are dropped at f = 1. Both live where `comm` moves
    memory (its GPU for a CUDA communicator): the device the timed layers use."""
    num_local = experts // comm.size
    device = torch_device(comm)
    layer = MoELayer({"type": "top", "k": top_k}, model_dim,
                     {"type": "ffn", "num_experts_per_device": num_local, "hidden_size_per_expert": hidden},
                     comm=comm, seeds=(11, 12)).to(device=device, dtype=torch.float64)
    peer = GShardPeer(layer)
    generator = torch.Generator(device=device).manual_seed(1000 + comm.rank)
    x = torch.randn(tokens, model_dim, dtype=torch.float64, generator=generator, device=device)
    weights = torch.randn(tokens, model_dim, dtype=torch.float64, generator=generator, device=device)
    errors = np.zeros(3)
    for factor in factors:
        results = []
        for use_peer in (False, True):
            inputs = x.clone().requires_grad_(True)
            if use_peer:
                y = peer(inputs, factor)
            else:
                y = layer(inputs, capacity_factor=factor, adaptive_r=1, a2a_ffn_overlap_degree=1, algo="linear")
            ((y * weights).sum() + y.l_aux).backward()
            results.append((y.detach(), inputs.grad, y.l_aux.detach()))
        (y0, g0, l0), (y1, g1, l1) = results
        mine = [float((y0 - y1).abs().max()), float((g0 - g1).abs().max()), float((l0 - l1).abs())]
        errors = np.maximum(errors, mine)
    errors = all_reduce_values(errors, comm, op="max")
    return PeerCheck(tokens, model_dim, hidden, tuple(factors), "float64", float(errors[0]), float(errors[1]),
                     float(errors[2]), tolerance)
