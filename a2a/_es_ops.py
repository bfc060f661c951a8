"""Hexa-MoE's expert-specific operators: the experts' matmuls on tokens that
stay in their order (no dispatched buffer, no capacity, no padding rows).

``es_index`` builds the re-index vector of a routing once; ``esmm`` (the
experts' matmul), ``ess`` (per-expert sum: the bias gradient) and ``estmm``
(per-expert transposed matmul: the weight gradient) read every expert's
tokens through it. An operand's rows are by token (row t of (T, D)) or by
choice (row t * k + j of (T * k, D), e.g. the hidden activations of top-k).
docs/moe_kernels.md shows the layouts.

Inputs are C-contiguous NumPy arrays, torch tensors or CuPy arrays on the
index's device (as for ``a2a.permute``); a non-contiguous one is an error.
With torch tensors that require grad the ops record autograd (a2a.torch).
"""

from __future__ import annotations

from typing import Any

from ._arrays import records_autograd
from ._errors import InvalidArgumentError
from ._es_kernels import ESIndex, es_index, esmm_raw, ess_raw, estmm_raw, require_index

__all__ = ["ESIndex", "es_index", "esmm", "ess", "estmm"]


def esmm(x: Any, w: Any, index: ESIndex, *, bias: Any = None, gates: Any = None, x_rows: str = "token",
         y_rows: str = "choice", w_layout: str = "nk", out: Any = None) -> Any:
    """ESMM: for every routed choice c = t * k + j of expert e,
    ``r_c = gate_c * (w[e] x[row(c)] + bias[e])``.

    x: (T, K) by token or (T * k, K) by choice (``x_rows``); w: (E, N, K)
    (``w_layout="nk"``, nn.Linear's weight: y = w[e] @ x) or (E, K, N)
    (``"kn"``: y = x @ w[e]); bias (E, N); gates (T, k) float32 or x's dtype.
    ``y_rows="choice"``: (T * k, N), row c = r_c, zeros for unrouted
    choices. ``y_rows="token"``: (T, N), row t = sum over j of r_{t k + j}
    in float32 (float64 for float64). Differentiable in x, w, bias and gates."""
    op = "esmm"
    index = require_index(index, op)
    if records_autograd(x, w, bias, gates):
        if out is not None:
            raise InvalidArgumentError(f"{op}: out= cannot be used while recording autograd (inputs require grad)")
        from .torch import esmm as differentiable

        return differentiable(x, w, index, bias=bias, gates=gates, x_rows=x_rows, y_rows=y_rows, w_layout=w_layout)
    return esmm_raw(x, w, index, bias, gates, x_rows, y_rows, w_layout, op, out)


def ess(x: Any, index: ESIndex, *, gates: Any = None, rows: str = "token") -> Any:
    """ESS: (E, N), row e = sum over expert e's choices c (in slot order) of
    ``gate_c * x[row(c)]``; x (T, N) by token or (T * k, N) by choice."""
    op = "ess"
    index = require_index(index, op)
    if records_autograd(x, gates):
        from .torch import ess as differentiable

        return differentiable(x, index, gates=gates, rows=rows)
    return ess_raw(x, index, gates, rows, op)


def estmm(a: Any, b: Any, index: ESIndex, *, gates: Any = None, a_rows: str = "choice",
          b_rows: str = "token") -> Any:
    """ESTMM: (E, A, B), out[e] = sum over expert e's choices c (in slot
    order) of ``gate_c * outer(a[row_a(c)], b[row_b(c)])``: the weight
    gradient of an expert matmul."""
    op = "estmm"
    index = require_index(index, op)
    if records_autograd(a, b, gates):
        from .torch import estmm as differentiable

        return differentiable(a, b, index, gates=gates, a_rows=a_rows, b_rows=b_rows)
    return estmm_raw(a, b, index, gates, a_rows, b_rows, op)

