"""The oracle of the tests: the whole MoE layer in one process, in float64.

``moe_reference`` takes every rank's tokens and the whole model (the gate's
weight and every expert whole, as ``MoELayer.gather_experts`` returns them)
and computes what the distributed layer must: each rank's tokens gated and
routed on their own (with the capacity agreed over ranks), every kept choice
through its expert, the results summed with the gates. It is written with
plain loops and torch ops (no a2a kernel, no collective), so that it shares
no code with the layer it checks; it is differentiable, so it also gives
the reference gradients.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

__all__ = ["moe_reference"]


def _capacity(rule: str, factor: float, scores_top: torch.Tensor, num_experts: int) -> int:
    num_tokens, top_k = scores_top.shape

    def standard(f: float) -> int:
        if rule == "tutel":
            return top_k * int(f * ((num_tokens + num_experts - 1) // num_experts))
        return math.ceil(top_k * f * num_tokens / num_experts)

    if factor > 0:
        return max(standard(factor), 1)
    largest = max([int((scores_top == e).sum()) for e in range(num_experts)] + [1])
    return min(largest, max(standard(-factor), 1)) if factor < 0 else largest


def moe_reference(
    xs: Sequence[torch.Tensor],
    gate_weight: torch.Tensor,
    experts: dict[str, torch.Tensor],
    *,
    top_k: int,
    capacity_factor: float,
    capacity_rule: str = "tutel",
    normalize_gate: bool = True,
    is_postscore: bool = True,
    batch_prioritized_routing: bool = False,
    activation: Callable[[torch.Tensor], torch.Tensor] = F.relu,
    logits_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
    capacity_alignment: int = 1,
    expert_inputs: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
    """(ys, l_auxes, capacity): every rank's output (T_i, M) and GShard loss.

    ``xs``: rank i's tokens (T_i, M). ``gate_weight`` (E, M): logits = x @ w^T
    (``logits_fn`` replaces that, e.g. a float64 copy of a cosine gate).
    ``capacity_alignment``: the capacity rounded up to a multiple of it
    (Tutel's layer rounds to s d before routing: moe_runtime.moe).
    ``experts``: batched_fc1_w (E, H, M), batched_fc2_w (E, H, M) and the
    optional batched_fc1_bias (E, H), batched_fc2_bias (E, M).
    ``expert_inputs``: what the experts see of a rank's tokens, the gate
    still reading the tokens themselves (an FP8 dispatch's round trip, with
    the gradient passed straight through); None: the tokens."""
    fc1, fc2 = experts["batched_fc1_w"], experts["batched_fc2_w"]
    fc1_bias, fc2_bias = experts.get("batched_fc1_bias"), experts.get("batched_fc2_bias")
    num_experts = fc1.shape[0]
    top_k = min(top_k, num_experts)

    decisions = []
    for x in xs:
        logits = x @ gate_weight.t() if logits_fn is None else logits_fn(x)
        scores = torch.softmax(logits, dim=1)
        chosen = torch.topk(scores, top_k, dim=1).indices
        gates = scores.gather(1, chosen)
        if normalize_gate and top_k > 1:
            gates = gates / gates.sum(dim=1, keepdim=True).clamp(min=torch.finfo(gates.dtype).eps)
        first = F.one_hot(chosen[:, 0], num_experts).to(scores.dtype)
        l_aux = (scores.mean(0) * first.mean(0)).sum() * num_experts if len(x) else scores.sum() * 0.0
        decisions.append((scores, chosen, gates, l_aux))
    capacity = max(_capacity(capacity_rule, capacity_factor, chosen, num_experts) for _, chosen, _, _ in decisions)
    capacity = -(-capacity // capacity_alignment) * capacity_alignment

    ys, l_auxes = [], []
    for tokens, (scores, chosen, gates, l_aux) in zip(xs, decisions):
        x = tokens if expert_inputs is None else expert_inputs(tokens)
        order = list(range(len(x)))
        if batch_prioritized_routing:
            best = scores.detach().max(dim=1).values.tolist()
            order = sorted(order, key=lambda t: -best[t])  # stable: ties keep token order
        taken = [0] * num_experts
        y = torch.zeros_like(x)
        for choice in range(top_k):
            for t in order:
                e = int(chosen[t, choice])
                slot = taken[e]
                taken[e] += 1
                if slot >= capacity:
                    continue  # dropped
                g = gates[t, choice]
                inp = x[t] if is_postscore else g * x[t]
                h = inp @ fc1[e].t()
                if fc1_bias is not None:
                    h = h + fc1_bias[e]
                out = activation(h) @ fc2[e]
                if fc2_bias is not None:
                    out = out + fc2_bias[e]
                row = torch.tensor([t], device=x.device)  # the tokens' device: index_add takes no other
                y = y.index_add(0, row, (g * out if is_postscore else out).unsqueeze(0))
        ys.append(y)
        l_auxes.append(l_aux)
    return ys, l_auxes, capacity
