"""Tutel's extract_critical over a group (moe_runtime.moe.ops): ranks with
different token counts agree on the capacity of a factor <= 0 (the largest
expert's count on any rank) and, with inequivalent_tokens, on the token count
of the rule (the largest on any rank), whether the group is the suite's
a2a.Comm or None (the job). Every rank recomputes every rank's scores, so the
expected capacity needs no collective."""

from __future__ import annotations

import pytest
import torch

from moe_runtime.moe import ops

EXPERTS, TOP_K, MODEL_DIM = 4, 2, 3
CPU = DEVICE = torch.device("cpu")  # tests/gpu/test_tutel_gpu.py has the layer on CUDA


def tokens_of(rank: int) -> int:
    return 5 + 7 * rank  # different on every rank


def scores_of(rank: int, device: torch.device) -> torch.Tensor:
    """Rank i's scores, skewed towards expert i % E so that the ranks' largest counts differ."""
    generator = torch.Generator().manual_seed(300 + rank)
    logits = torch.randn(tokens_of(rank), EXPERTS, generator=generator, dtype=torch.float64)
    logits[:, rank % EXPERTS] += 1.5
    return torch.softmax(logits, dim=1).to(device)


def expected_capacity(world: int, rank: int, factor: float, inequivalent: bool, alignment: int) -> int:
    """Tutel's rule over the group, from every rank's scores."""
    counts = [torch.bincount(torch.topk(scores_of(r, CPU), TOP_K, dim=1).indices.reshape(-1), minlength=EXPERTS)
              for r in range(world)]
    most = max(int(c.max()) for c in counts)
    samples = max(tokens_of(r) for r in range(world)) if inequivalent else tokens_of(rank)
    per_expert = -(-samples // EXPERTS)
    if factor > 0:
        capacity = TOP_K * int(factor * per_expert)
    elif factor == 0:
        capacity = most
    else:
        capacity = min(most, TOP_K * int(-factor * per_expert))
    return -(-capacity // alignment) * alignment


@pytest.mark.parametrize("group", ["comm", "job"])
@pytest.mark.parametrize("inequivalent", [False, True], ids=["own-tokens", "inequivalent"])
@pytest.mark.parametrize("factor, alignment", [(0.0, 1), (0.0, 3), (-0.5, 1), (-4.0, 1), (1.0, 1)])
def test_capacity_agreed_over_the_group(comm, factor, alignment, inequivalent, group):
    device = DEVICE if group == "comm" else CPU
    scores = scores_of(comm.rank, device)
    crit, _ = ops.extract_critical(scores, TOP_K, capacity_factor=factor, alignment=alignment,
                                   group=comm if group == "comm" else None, inequivalent_tokens=inequivalent)
    assert crit[4] == expected_capacity(comm.size, comm.rank, factor, inequivalent, alignment)
    if factor == 0:
        assert crit.routing.num_dropped == 0
    x = torch.randn(tokens_of(comm.rank), MODEL_DIM, dtype=torch.float64).to(device)
    y = ops.fast_decode(ops.fast_encode(x, crit), crit)  # identity experts
    kept = torch.stack(crit[2], dim=1) < crit[4]
    torch.testing.assert_close(y, x * (torch.stack(crit[3], dim=1) * kept).sum(dim=1, keepdim=True))
