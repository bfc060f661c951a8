"""The gate's routing as one autograd node (moe_runtime/gating/topk.py)
against the same math left to autograd: the choices equal; the forward
bitwise on the node's own ops (bfloat16 logits) and to rounding on a2a's
fused gate (float32, float64); the backward to rounding; and
torch.autograd.gradcheck in float64."""

from __future__ import annotations

import pytest
import torch

from moe_runtime.gating.losses import gshard_loss
from moe_runtime.gating.topk import top_k_gating


def autograd_gating(logits, top_k, normalize, with_loss):
    """decide()'s routing as it was written before the node: every op recorded by autograd."""
    scores = torch.softmax(logits, dim=1)
    indices = torch.topk(scores, top_k, dim=1).indices
    gates = scores.gather(1, indices)
    if normalize and top_k > 1:
        gates = gates / gates.sum(dim=1, keepdim=True).clamp(min=torch.finfo(gates.dtype).eps)
    return scores, indices, gates, gshard_loss(scores, indices) if with_loss else None


def both(logits, top_k, normalize, with_loss, weights):
    """Each path's outputs and d(loss)/d(logits), loss = sum(gates * weights) + 3 l_aux."""
    results = []
    for path in (top_k_gating, autograd_gating):
        leaf = logits.detach().clone().requires_grad_(True)
        scores, indices, gates, l_aux = path(leaf, top_k, normalize, with_loss)
        loss = (gates * weights).sum() + (3 * l_aux if l_aux is not None else 0)
        loss.backward()
        results.append((scores, indices, gates, l_aux, leaf.grad))
    return results


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("top_k,normalize,with_loss", [(1, True, True), (2, True, True), (3, False, True),
                                                         (2, True, False), (4, True, True)])
def test_the_node_computes_what_autograd_did(dtype, top_k, normalize, with_loss):
    torch.manual_seed(top_k)
    logits = torch.randn(37, 5, dtype=torch.float64).mul(3).to(dtype)
    weights = torch.randn(37, top_k, dtype=torch.float64).to(dtype)
    (s, i, g, l, dx), (s0, i0, g0, l0, dx0) = both(logits, top_k, normalize, with_loss, weights)
    assert torch.equal(i, i0)
    assert (l is None) == (l0 is None)
    if dtype == torch.bfloat16:  # the node's own ops: autograd's forward, bit for bit
        assert torch.equal(s, s0) and torch.equal(g, g0) and (l is None or torch.equal(l, l0))
    else:  # a2a's fused gate: its own order of summation
        forward_tolerance = {torch.float64: 1e-15, torch.float32: 1e-6}[dtype]
        for ours, theirs in ((s, s0), (g, g0), (l, l0)):
            if ours is not None:
                torch.testing.assert_close(ours, theirs, rtol=forward_tolerance, atol=forward_tolerance)
    assert not s.requires_grad and not i.requires_grad
    tolerance = {torch.float64: 1e-13, torch.float32: 1e-6, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(dx.double(), dx0.double(), rtol=tolerance, atol=tolerance)


def test_the_clamped_denominator_passes_no_gradient():
    # bfloat16's eps is 2^-7: over 1024 nearly uniform experts the two best scores sum to less, and the
    # clamp holds the denominator (autograd's clamp passes no gradient there).
    torch.manual_seed(0)
    logits = (torch.randn(6, 1024) * 0.01).to(torch.bfloat16)
    weights = torch.randn(6, 2).to(torch.bfloat16)
    (_, _, g, _, dx), (_, _, g0, _, dx0) = both(logits, 2, True, True, weights)
    top = torch.softmax(logits, dim=1).topk(2, dim=1).values
    assert (top.sum(1) < torch.finfo(torch.bfloat16).eps).all()
    assert torch.equal(g, g0)
    torch.testing.assert_close(dx.double(), dx0.double(), rtol=2e-2, atol=1e-6)


def test_gradcheck_in_float64():
    torch.manual_seed(3)
    logits = torch.randn(9, 6, dtype=torch.float64, requires_grad=True)

    def outputs(x):
        _, _, gates, l_aux = top_k_gating(x, 2, True, True)
        return gates, l_aux

    assert torch.autograd.gradcheck(outputs, (logits,))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_tokens(dtype):
    logits = torch.zeros(0, 4, dtype=dtype, requires_grad=True)
    scores, indices, gates, l_aux = top_k_gating(logits, 2, True, True)
    assert scores.shape == (0, 4) and indices.shape == (0, 2) and gates.shape == (0, 2)
    (gates.sum() + l_aux).backward()
    assert float(l_aux.detach()) == 0.0 and logits.grad.shape == (0, 4)


def test_fused_gate_on_float32_and_the_ops_elsewhere():
    # One native call forward on float32 / float64 logits (the node's own ops on 16-bit ones), and its
    # gradient as a non-contiguous tensor (an expanded gradient of gates.sum()) taken too.
    from moe_runtime.gating import topk

    logits = torch.randn(6, 4, requires_grad=True)
    _, _, gates, l_aux = top_k_gating(logits, 2, True, True)
    assert type(gates.grad_fn).__name__.startswith(topk._FusedTopKGating.__name__)
    (gates.sum() + l_aux).backward()
    assert torch.isfinite(logits.grad).all()
    half = torch.randn(6, 4).bfloat16().requires_grad_(True)
    assert type(top_k_gating(half, 2, True, True)[2].grad_fn).__name__.startswith(topk._TopKGating.__name__)


def test_scores_in_float32_from_half_logits(monkeypatch):
    # CUDA's autocast runs softmax on the logits cast to float32: the node's backward takes the scores' dtype
    # as the softmax's input, and autograd casts the gradient back to the logits' (emulated on the CPU).
    from moe_runtime.gating import topk

    real_softmax = torch.softmax
    monkeypatch.setattr(topk.torch, "softmax", lambda x, dim: real_softmax(x.float(), dim))
    logits = torch.randn(5, 8).half().requires_grad_(True)
    scores, _, gates, l_aux = top_k_gating(logits, 2, True, True)
    assert scores.dtype == torch.float32
    (gates.sum() + l_aux).backward()
    assert logits.grad.dtype == torch.float16 and torch.isfinite(logits.grad).all()
