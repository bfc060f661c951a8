"""The gate's routing as one autograd node (moe_runtime/gating/topk.py)
against the same math left to autograd. Both paths of the node: its own
torch ops (16-bit logits under autocast), bit for bit in the forward; a2a's
fused gate (every dtype otherwise), to rounding, with ties between equal
scores to the lower expert (the reference then takes the fused gate's
choices: torch's topk breaks ties its own way). The backward to rounding;
torch.autograd.gradcheck in float64."""

from __future__ import annotations

import pytest
import torch

from a2a._torch_gating import _TopKGate
from moe_runtime.gating import topk
from moe_runtime.gating.losses import gshard_loss
from moe_runtime.gating.topk import top_k_gating


def node_of(tensor):
    """The autograd Function whose node made `tensor`."""
    return tensor.grad_fn._forward_cls


def autograd_gating(logits, top_k, normalize, with_loss, indices=None):
    """decide()'s routing as it was written before the node: every op recorded by autograd (the choices
    `indices` where given, else torch's topk)."""
    scores = torch.softmax(logits, dim=1)
    if indices is None:
        indices = torch.topk(scores, top_k, dim=1).indices
    gates = scores.gather(1, indices)
    if normalize and top_k > 1:
        gates = gates / gates.sum(dim=1, keepdim=True).clamp(min=torch.finfo(gates.dtype).eps)
    return scores, indices, gates, gshard_loss(scores, indices) if with_loss else None


def ops_gating(logits, top_k, normalize, with_loss):
    """The node on its own torch ops (the path of 16-bit logits under autocast)."""
    return topk._TopKGating.apply(logits, top_k, normalize and top_k > 1, with_loss)


def both(logits, top_k, normalize, with_loss, weights, path=top_k_gating):
    """`path`'s outputs and d(loss)/d(logits), loss = sum(gates * weights) + 3 l_aux, and autograd's
    over the same choices."""
    results, chosen = [], None
    for run in (path, autograd_gating):
        leaf = logits.detach().clone().requires_grad_(True)
        extra = {} if run is path else {"indices": chosen}
        scores, indices, gates, l_aux = run(leaf, top_k, normalize, with_loss, **extra)
        chosen = indices
        loss = (gates * weights).sum() + (3 * l_aux if l_aux is not None else 0)
        loss.backward()
        results.append((scores, indices, gates, l_aux, leaf.grad))
    return results


def assert_top_k(logits, indices):
    """indices are the top k of the logits (the softmax orders its scores alike), best first, ties to the
    lower expert."""
    s = logits.double()
    chosen = s.gather(1, indices)
    assert (chosen[:, :-1] >= chosen[:, 1:]).all()
    rest = s.scatter(1, indices, float("-inf"))
    assert (rest.max(dim=1).values <= chosen[:, -1]).all()
    for t in range(s.shape[0]):  # among equal scores, the chosen ones are the lowest experts
        for j in range(indices.shape[1]):
            equal = (s[t] == chosen[t, j]).nonzero().flatten().tolist()
            assert set(indices[t].tolist()) >= set(equal[: equal.index(indices[t, j].item()) + 1]), (t, j)


TOLERANCE = {torch.float64: (1e-15, 1e-13), torch.float32: (1e-6, 1e-6), torch.bfloat16: (8e-3, 2e-2),
             torch.float16: (1e-3, 2e-3)}  # (forward, backward)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("top_k,normalize,with_loss", [(1, True, True), (2, True, True), (3, False, True),
                                                         (2, True, False), (4, True, True)])
def test_the_fused_node_computes_what_autograd_does(dtype, top_k, normalize, with_loss):
    torch.manual_seed(top_k)
    logits = torch.randn(37, 5, dtype=torch.float64).mul(3).to(dtype)
    weights = torch.randn(37, top_k, dtype=torch.float64).to(dtype)
    (s, i, g, l, dx), (s0, _, g0, l0, dx0) = both(logits, top_k, normalize, with_loss, weights)
    assert node_of(g) is _TopKGate
    assert_top_k(logits, i)
    if dtype in (torch.float32, torch.float64):  # no ties: torch's topk chooses the same
        assert torch.equal(i, torch.topk(s0, top_k, dim=1).indices)
    assert (l is None) == (l0 is None)
    forward, backward = TOLERANCE[dtype]
    for ours, theirs in ((s, s0), (g, g0), (l, l0)):
        if ours is not None:
            torch.testing.assert_close(ours.double(), theirs.double(), rtol=forward, atol=forward)
    assert not s.requires_grad and not i.requires_grad
    torch.testing.assert_close(dx.double(), dx0.double(), rtol=backward, atol=backward)


@pytest.mark.parametrize("top_k,normalize,with_loss", [(1, True, True), (2, True, True), (4, True, True)])
def test_the_ops_node_computes_what_autograd_did_bit_for_bit(top_k, normalize, with_loss):
    torch.manual_seed(top_k)
    logits = torch.randn(37, 5, dtype=torch.float64).mul(3).to(torch.bfloat16)
    weights = torch.randn(37, top_k, dtype=torch.float64).to(torch.bfloat16)
    (s, i, g, l, dx), (s0, _, g0, l0, dx0) = both(logits, top_k, normalize, with_loss, weights, ops_gating)
    assert torch.equal(i, torch.topk(s0, top_k, dim=1).indices)
    assert torch.equal(s, s0) and torch.equal(g, g0) and torch.equal(l, l0)
    torch.testing.assert_close(dx.double(), dx0.double(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("path", [top_k_gating, ops_gating])
def test_the_clamped_denominator_passes_no_gradient(path):
    # bfloat16's eps is 2^-7: over 1024 nearly uniform experts the two best scores sum to less, and the
    # clamp holds the denominator (autograd's clamp passes no gradient there).
    torch.manual_seed(0)
    logits = (torch.randn(6, 1024) * 0.01).to(torch.bfloat16)
    weights = torch.randn(6, 2).to(torch.bfloat16)
    (s, i, g, _, dx), (_, _, g0, _, dx0) = both(logits, 2, True, True, weights, path)
    top = s.gather(1, i)
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


def test_fused_gate_but_under_autocast_for_16_bit_logits():
    # One native call forward (its gradient taken as a non-contiguous tensor: gates.sum()'s, expanded);
    # the node's own ops for 16-bit logits under autocast, whose softmax runs in float32.
    logits = torch.randn(6, 4, requires_grad=True)
    _, _, gates, l_aux = top_k_gating(logits, 2, True, True)
    assert node_of(gates) is _TopKGate
    (gates.sum() + l_aux).backward()
    assert torch.isfinite(logits.grad).all()
    half = torch.randn(6, 4).bfloat16().requires_grad_(True)
    assert node_of(top_k_gating(half, 2, True, True)[2]) is _TopKGate
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert node_of(top_k_gating(half, 2, True, True)[2]) is topk._TopKGating


def test_scores_in_float32_from_half_logits(monkeypatch):
    # CUDA's autocast runs softmax on the logits cast to float32: the node's backward takes the scores' dtype
    # as the softmax's input, and autograd casts the gradient back to the logits' (emulated on the CPU).
    real_softmax = torch.softmax
    monkeypatch.setattr(topk.torch, "softmax", lambda x, dim: real_softmax(x.float(), dim))
    logits = torch.randn(5, 8).half().requires_grad_(True)
    scores, _, gates, l_aux = ops_gating(logits, 2, True, True)
    assert scores.dtype == torch.float32
    (gates.sum() + l_aux).backward()
    assert logits.grad.dtype == torch.float16 and torch.isfinite(logits.grad).all()
