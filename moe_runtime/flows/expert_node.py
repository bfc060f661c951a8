"""The expert flow from tokens to outputs as one autograd node.

    forward   tokens (T, M) --fast_encode (x gates, prescore)--> dispatched (E', C', M)
                  (FP8 dispatch: quantized, encoded as packed FP8 rows)
              --Segment.forward (exchange, experts, exchange)--> combined (E', C', M)
              --fast_decode (x gates, postscore)--> y (T, M)

    backward  dy --fast_encode (x gates, postscore)--> d combined       (the pooled grad_combine buffer)
              d gates = gate_grad(dy, combined)                            (postscore)
              --Segment.backward--> d dispatched, the experts' weight gradients
              --fast_decode (x gates, prescore)--> d tokens
              d gates = gate_grad(tokens, d dispatched)                    (prescore)

E' = d E (chunk-major, flows/expert.py), C' = the chunk's rows. Encode and
decode were nodes of their own (a2a.torch's), beside the segment's: each
Python node costs a step about 20 us of host work on the CPU (its forward
wrapper and the engine's call back into Python), and more beside a GPU. The
math and the kernels are the same: a2a's encode and decode are each other's
data adjoint with the same gates, and ``a2a.gate_grad`` is their gates'
gradient. An FP8 pair moves the tokens unscaled; the gates apply at the
decode (registry.check_dispatch_dtype), and the quantization passes the
gradient straight through.

Every rank runs the segment's backward, its exchanges included, whether or
not its tokens need a gradient: the collectives stay matched across ranks.
Where the segment exchanges nothing (one rank, r = 0) and only the gates
need a gradient (a router trained alone), it does not run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import a2a

from ..common.precision import FP8_BLOCK
from .segment import Segment

__all__ = ["ExpertNode", "run_expert_node"]


@dataclass(frozen=True)
class ExpertNode:
    """What the node runs besides its tensors."""

    segment: Segment
    layout: a2a.Routing  # the chunk-major routing of the dispatch buffer
    postscore: bool  # the gates apply at the decode (else at the encode)

    @property
    def rows_shape(self) -> tuple[int, int, int]:
        """(E', C', M): the dispatch and combine buffers, as fast_encode and fast_decode take them."""
        layout = self.layout
        return (layout.num_experts, layout.capacity, self.segment.shape.model_dim)


def run_expert_node(node: ExpertNode, tokens: torch.Tensor, gates: torch.Tensor, fc1: torch.Tensor,
                    fc1_bias: torch.Tensor | None, fc2: torch.Tensor, fc2_bias: torch.Tensor | None) -> torch.Tensor:
    """y (T, M) of `tokens` (autograd when anything requires grad). Under
    autocast the tokens come in its dtype and the weights stay in theirs:
    they are cast to the tokens' dtype, as autocast casts a matmul's operands."""
    dtype = tokens.dtype
    weights = (fc1, fc1_bias, fc2, fc2_bias)
    if any(w is not None and w.dtype != dtype for w in weights):  # (a cast to the same dtype is an op too)
        fc1, fc1_bias, fc2, fc2_bias = (None if w is None else w.to(dtype) for w in weights)
    return _ExpertFunction.apply(tokens, gates, fc1, fc1_bias, fc2, fc2_bias, node)


class _ExpertFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tokens, gates, fc1, fc1_bias, fc2, fc2_bias, node: ExpertNode):
        segment, layout = node.segment, node.layout
        if segment.fp8 is not None:
            pair = a2a.quantize_fp8(tokens, FP8_BLOCK, format=segment.fp8)
            dispatched = a2a.pack_fp8(*a2a.fast_encode(pair, layout))
        else:
            buffer = segment.lease.get("dispatch", node.rows_shape, tokens.dtype, tokens.device)
            dispatched = a2a.fast_encode(tokens, layout, None if node.postscore else gates, out=buffer)
        combined = segment.forward(dispatched, fc1, fc1_bias, fc2, fc2_bias)
        ctx.node, ctx.with_fc2_bias = node, fc2_bias is not None
        # The gates' gradient reads the tokens (prescore) or the combined rows (postscore, a pooled buffer).
        ctx.save_for_backward(combined if node.postscore else tokens, gates, fc1, fc1_bias, fc2)
        return a2a.fast_decode(combined, layout, gates if node.postscore else None)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_y):
        read_by_gates, gates, fc1, fc1_bias, fc2 = ctx.saved_tensors
        node = ctx.node
        segment, layout, postscore = node.segment, node.layout, node.postscore
        grad_y = grad_y.contiguous()  # autograd may hand in an expanded gradient (of y.sum())
        wants_tokens, wants_gates = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        gate_dtype = str(gates.dtype).removeprefix("torch.")
        grad_gates = None
        if postscore and wants_gates:
            grad_gates = a2a.gate_grad(grad_y, read_by_gates, layout, dtype=gate_dtype)
            if not (wants_tokens or any(ctx.needs_input_grad[2:6])) and not segment.shape.exchanged:
                # Only the router learns (the experts frozen, the tokens a leaf): the segment's backward
                # would make nothing used. Where it exchanges, every rank runs it all the same: whether a
                # rank's tokens need a gradient is that rank's own, and its peers wait for its exchanges.
                return (None, grad_gates, None, None, None, None, None)
        grad_combined = segment.lease.get("grad_combine", node.rows_shape, grad_y.dtype, grad_y.device)
        a2a.fast_encode(grad_y, layout, gates if postscore else None, out=grad_combined)
        # (E', C', M), as grad_combined
        grad_rows, *weight_grads = segment.backward(grad_combined, fc1, fc1_bias, fc2, ctx.with_fc2_bias)
        grad_tokens = None
        if wants_tokens:
            grad_tokens = a2a.fast_decode(grad_rows, layout, None if postscore else gates)
        if not postscore and wants_gates:
            grad_gates = a2a.gate_grad(read_by_gates, grad_rows, layout, dtype=gate_dtype)
        return (grad_tokens, grad_gates, *weight_grads, None)
