"""The expert-specific operators (a2a.es_index, esmm, ess, estmm) against a
per-expert loop of dense float64 matmuls, over random shapes, dtypes, top-k
and unrouted choices; their autograd by gradcheck; and their errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import a2a

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
# Tolerance relative to the largest reference value: fp32 accumulation in a
# different order, and one rounding of the output.
TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-12, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _routing(gen: torch.Generator, T: int, k: int, E: int, unrouted: float = 0.2) -> torch.Tensor:
    indices = torch.randint(0, E, (T, k), generator=gen)
    indices[torch.rand(T, k, generator=gen) < unrouted] = -1
    return indices


def _rand(gen: torch.Generator, *shape: int, dtype=torch.float64) -> torch.Tensor:
    return (torch.rand(*shape, generator=gen, dtype=torch.float64) * 2 - 1).to(dtype)


def _rows(x: torch.Tensor, rows: str, c: int, k: int) -> torch.Tensor:
    return x[c // k] if rows == "token" else x[c]


def reference_esmm(x, w, indices, bias, gates, x_rows, y_rows, w_layout):
    """The per-choice definition in float64."""
    T, k = indices.shape
    n = w.shape[2] if w_layout == "kn" else w.shape[1]
    y = torch.zeros(T if y_rows == "token" else T * k, n, dtype=torch.float64)
    for c, e in enumerate(indices.reshape(-1).tolist()):
        if e < 0:
            continue
        we = w[e].double()
        r = (_rows(x, x_rows, c, k).double() @ we) if w_layout == "kn" else we @ _rows(x, x_rows, c, k).double()
        if bias is not None:
            r = r + bias[e].double()
        if gates is not None:
            r = r * gates.reshape(-1)[c].double()
        y[c // k if y_rows == "token" else c] += r
    return y


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    scale = max(float(want.abs().max()) if want.numel() else 0.0, 1e-30)
    err = float((got.double() - want).abs().max()) if want.numel() else 0.0
    assert err <= TOLERANCE[dtype] * scale * 4, f"max error {err} vs scale {scale} ({dtype})"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", range(4))
def test_esmm_against_reference(dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    T, k, E = int(torch.randint(1, 70, (1,), generator=gen)), 1 + seed % 3, 1 + seed * 2
    M, N = int(torch.randint(1, 40, (1,), generator=gen)), int(torch.randint(1, 40, (1,), generator=gen))
    indices = _routing(gen, T, k, E)
    index = a2a.es_index(indices, E, tile=1 + seed * 3)
    for x_rows in ("token", "choice"):
        for y_rows in ("token", "choice"):
            for w_layout in ("nk", "kn"):
                x = _rand(gen, T if x_rows == "token" else T * k, M, dtype=dtype)
                w = _rand(gen, E, *((M, N) if w_layout == "kn" else (N, M)), dtype=dtype)
                bias = _rand(gen, E, N, dtype=dtype) if seed % 2 else None
                gates = _rand(gen, T, k, dtype=torch.float32 if seed < 2 else dtype) if seed else None
                got = a2a.esmm(x, w, index, bias=bias, gates=gates, x_rows=x_rows, y_rows=y_rows, w_layout=w_layout)
                assert got.dtype == dtype and got.shape == (T if y_rows == "token" else T * k, N)
                _close(got, reference_esmm(x, w, indices, bias, gates, x_rows, y_rows, w_layout), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_ess_and_estmm_against_reference(dtype):
    gen = torch.Generator().manual_seed(7)
    T, k, E, A, B = 53, 2, 6, 21, 35
    indices = _routing(gen, T, k, E)
    indices[:, :] = torch.where(indices == 3, -1, indices)  # expert 3 gets nothing: zeros
    index = a2a.es_index(indices, E, tile=8)
    gates = _rand(gen, T, k, dtype=torch.float32)
    for a_rows, b_rows in (("choice", "token"), ("token", "token"), ("token", "choice")):
        a = _rand(gen, index.rows(a_rows), A, dtype=dtype)
        b = _rand(gen, index.rows(b_rows), B, dtype=dtype)
        want_sum = torch.zeros(E, A, dtype=torch.float64)
        want_outer = torch.zeros(E, A, B, dtype=torch.float64)
        for c, e in enumerate(indices.reshape(-1).tolist()):
            if e >= 0:
                g = gates.reshape(-1)[c].double()
                want_sum[e] += g * _rows(a, a_rows, c, k).double()
                want_outer[e] += g * torch.outer(_rows(a, a_rows, c, k).double(), _rows(b, b_rows, c, k).double())
        _close(a2a.ess(a, index, gates=gates, rows=a_rows), want_sum, dtype)
        _close(a2a.estmm(a, b, index, gates=gates, a_rows=a_rows, b_rows=b_rows), want_outer, dtype)
        assert not a2a.estmm(a, b, index, a_rows=a_rows, b_rows=b_rows)[3].any()


def test_index_layout():
    indices = torch.tensor([[2, 0], [0, -1], [2, 2], [-1, -1], [1, 0]])
    index = a2a.es_index(indices, 4, tile=4)
    assert index.counts.tolist() == [3, 1, 3, 0]
    assert index.expert_starts.tolist() == [0, 4, 8, 12, 12]
    # Tutel's slot order: first choices in token order, then second choices.
    assert index.slots.tolist() == [2, 1, 9, -1, 8, -1, -1, -1, 0, 4, 5, -1]
    assert (index.num_tokens, index.top_k, index.num_experts, index.tile, index.num_slots) == (5, 2, 4, 4, 12)


def test_numpy_inputs_and_determinism():
    rng = np.random.default_rng(3)
    indices = rng.integers(-1, 5, (300, 2)).astype(np.int32)
    index = a2a.es_index(indices, 5)
    x = rng.standard_normal((300, 64)).astype(np.float32)
    w = rng.standard_normal((5, 48, 64)).astype(np.float32)
    gates = rng.random((300, 2)).astype(np.float32)
    first = a2a.esmm(x, w, index, gates=gates, y_rows="token")
    assert isinstance(first, np.ndarray)
    for _ in range(3):
        assert np.array_equal(a2a.esmm(x, w, index, gates=gates, y_rows="token"), first)
    want = reference_esmm(torch.from_numpy(x), torch.from_numpy(w), torch.from_numpy(indices).long(), None,
                          torch.from_numpy(gates), "token", "token", "nk")
    _close(torch.from_numpy(first), want, torch.float32)


@pytest.mark.parametrize("x_rows,y_rows,w_layout", [("token", "choice", "nk"), ("choice", "token", "kn"),
                                                    ("token", "token", "kn"), ("choice", "choice", "nk")])
def test_esmm_gradcheck(x_rows, y_rows, w_layout):
    gen = torch.Generator().manual_seed(1)
    T, k, E, K, N = 11, 2, 3, 5, 4
    index = a2a.es_index(_routing(gen, T, k, E), E, tile=2)
    x = _rand(gen, index.rows(x_rows), K).requires_grad_()
    w = _rand(gen, E, *((K, N) if w_layout == "kn" else (N, K))).requires_grad_()
    bias = _rand(gen, E, N).requires_grad_()
    gates = _rand(gen, T, k).requires_grad_()
    assert torch.autograd.gradcheck(
        lambda *a: a2a.esmm(a[0], a[1], index, bias=a[2], gates=a[3], x_rows=x_rows, y_rows=y_rows,
                            w_layout=w_layout), (x, w, bias, gates))


def test_ess_estmm_gradcheck():
    gen = torch.Generator().manual_seed(2)
    T, k, E = 9, 2, 3
    index = a2a.es_index(_routing(gen, T, k, E), E)
    x = _rand(gen, T, 4).requires_grad_()
    h = _rand(gen, T * k, 3).requires_grad_()
    gates = _rand(gen, T, k).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, g: a2a.ess(a, index, gates=g, rows="token"), (x, gates))
    assert torch.autograd.gradcheck(lambda a, g: a2a.ess(a, index, gates=g, rows="choice"), (h, gates))
    assert torch.autograd.gradcheck(lambda a, b, g: a2a.estmm(a, b, index, gates=g), (h, x, gates))


def test_ffn_matches_per_expert_loop():
    """Tutel's FFN (fc1 by token -> choice, relu, fc2 choice -> token with
    gates) and its gradients equal a plain per-expert loop in float64."""
    gen = torch.Generator().manual_seed(5)
    T, k, E, M, H = 40, 2, 4, 6, 10
    indices = _routing(gen, T, k, E, unrouted=0.1)
    index = a2a.es_index(indices, E)
    params = [_rand(gen, E, H, M).requires_grad_(), _rand(gen, E, H).requires_grad_(),
              _rand(gen, E, H, M).requires_grad_(), _rand(gen, E, M).requires_grad_()]
    x = _rand(gen, T, M).requires_grad_()
    gates = _rand(gen, T, k).requires_grad_()
    fc1, b1, fc2, b2 = params
    h = torch.relu(a2a.esmm(x, fc1, index, bias=b1))
    y = a2a.esmm(h, fc2, index, bias=b2, gates=gates, x_rows="choice", y_rows="token", w_layout="kn")
    dy = _rand(gen, T, M)
    got = torch.autograd.grad(y, [x, gates, *params], dy)
    ref_y = torch.zeros(T, M, dtype=torch.float64)
    for c, e in enumerate(indices.reshape(-1).tolist()):
        if e >= 0:
            t = c // k
            ref_y[t] = ref_y[t] + gates[t, c % k] * (torch.relu(x[t] @ fc1[e].t() + b1[e]) @ fc2[e] + b2[e])
    want = torch.autograd.grad(ref_y, [x, gates, *params], dy)
    torch.testing.assert_close(y, ref_y)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_errors():
    indices = torch.tensor([[0, 1], [2, 0]])
    with pytest.raises(a2a.InvalidArgumentError, match=r"es_index: indices\[1, 0\] = 2 is out of range for num_experts 2"):
        a2a.es_index(indices, 2)
    with pytest.raises(a2a.InvalidArgumentError, match="tile must be >= 1"):
        a2a.es_index(indices, 3, tile=0)
    with pytest.raises(a2a.InvalidArgumentError, match="int32 or int64"):
        a2a.es_index(indices.float(), 3)
    index = a2a.es_index(indices, 3)
    x, w = torch.zeros(2, 4), torch.zeros(3, 5, 4)
    with pytest.raises(a2a.InvalidArgumentError, match=r"esmm: x must be \(4, width\) \(by choice"):
        a2a.esmm(x, w, index, x_rows="choice")
    with pytest.raises(a2a.InvalidArgumentError, match=r"w must be \(E, N, K\) with E = 3 experts and K = 4"):
        a2a.esmm(x, torch.zeros(3, 5, 3), index)
    with pytest.raises(a2a.InvalidArgumentError, match=r"w must be of float32"):
        a2a.esmm(x, w.double(), index)
    with pytest.raises(a2a.InvalidArgumentError, match=r"bias must be \(3, 5\)"):
        a2a.esmm(x, w, index, bias=torch.zeros(3, 4))
    with pytest.raises(a2a.InvalidArgumentError, match=r"gates must be \(2, 2\)"):
        a2a.esmm(x, w, index, gates=torch.zeros(2, 3))
    with pytest.raises(a2a.InvalidArgumentError, match="y_rows must be one of"):
        a2a.esmm(x, w, index, y_rows="tokens")
    with pytest.raises(a2a.InvalidArgumentError, match="index must be an a2a.ESIndex"):
        a2a.esmm(x, w, object())
    with pytest.raises(a2a.InvalidArgumentError, match="not where the index is"):
        a2a.ess(np.zeros((2, 4), np.float32), index)
    with pytest.raises(a2a.InvalidArgumentError, match="non-contiguous|contiguous"):
        a2a.esmm(torch.zeros(4, 2).t(), w, index)
    with pytest.raises(a2a.InvalidArgumentError, match=r"estmm: b must be of float32"):
        a2a.estmm(torch.zeros(4, 3), x.double(), index)
    with pytest.raises(TypeError, match="made by a2a.es_index"):
        a2a.ESIndex()
