"""Auxiliary losses of the gates (what keeps the experts' load balanced).

All take the gate's scores (T, E), softmax over experts, of one rank's tokens;
each rank's loss is its own (as in Tutel: no cross-rank reduction; DDP-style
averaging of the gate's gradients does the rest).

- ``gshard_loss`` (GShard, the layer's default): ``E * sum_e me_e * ce_e``,
  me_e the mean score of expert e, ce_e the fraction of tokens whose first
  choice is e. 1.0 when both are uniform.
- ``load_importance_loss`` (Shazeer et al. 2017, ``is_gshard_loss=False``):
  the mean of the squared coefficients of variation of the importance (the
  summed scores) and of the load (the expected number of tokens routed to
  each expert under the gate noise). Needs ``gate_noise > 0``.
- ``z_loss`` (ST-MoE): mean over tokens of ``logsumexp(logits)**2``; keeps
  the logits small. Added with the gate's ``z_loss_coef`` (0: off).
"""

from __future__ import annotations

import math

import torch

__all__ = ["gshard_loss", "gshard_loss_and_share", "load_importance_loss", "z_loss"]


def gshard_loss(scores: torch.Tensor, top_indices: torch.Tensor) -> torch.Tensor:
    """scores (T, E), top_indices (T, k): E * sum_e mean_t(scores) * share of first choices."""
    return gshard_loss_and_share(scores, top_indices)[0]


def gshard_loss_and_share(scores: torch.Tensor, top_indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """GShard's loss and the share of the tokens whose first choice
    (``top_indices[:, 0]``) is each expert, (E,); None without tokens (the
    loss is then 0). d loss / d scores[t, e] = E share[e] / T."""
    num_tokens, num_experts = scores.shape
    if num_tokens == 0:
        return scores.sum() * 0.0, None
    share = torch.zeros_like(scores).scatter_(1, top_indices[:, :1], 1.0).mean(0)
    return (scores.mean(0) * share).sum() * num_experts, share


def _squared_cv(values: torch.Tensor) -> torch.Tensor:
    """var / mean**2 (unbiased variance), 0 for a single expert."""
    if values.numel() < 2:
        return values.sum() * 0.0
    return values.var() / (values.mean() ** 2 + 1e-10)


def load_importance_loss(scores: torch.Tensor, clean_logits: torch.Tensor, noisy_logits: torch.Tensor, top_k: int,
                         gate_noise: float) -> torch.Tensor:
    """(cv^2(importance) + cv^2(load)) / 2. The load of expert e is the sum over
    tokens of the probability that e stays in the token's top-k under a new
    draw of the noise: Phi((clean_e - threshold) / sigma), with threshold the
    token's k-th largest noisy logit and sigma = gate_noise / E (the noise
    the gate adds)."""
    if gate_noise <= 0:
        raise ValueError("load_importance_loss (is_gshard_loss=False) needs gate_noise > 0 in the gate's settings")
    num_experts = scores.shape[1]
    sigma = gate_noise / num_experts
    threshold = noisy_logits.topk(top_k, dim=1).values[:, -1:]
    z = (clean_logits - threshold) / sigma
    load = (0.5 * (1.0 + torch.erf(z / math.sqrt(2.0)))).sum(0)
    return (_squared_cv(scores.sum(0)) + _squared_cv(load)) / 2.0


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    """mean_t logsumexp(logits_t)**2."""
    if logits.shape[0] == 0:
        return logits.sum() * 0.0
    return torch.logsumexp(logits, dim=1).pow(2).mean()
