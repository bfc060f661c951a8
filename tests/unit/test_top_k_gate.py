"""a2a.top_k_gate and a2a.top_k_gate_backward (the fused gate, a2a_top_k_gate
in a2a.h) against a plain NumPy float64 reference of the same math: softmax,
the top-k choices (ties by the lower expert, NaN above every number), the
gates, the share of first choices, GShard's loss, and the backward; NumPy and
torch arrays, float32 and float64; and their errors."""

from __future__ import annotations

import numpy as np
import pytest

import a2a

torch = pytest.importorskip("torch")


def reference(logits, k, normalize):
    """(scores, indices, gates, share, l_aux) in float64, by the definition."""
    x = np.asarray(logits, dtype=np.float64)
    num_tokens, num_experts = x.shape
    with np.errstate(invalid="ignore", over="ignore"):
        e = np.exp(x - x.max(axis=1, keepdims=True))
        scores = e / e.sum(axis=1, keepdims=True)
    if np.isnan(x).any():
        scores[np.isnan(x).any(axis=1)] = np.nan
    # rank: NaN first, then larger, then the lower expert
    keys = np.where(np.isnan(scores), np.inf, scores)
    indices = np.array([sorted(range(num_experts), key=lambda i: (-keys[t, i], i))[:k] for t in range(num_tokens)],
                       dtype=np.int64).reshape(num_tokens, k)
    top = np.take_along_axis(scores, indices, axis=1)
    gates = top
    if normalize:
        eps = np.finfo(np.asarray(logits).dtype).eps
        gates = top / np.maximum(top.sum(axis=1, keepdims=True), eps)
    share = np.bincount(indices[:, 0], minlength=num_experts) / max(num_tokens, 1)
    l_aux = num_experts * float((scores.mean(axis=0) * share).sum()) if num_tokens else 0.0
    return scores, indices, gates, share, l_aux


def reference_backward(scores, indices, share, d_gates, d_l_aux, normalize, eps):
    num_tokens, num_experts = scores.shape
    d_scores = np.zeros_like(scores)
    if d_l_aux is not None:
        d_scores += d_l_aux * num_experts / num_tokens * share
    if d_gates is not None:
        top = np.take_along_axis(scores, indices, axis=1)
        sums = top.sum(axis=1, keepdims=True)
        dr = d_gates
        if normalize:
            den = np.maximum(sums, eps)
            dot = (d_gates * top / den).sum(axis=1, keepdims=True) * (sums >= eps)
            dr = (d_gates - dot) / den
        for t in range(num_tokens):
            d_scores[t, indices[t]] += dr[t]
    return scores * (d_scores - (d_scores * scores).sum(axis=1, keepdims=True))


def as_numpy(a):
    return a.numpy() if isinstance(a, torch.Tensor) else np.asarray(a)


@pytest.mark.parametrize("framework", ["numpy", "torch"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("tokens,experts,k,normalize", [(1, 1, 1, True), (7, 2, 2, True), (37, 5, 3, False),
                                                        (200, 8, 2, True), (130, 64, 8, True), (33, 3, 1, False)])
def test_forward_matches_the_definition(framework, dtype, tokens, experts, k, normalize):
    rng = np.random.default_rng(tokens * experts + k)
    x = (rng.standard_normal((tokens, experts)) * 3).astype(dtype)
    logits = torch.from_numpy(x) if framework == "torch" else x
    scores, indices, gates, share, l_aux = (as_numpy(a) for a in a2a.top_k_gate(logits, k, normalize=normalize))
    s0, i0, g0, sh0, l0 = reference(x, k, normalize)
    tolerance = 1e-6 if dtype == "float32" else 1e-14
    assert scores.dtype == np.dtype(dtype) and gates.dtype == np.dtype(dtype) and indices.dtype == np.int64
    assert indices.shape == (tokens, k) and share.shape == (experts,) and l_aux.shape == ()
    np.testing.assert_array_equal(indices, i0)
    np.testing.assert_allclose(scores, s0, rtol=tolerance, atol=tolerance)
    np.testing.assert_allclose(gates, g0, rtol=tolerance, atol=tolerance)
    np.testing.assert_allclose(share, sh0, rtol=tolerance, atol=0)
    np.testing.assert_allclose(float(l_aux), l0, rtol=tolerance)


@pytest.mark.parametrize("dtype,tolerance", [(torch.float16, 1e-3), (torch.bfloat16, 8e-3)])
def test_16_bit_logits_round_where_torch_rounds(dtype, tolerance):
    # Computed in float32: the scores rounded to the dtype; the choices of the logits (which the softmax
    # orders alike; rounded scores tie where logits do not), the gates from the rounded scores; the loss
    # and gradients to the dtype's precision.
    g = torch.Generator().manual_seed(7)
    x = torch.randn(300, 8, generator=g, dtype=torch.float64).mul(2)
    scores, indices, gates, share, l_aux = a2a.top_k_gate(x.to(dtype), 2, normalize=True)
    assert scores.dtype == gates.dtype == share.dtype == l_aux.dtype == dtype
    s0, _, _, _, l0 = reference(x.to(dtype).double().numpy(), 2, True)
    np.testing.assert_allclose(scores.double().numpy(), s0, rtol=tolerance, atol=tolerance)
    exact = scores.double().numpy()
    _, i0, _, _, _ = reference(x.to(dtype).double().numpy(), 2, True)
    np.testing.assert_array_equal(indices.numpy(), i0)
    _, _, g1, sh1, _ = reference(np.log(exact), 2, True)  # the gates and share of the rounded scores
    np.testing.assert_allclose(gates.double().numpy(), g1, rtol=2 * tolerance, atol=2 * tolerance)
    np.testing.assert_allclose(share.double().numpy(), sh1, rtol=tolerance)
    np.testing.assert_allclose(float(l_aux), l0, rtol=2 * tolerance)
    d_gates = torch.randn(300, 2, generator=g, dtype=torch.float64)
    d_logits = a2a.top_k_gate_backward(scores, indices, share, d_gates.to(dtype), torch.tensor(0.5, dtype=dtype),
                                       normalize=True)
    expected = reference_backward(exact, indices.numpy(), share.double().numpy(), d_gates.to(dtype).double().numpy(),
                                  0.5, True, torch.finfo(dtype).eps)
    assert d_logits.dtype == dtype
    np.testing.assert_allclose(d_logits.double().numpy(), expected, rtol=4 * tolerance, atol=4 * tolerance)


def test_ties_go_to_the_lower_expert_and_nan_ranks_first():
    x = np.array([[0.0] * 6,                                # all equal: 0, 1, 2
                  [1.0, 3.0, 3.0, 0.0, 3.0, 2.0],           # three equal best: 1, 2, 4
                  [1.0, np.nan, 3.0, 0.0, 2.0, 2.0],        # a NaN makes every score NaN: 0, 1, 2
                  [np.inf, 0.0, 1.0, 2.0, 3.0, 4.0],        # inf - inf: a NaN sum, every score NaN
                  [-np.inf, 0.0, 0.0, -1.0, 5.0, -np.inf]])  # -inf: a score of 0
    scores, indices, gates, _, _ = a2a.top_k_gate(x, 3, normalize=True)
    assert indices.tolist() == [[0, 1, 2], [1, 2, 4], [0, 1, 2], [0, 1, 2], [4, 1, 2]]
    assert np.isnan(scores[2]).all() and np.isnan(gates[2]).all()
    assert np.isnan(scores[3]).all()
    assert scores[4, 0] == 0 and scores[4, 5] == 0
    np.testing.assert_allclose(gates[0], [1 / 3] * 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("with_gates,with_loss", [(True, True), (True, False), (False, True)])
def test_backward_matches_the_definition(dtype, normalize, with_gates, with_loss):
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(29, 6, generator=g, dtype=torch.float64).mul(2).to(dtype)
    scores, indices, _, share, _ = a2a.top_k_gate(logits, 2, normalize=normalize)
    d_gates = torch.randn(29, 2, generator=g, dtype=torch.float64).to(dtype) if with_gates else None
    d_l_aux = torch.tensor(0.7, dtype=dtype) if with_loss else None
    d_logits = a2a.top_k_gate_backward(scores, indices, share, d_gates, d_l_aux, normalize=normalize)
    expected = reference_backward(scores.double().numpy(), indices.numpy(), share.double().numpy(),
                                  None if d_gates is None else d_gates.double().numpy(),
                                  None if d_l_aux is None else float(d_l_aux), normalize, torch.finfo(dtype).eps)
    tolerance = 1e-6 if dtype == torch.float32 else 1e-14
    assert d_logits.dtype == dtype and d_logits.shape == logits.shape
    np.testing.assert_allclose(d_logits.double().numpy(), expected, rtol=tolerance, atol=tolerance)


def test_backward_of_numpy_arrays_matches_torch():
    x = np.random.default_rng(2).standard_normal((11, 4))
    scores, indices, _, share, _ = a2a.top_k_gate(x, 2, normalize=True)
    d_gates = np.random.default_rng(3).standard_normal((11, 2))
    d_l_aux = np.array(1.5)
    ours = a2a.top_k_gate_backward(scores, indices, share, d_gates, d_l_aux, normalize=True)
    theirs = a2a.top_k_gate_backward(*(torch.from_numpy(a) for a in (scores, indices, share, d_gates, d_l_aux)),
                                     normalize=True)
    assert isinstance(ours, np.ndarray)
    np.testing.assert_array_equal(ours, theirs.numpy())


def test_a_clamped_denominator_passes_no_gradient():
    # The backward takes any scores: two chosen scores summing to less than float32's eps clamp the denominator.
    scores = torch.tensor([[1e-8, 2e-8, 1.0 - 3e-8]], dtype=torch.float32)
    indices = torch.tensor([[1, 0]])
    share = torch.tensor([0.0, 1.0, 0.0])
    d_gates = torch.tensor([[0.5, -0.25]])
    d_logits = a2a.top_k_gate_backward(scores, indices, share, d_gates, None, normalize=True)
    expected = reference_backward(scores.double().numpy(), indices.numpy(), share.double().numpy(),
                                  d_gates.double().numpy(), None, True, torch.finfo(torch.float32).eps)
    np.testing.assert_allclose(d_logits.double().numpy(), expected, rtol=1e-5, atol=1e-12)


def test_logits_that_require_grad_record_autograd():
    # a2a.top_k_gate on logits that require grad is a2a.torch.top_k_gate: the gates and the loss
    # differentiate (gradcheck in float64), the scores, indices and share do not.
    logits = torch.randn(9, 6, dtype=torch.float64, requires_grad=True)
    scores, indices, gates, share, l_aux = a2a.top_k_gate(logits, 2, normalize=True)
    assert gates.requires_grad and l_aux.requires_grad
    assert not (scores.requires_grad or indices.requires_grad or share.requires_grad)

    def differentiable(x):
        _, _, g, _, loss = a2a.top_k_gate(x, 2, normalize=True)
        return g, loss

    assert torch.autograd.gradcheck(differentiable, (logits,))
    with torch.no_grad():
        assert not a2a.top_k_gate(logits, 2)[2].requires_grad


def test_no_tokens():
    scores, indices, gates, share, l_aux = a2a.top_k_gate(torch.zeros(0, 4), 2, normalize=True)
    assert scores.shape == (0, 4) and indices.shape == (0, 2) and gates.shape == (0, 2)
    assert share.tolist() == [0.0] * 4 and float(l_aux) == 0.0
    d = a2a.top_k_gate_backward(scores, indices, share, gates, torch.tensor(1.0), normalize=True)
    assert d.shape == (0, 4)


def test_one_native_call_each_way_and_nothing_waits():
    logits = torch.randn(16, 4)
    a2a.top_k_gate(logits, 2)  # the workspace's size is asked once per shape
    with a2a.counting() as cost:
        scores, indices, gates, share, _ = a2a.top_k_gate(logits, 2)
        a2a.top_k_gate_backward(scores, indices, share, gates, torch.tensor(1.0))
    # (the counting itself is one call)
    assert (cost.counters.calls, cost.counters.kernel_calls, cost.counters.host_waits) == (3, 2, 0)


@pytest.mark.parametrize("call,error,words", [
    (lambda: a2a.top_k_gate(torch.ones(4, 3, dtype=torch.int32), 2), a2a.InvalidArgumentError,
     "of float32, float64, float16, bfloat16"),
    (lambda: a2a.top_k_gate(torch.randn(4, 3), 4), a2a.InvalidArgumentError, "k must be an integer in 1..3"),
    (lambda: a2a.top_k_gate(torch.randn(4, 3), 0), a2a.InvalidArgumentError, "got 0"),
    (lambda: a2a.top_k_gate(torch.randn(4, 3, 2), 1), a2a.InvalidArgumentError, "(tokens, experts >= 1)"),
    (lambda: a2a.top_k_gate(torch.randn(4, 0), 1), a2a.InvalidArgumentError, "(tokens, experts >= 1)"),
    (lambda: a2a.top_k_gate(torch.randn(3, 4).t(), 1), a2a.InvalidArgumentError, "contiguous"),
    (lambda: a2a.top_k_gate([[1.0, 2.0]], 1), TypeError, "top_k_gate"),
])
def test_bad_forward_arguments(call, error, words):
    with pytest.raises(error, match=None) as raised:
        call()
    assert words in str(raised.value)


def test_sizes_that_overflow_are_refused_even_without_tokens():
    # E = 2^62 with T = 0: the share's and the workspace's bytes would wrap to 0 (and the kernel write
    # through NULL); the sizes are checked first.
    from a2a import _C
    from a2a._arrays import DEVICE_CPU, DTYPE_CODES

    gate = (0, 2**62, 1, False, DTYPE_CODES["float32"])
    with pytest.raises(a2a.InvalidArgumentError, match="overflows int64"):
        _C.top_k_gate_workspace_size(gate)
    l_aux = np.zeros((), np.float32)
    with pytest.raises(a2a.InvalidArgumentError, match="overflows int64"):
        _C.top_k_gate((DEVICE_CPU, 0, 0), gate, 0, 0, 0, 0, 0, l_aux.ctypes.data, 0)


def test_bad_backward_arguments():
    scores, indices, gates, share, _ = a2a.top_k_gate(torch.randn(5, 4), 2)
    with pytest.raises(a2a.InvalidArgumentError, match=r"d_gates must be \(5, 2\) of float32"):
        a2a.top_k_gate_backward(scores, indices, share, gates.double())
    with pytest.raises(a2a.InvalidArgumentError, match=r"share must be \(4,\)"):
        a2a.top_k_gate_backward(scores, indices, share[:3].contiguous(), gates)
    with pytest.raises(a2a.InvalidArgumentError, match=r"indices must be \(5, k <= 4\) of int64"):
        a2a.top_k_gate_backward(scores, indices.double(), share, gates)
    # int32 indices (JAX's without x64) are widened: the same gradient
    widened = a2a.top_k_gate_backward(scores.numpy(), indices.int().numpy(), share.numpy(), gates.numpy())
    np.testing.assert_array_equal(widened, a2a.top_k_gate_backward(scores, indices, share, gates).numpy())
    with pytest.raises(a2a.InvalidArgumentError, match=r"d_l_aux must be \(\)"):
        a2a.top_k_gate_backward(scores, indices, share, gates, torch.ones(2))
    bad = indices.clone()
    bad[3, 1] = 4
    bad[4, 1] = bad[4, 0]  # a repeated expert
    with pytest.raises(a2a.InvalidArgumentError, match="indices of token 3 are not 2 distinct experts in 0..3"):
        a2a.top_k_gate_backward(scores, bad, share, gates)
    bad[3, 1] = indices[3, 1]
    with pytest.raises(a2a.InvalidArgumentError, match="indices of token 4 are not 2 distinct experts in 0..3"):
        a2a.top_k_gate_backward(scores, bad, share, gates)
