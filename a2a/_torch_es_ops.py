"""torch.autograd of the expert-specific operators (a2a._es_kernels).

Every backward is made of the same three operators (Hexa-MoE, Figure 2):
for r_c = g_c (w[e] x_c + b[e]) with upstream gradient dy,

- dx: an ESMM of dy with the transposed weights (the gates applied again);
- dw: an ESTMM of dy and x (gated); db: an ESS of dy (gated);
- dg_c = <dy_c, w[e] x_c + b[e]> = <w[e]^T dy_c, x_c> + <dy_c, b[e]>: the
  ungated transposed ESMM, a row-wise dot product, and (dy b^T) picked at
  (row, e): no recomputation of the forward.
"""

from __future__ import annotations

from typing import Any

import torch

from ._es_kernels import ESIndex, esmm_raw, ess_raw, estmm_raw, require_index

__all__ = ["esmm", "ess", "estmm"]

_FLIP = {"nk": "kn", "kn": "nk"}


def _acc(t: torch.Tensor) -> torch.dtype:
    """The accumulation dtype of the data: float64 for float64, else float32."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _choice_rows(t: torch.Tensor, rows: str, index: ESIndex) -> torch.Tensor:
    """An operand as (T * k, D) rows by choice (token rows repeated k times)."""
    return t if rows == "choice" else t.repeat_interleave(index.top_k, dim=0)


def _experts(index: ESIndex, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert of each choice clamped to >= 0, routed mask), both (T * k,)."""
    e = index._indices.obj.to(device=device, dtype=torch.long).reshape(-1)
    return e.clamp(min=0), e >= 0


def _row_dot(a: torch.Tensor, b: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    return (a.to(acc) * b.to(acc)).sum(-1)


class _Esmm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, bias, gates, index, x_rows, y_rows, w_layout):
        ctx.save_for_backward(x, w, bias, gates)
        ctx.args = (index, x_rows, y_rows, w_layout)
        return esmm_raw(x, w, index, bias, gates, x_rows, y_rows, w_layout)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        x, w, bias, gates = ctx.saved_tensors
        index, x_rows, y_rows, w_layout = ctx.args
        need_x, need_w, need_b, need_g = ctx.needs_input_grad[:4]
        dy = dy.contiguous()
        op = "esmm (backward)"
        flip = _FLIP[w_layout]
        dx = dw = db = dg = None
        if need_g and gates is not None:
            acc = _acc(x)
            v = esmm_raw(dy, w, index, None, None, y_rows, "choice", flip, op)  # w[e]^T dy per choice
            dg = _row_dot(v, _choice_rows(x, x_rows, index), acc)
            experts, routed = _experts(index, dy.device)
            if bias is not None:
                rows = torch.arange(index.rows("choice"), device=dy.device)
                if y_rows == "token":
                    rows = rows // index.top_k
                dg = dg + (dy.to(acc) @ bias.to(acc).t())[rows, experts] * routed
            dg = dg.view(index.num_tokens, index.top_k).to(gates.dtype)
            if need_x and x_rows == "choice":
                dx = (v.to(acc) * gates.reshape(-1, 1).to(acc)).to(x.dtype)
        if need_x and dx is None:
            dx = esmm_raw(dy, w, index, None, gates, y_rows, x_rows, flip, op)
        if need_w:
            if w_layout == "nk":  # w[e] (N, K): sum_c g_c dy_c x_c^T
                dw = estmm_raw(dy, x, index, gates, y_rows, x_rows, op)
            else:  # w[e] (K, N): sum_c g_c x_c dy_c^T
                dw = estmm_raw(x, dy, index, gates, x_rows, y_rows, op)
        if need_b and bias is not None:
            db = ess_raw(dy, index, gates, y_rows, op)
        return dx, dw, db, dg, None, None, None, None


class _Ess(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gates, index, rows):
        ctx.save_for_backward(x, gates)
        ctx.args = (index, rows)
        return ess_raw(x, index, gates, rows)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        x, gates = ctx.saved_tensors
        index, rows = ctx.args
        acc = _acc(x)
        experts, routed = _experts(index, dout.device)
        picked = dout.to(acc)[experts] * routed.unsqueeze(1)  # dout[e_c] per choice, 0 when not routed
        dx = dg = None
        if ctx.needs_input_grad[0]:
            scaled = picked if gates is None else picked * gates.reshape(-1, 1).to(acc)
            if rows == "token":
                scaled = scaled.view(index.num_tokens, index.top_k, -1).sum(1)
            dx = scaled.to(x.dtype)
        if gates is not None and ctx.needs_input_grad[1]:
            dg = _row_dot(picked, _choice_rows(x, rows, index), acc).view_as(gates).to(gates.dtype)
        return dx, dg, None, None


class _Estmm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, gates, index, a_rows, b_rows):
        ctx.save_for_backward(a, b, gates)
        ctx.args = (index, a_rows, b_rows)
        return estmm_raw(a, b, index, gates, a_rows, b_rows)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        a, b, gates = ctx.saved_tensors
        index, a_rows, b_rows = ctx.args
        dout = dout.contiguous()
        op = "estmm (backward)"
        da = db = dg = None
        if ctx.needs_input_grad[0]:  # da_c = g_c dout[e] b_c
            da = esmm_raw(b, dout, index, None, gates, b_rows, a_rows, "nk", op)
        if ctx.needs_input_grad[1]:  # db_c = g_c dout[e]^T a_c
            db = esmm_raw(a, dout, index, None, gates, a_rows, b_rows, "kn", op)
        if gates is not None and ctx.needs_input_grad[2]:  # dg_c = <a_c, dout[e] b_c>
            u = esmm_raw(b, dout, index, None, None, b_rows, "choice", "nk", op)
            dg = _row_dot(u, _choice_rows(a, a_rows, index), _acc(a)).view_as(gates).to(gates.dtype)
        return da, db, dg, None, None, None


def esmm(x: torch.Tensor, w: torch.Tensor, index: ESIndex, *, bias: torch.Tensor | None = None,
         gates: torch.Tensor | None = None, x_rows: str = "token", y_rows: str = "choice",
         w_layout: str = "nk") -> torch.Tensor:
    """a2a.esmm with autograd in x, w, bias and gates."""
    return _Esmm.apply(x, w, bias, gates, require_index(index, "esmm"), x_rows, y_rows, w_layout)


def ess(x: torch.Tensor, index: ESIndex, *, gates: torch.Tensor | None = None, rows: str = "token") -> torch.Tensor:
    """a2a.ess with autograd in x and gates."""
    return _Ess.apply(x, gates, require_index(index, "ess"), rows)


def estmm(a: torch.Tensor, b: torch.Tensor, index: ESIndex, *, gates: torch.Tensor | None = None,
          a_rows: str = "choice", b_rows: str = "token") -> Any:
    """a2a.estmm with autograd in a, b and gates."""
    return _Estmm.apply(a, b, gates, require_index(index, "estmm"), a_rows, b_rows)
