"""``python -m a2a.bench``: picks the benchmark family from the command line
(``--layout``, ``--op`` (the MoE kernels, or the expert-specific
operators esmm / ess / estmm), else the collectives sweep) and runs it."""

from __future__ import annotations

import sys

from . import collectives, es_ops, kernels, layout


def main(argv: list[str] | None = None) -> int:
    """Runs the family that argv asks for (default: sys.argv) and returns its exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if layout.is_layout_mode(argv):  # the layout kernels, in this process
        return layout.main(argv)
    if es_ops.is_es_mode(argv):  # the expert-specific operators, in this process
        return es_ops.main(argv)
    if kernels.is_kernel_mode(argv):  # the MoE kernels, in this process
        return kernels.main(argv)
    return collectives.main(argv)


if __name__ == "__main__":
    sys.exit(main())
