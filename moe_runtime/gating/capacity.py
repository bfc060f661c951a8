"""Expert capacity: how many rows each expert gets per rank and per call.

Two rules for a capacity factor f > 0 with T local tokens, E experts, top-k:

- Tutel's (the layer's default, ``capacity_rule="tutel"``):
  ``C = k * floor(f * ceil(T / E))``;
- a2a.route's (``capacity_rule="a2a"``): ``C = ceil(k * f * T / E)``.

They differ by rounding: with T = 10, E = 4, k = 2, f = 1.5 Tutel gives
2 * floor(1.5 * 3) = 8 and a2a 8 too, but with f = 1.2 Tutel gives
2 * floor(3.6) = 6 and a2a ceil(6.0) = 6; with T = 9, E = 4, k = 1, f = 1
Tutel gives 3 and a2a 3; with T = 5, E = 4, k = 2, f = 0.5, Tutel gives
2 * floor(1.0) = 2 and a2a ceil(1.25) = 2; T = 7, E = 4, k = 1, f = 0.75:
Tutel floor(0.75 * 2) = 1, a2a ceil(1.3125) = 2. Tutel's is a multiple of k.

f == 0: the smallest capacity that drops nothing (the largest expert's count);
f < 0: that, but at most the rule's value for -f. Both rules are at least 1.
Reading the largest count is the call's one host wait (a stream sync on a
GPU). ``dropless="worst_case"`` (MoELayer(dropless_capacity=)) takes instead,
at f == 0, the most one expert can get from this rank, C = T (a token
chooses an expert once): nothing is read back, nothing is dropped either way,
so the tokens' results are the same, and the buffers hold E / k times the
rows of f = 1 (DeepEP's low-latency buffers are sized so). f < 0 still reads
the count: with unequal token counts across ranks, its bound on one rank
and the largest count on another decide the agreed capacity together.

The capacity is then agreed across ranks (the maximum; ranks may hold
different token counts), and the layer routes with it: which choices are
dropped depends on this capacity alone, never on (r, d, algorithm). The
dispatch buffer's rows per expert are then rounded up to what the flow and
pipelining need (``buffer_capacity``); the extra rows stay empty.
"""

from __future__ import annotations

import math

import torch

__all__ = ["DROPLESS_CAPACITIES", "RULES", "buffer_capacity", "local_capacity", "rule_capacity", "set_by_tokens"]

RULES = ("tutel", "a2a")
DROPLESS_CAPACITIES = ("largest", "worst_case")  # the capacity at f == 0: read back, or the most an expert can get


def rule_capacity(rule: str, factor: float, num_tokens: int, num_experts: int, top_k: int) -> int:
    """The capacity of a positive factor under `rule` (at least 1)."""
    if rule == "tutel":
        capacity = top_k * int(factor * ((num_tokens + num_experts - 1) // num_experts))
    elif rule == "a2a":
        capacity = math.ceil(top_k * factor * num_tokens / num_experts)
    else:
        raise ValueError(f"capacity_rule must be one of {RULES}, got {rule!r}")
    return max(capacity, 1)


def set_by_tokens(factor: float, dropless: str) -> bool:
    """Whether the capacity follows from the token count alone, with no value read back."""
    return factor > 0 or (factor == 0 and dropless == "worst_case")


def local_capacity(rule: str, factor: float, indices: torch.Tensor, num_experts: int,
                   dropless: str = "largest") -> int:
    """This rank's capacity for `factor` (before the agreement across ranks)."""
    num_tokens, top_k = indices.shape
    if factor > 0:
        return rule_capacity(rule, factor, num_tokens, num_experts, top_k)
    if factor == 0 and dropless == "worst_case":
        return max(num_tokens, 1)
    # Each expert's count by a scatter, not bincount, whose output size depends on the values (on a GPU, a
    # second stream sync before the one read of the largest count).
    chosen = indices.reshape(-1)
    counts = chosen.new_zeros(num_experts).scatter_add_(0, chosen, torch.ones_like(chosen))
    needed = max(int(counts.max()) if counts.numel() else 0, 1)
    if factor < 0:
        needed = min(needed, rule_capacity(rule, -factor, num_tokens, num_experts, top_k))
    return needed


def buffer_capacity(capacity: int, multiple: int) -> int:
    """Rows per expert in the dispatch buffer: `capacity` rounded up to `multiple`."""
    return -(-capacity // multiple) * multiple
