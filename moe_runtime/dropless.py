"""The dropless dispatcher (the Deployment paper's dynamic gating, Fig. 8b):
every routed choice reaches its expert, nothing is padded, nothing dropped.

One call, r = 1 (each rank holds n whole experts: E = n W), d = 1::

    tokens (T, M), indices (T, k)
    permute          -> x_sorted (N, M), rows grouped by expert; counts (E,)
    count exchange   -> per source rank, the rows of each of my n experts
                        (a2a.all_to_all of E int64 per rank)
    all_to_all_v     -> received (R, M): source-major, then expert-major
    permute by local expert -> (R, M) grouped by my experts
    FFN of each expert on its contiguous rows (no padding)
    unpermute        -> (R, M) in the received order
    all_to_all_v back (the received counts) -> (N, M) in x_sorted's order
    unpermute with the gates -> y (T, M)

Every step is a differentiable a2a.torch function (or a torch op), so
autograd runs the reverse flow. Only r = 1 with whole experts: with s > 1
ranks sharing an expert each row would go to every sharer (model
parallelism), which the padded flows already do; and d = 1, since the
chunks of the pipelined flows are slices of the padded capacity axis, which
this layout does not have.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

import a2a
import a2a.torch as a2a_torch

__all__ = ["dropless_moe", "expert_ffn", "scale_weight_gradients"]

Weights = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]


class _ScaledGradient(torch.autograd.Function):
    """Identity whose backward multiplies the gradient by `scale`: the layer's
    1/W for expert gradients ("mean"), applied once per weight."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def scale_weight_gradients(weights: Weights, scale: float) -> Weights:
    """The weights (fc1, fc1_bias, fc2, fc2_bias), their gradients scaled by
    `scale` (the layer's 1/W for "mean"; unchanged for 1)."""
    if scale == 1.0:
        return weights
    return tuple(None if w is None else _ScaledGradient.apply(w, scale) for w in weights)


def expert_ffn(rows: torch.Tensor, weights: Weights, expert: int,
               activation: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Local expert `expert`'s FFN on its rows (R, M) -> (R, M):
    fc2^T act(fc1 x + b1) + b2."""
    fc1, fc1_bias, fc2, fc2_bias = weights
    hidden = torch.nn.functional.linear(rows, fc1[expert], None if fc1_bias is None else fc1_bias[expert])
    return torch.nn.functional.linear(activation(hidden), fc2[expert].t(),
                                      None if fc2_bias is None else fc2_bias[expert])


def _expert_rows_per_source(counts: torch.Tensor, comm: a2a.Comm) -> np.ndarray:
    """(W, n): how many rows each source rank sends to each of my n experts.
    `counts` (E,) is this rank's rows per expert, on the tokens' device; E =
    n W, experts of rank j are [j n, (j + 1) n)."""
    received = a2a.all_to_all(counts.contiguous(), comm=comm)  # block j of rank i's counts goes to rank j
    return received.cpu().numpy().reshape(comm.size, -1)


def dropless_moe(tokens: torch.Tensor, indices: torch.Tensor, gates: torch.Tensor | None, *,
                 weights: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None],
                 activation: Callable[[torch.Tensor], torch.Tensor], comm: a2a.Comm, algo: str,
                 weight_grad_scale: float = 1.0) -> tuple[torch.Tensor, np.ndarray, int]:
    """y (T, M) of this rank's tokens, the rows each local expert computed
    (n,), and the rows this rank sent to other ranks (in each exchange). `weights`: this rank's (fc1 (n, H, M), fc1_bias (n, H) or
    None, fc2 (n, H, M), fc2_bias (n, M) or None); `gates` (T, k) weigh the
    expert outputs at the combine (None: weight 1)."""
    local = weights[0].shape[0]
    num_experts = local * comm.size
    weights = scale_weight_gradients(weights, weight_grad_scale)

    x_sorted, perm = a2a_torch.permute(tokens, indices, num_experts)
    per_source = _expert_rows_per_source(perm.counts, comm)  # (W, n)
    send_counts = perm.counts.view(comm.size, local).sum(dim=1).cpu().numpy()
    received, recv_counts = a2a_torch.all_to_all_v(x_sorted, send_counts, comm=comm, algo=algo)

    # Received rows are source-major; group them by local expert.
    expert_of_row = np.repeat(np.tile(np.arange(local, dtype=np.int64), comm.size), per_source.reshape(-1))
    expert_of_row = torch.from_numpy(expert_of_row).to(tokens.device).view(-1, 1)
    by_expert, local_perm = a2a_torch.permute(received, expert_of_row, local)
    offsets = local_perm.offsets.tolist()
    computed = torch.cat([expert_ffn(by_expert[offsets[e] : offsets[e + 1]], weights, e, activation)
                          for e in range(local)])
    back = a2a_torch.unpermute(computed, local_perm)  # the received order again
    returned, _ = a2a_torch.all_to_all_v(back, recv_counts, comm=comm, algo=algo)
    y = a2a_torch.unpermute(returned, perm, gates)
    sent_to_others = int(send_counts.sum() - send_counts[comm.rank])
    return y, per_source.sum(axis=0), sent_to_others
