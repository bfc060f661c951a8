"""The sizes of the kernel benchmark (pure; unit tested): the capacity
a2a.route must pick, the bytes an op reads and writes, the cost of GShard's
einsum, and the memory an op needs at its peak."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

__all__ = ["DTYPE_SIZES", "GATE_SIZE", "OpSize", "capacity_for", "einsum_macs", "moved_bytes"]

DTYPE_SIZES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}
GATE_SIZE = 4  # float32 gates


def capacity_for(tokens: int, experts: int, top_k: int, factor: float, max_count: int) -> int:
    """The capacity a2a.route must pick (docs/moe_kernels.md, Tutel's rule):
    factor > 0: ceil(k*factor*T/E); 0: the largest per-expert count; < 0: that,
    but at most ceil(k*(-factor)*T/E)."""
    if factor > 0:
        return max(1, math.ceil(top_k * factor * tokens / experts))
    if factor == 0:
        return max(1, max_count)
    return max(1, min(max_count, math.ceil(top_k * -factor * tokens / experts)))


def moved_bytes(
    op: str,
    *,
    tokens: int,
    experts: int,
    top_k: int,
    model_dim: int,
    itemsize: int,
    capacity: int | None,
    kept: int,
    routed: int,
    gates: bool = True,
) -> int:
    """Bytes the kernel reads plus writes (data rows and gates, not the routing tables)."""
    row = model_dim * itemsize
    gate_bytes = tokens * top_k * GATE_SIZE if gates else 0
    if op == "encode":
        assert capacity is not None
        return kept * row + experts * capacity * row + gate_bytes
    if op == "decode":
        return kept * row + tokens * row + gate_bytes
    if op == "permute":
        return 2 * routed * row
    if op == "unpermute":
        return routed * row + tokens * row + gate_bytes
    raise ValueError(f"unknown op {op!r}")


def einsum_macs(tokens: int, experts: int, capacity: int, model_dim: int) -> int:
    """Multiply-adds of GShard's dense dispatch or combine einsum."""
    return tokens * experts * capacity * model_dim


@dataclass(frozen=True)
class OpSize:
    """The sizes one op of one configuration works on (moved_bytes' arguments)."""

    op: str
    tokens: int
    experts: int
    top_k: int
    model_dim: int
    itemsize: int
    capacity: int | None  # None for the dropless permute / unpermute
    kept: int  # choices that fit their expert's capacity (every routed one when dropless)
    routed: int

    def moved_bytes(self, gates: bool) -> int:
        return moved_bytes(**dataclasses.asdict(self), gates=gates)

    def footprint_bytes(self, nbytes: int) -> int:
        """Estimated peak bytes of the op, without the einsum: x, the op's
        input (decode: the (E, C, M) buffer, unpermute: the (N, M) rows), the
        memcpy buffers (nbytes), a2a's and the index baseline's outputs, and the
        baseline's temporaries (gathered rows, their product with the gates in
        float32, the float32 sum)."""
        acc = 8 if self.itemsize == 8 else 4
        s, m, tokens, routed = self.itemsize, self.model_dim, self.tokens, self.routed
        wide = acc if s != acc else 0  # a copy in the accumulator type, for 16-bit data
        x = tokens * m * s
        if self.op == "encode":
            out = self.experts * (self.capacity or 0) * m * s
            temps = self.kept * m * (s + wide)
            return x + nbytes + 2 * out + temps
        if self.op == "decode":
            d = self.experts * (self.capacity or 0) * m * s
            out = tokens * m * s
            temps = self.kept * m * (s + wide) + tokens * m * wide
            return x + d + nbytes + 2 * out + temps
        if self.op == "permute":
            out = routed * m * s
            return x + nbytes + 2 * out + routed * 32
        if self.op == "unpermute":
            y_sorted = routed * m * s
            out = tokens * m * s
            temps = routed * m * acc + tokens * m * wide
            return x + y_sorted + nbytes + 2 * out + temps
        raise ValueError(f"unknown op {self.op!r}")

    def einsum_footprint_bytes(self) -> int:
        """The dense mask (and a transposed copy einsum may make) plus its output."""
        capacity = self.capacity or 0  # the einsum runs for the padded ops only
        mask = self.tokens * self.experts * capacity * self.itemsize
        out = (self.experts * capacity if self.op == "encode" else self.tokens) * self.model_dim * self.itemsize
        return 2 * mask + 2 * out
