"""``python -m a2a.bench``: picks the benchmark family from the command line
(``--layout``, ``--op`` (the MoE kernels, the expert-specific operators
esmm / ess / estmm, quantize_fp8 / dequantize_fp8, or top_k_gate), ``--low-latency``,
``--gaps``, else the collectives sweep) and runs it."""

from __future__ import annotations

import argparse
import sys
from types import ModuleType

from . import collectives, es_ops, fp8, gaps, gate, kernels, layout, low_latency


def family(argv: list[str]) -> ModuleType:
    """The benchmark module that argv asks for; each has parse_args(argv) and main(argv)."""
    if layout.is_layout_mode(argv):  # the layout kernels, in this process
        return layout
    if low_latency.is_low_latency_mode(argv):  # the low-latency dispatch and combine, under mpirun
        return low_latency
    if gaps.is_gaps_mode(argv):  # the general path's known gaps against their targets, under mpirun
        return gaps
    if es_ops.is_es_mode(argv):  # the expert-specific operators, in this process
        return es_ops
    if fp8.is_fp8_mode(argv):  # the FP8 quantization, in this process
        return fp8
    if gate.is_gate_mode(argv):  # the fused top-k gate, in this process
        return gate
    if kernels.is_kernel_mode(argv):  # the MoE kernels, in this process
        return kernels
    return collectives


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The arguments as the family's own parser reads them, without running
    anything (exits 2 with the parser's message on bad arguments)."""
    return family(argv).parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Runs the family that argv asks for (default: sys.argv) and returns its exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    return family(argv).main(argv)


if __name__ == "__main__":
    sys.exit(main())
