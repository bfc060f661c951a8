"""``python -m moe_runtime.bench``: picks the mode from the command line
(``--flows``, ``--hetero``, ``--flex``, ``--fp8``, ``--overhead``; else the layer's step) and runs it.

    python -m moe_runtime.bench                       # 4 ranks (2 emulated nodes of 2), the default sizes
    python -m moe_runtime.bench --quick --np 2        # seconds: small sizes
    python -m moe_runtime.bench --tokens 1024 --factors 1,4 --json out.json --plot out.png
    mpirun -np 8 python -m moe_runtime.bench --experts 4 --hidden 2048
    python -m moe_runtime.bench --flex                # FlexMoE under skewed routing (flex.py)
    python -m moe_runtime.bench --hetero              # Hexa-MoE's heterogeneous split (hetero.py)
    python -m moe_runtime.bench --flows               # which flow wins as the workload grows (flows.py)
    python -m moe_runtime.bench --fp8                 # FP8 dispatch against the tokens' dtype (fp8.py)
    python -m moe_runtime.bench --overhead            # a step's host costs against Tutel and Megatron-Core (overhead.py)
    python -m moe_runtime.bench --gpu-step --json step.json   # the issue's comparison on one GPU (layer.py)
    python -m moe_runtime.bench --device cuda --np 4 --transport mpi   # 4 ranks sharing one GPU
"""

from __future__ import annotations

import argparse
import sys
from types import ModuleType

from . import flex, flows, fp8, hetero, layer, overhead

# A mode's flag, tried in this order, and its module; without one, the layer's step.
MODES = (("--flows", flows), ("--hetero", hetero), ("--flex", flex), ("--fp8", fp8), ("--overhead", overhead))


def mode(argv: list[str]) -> tuple[ModuleType, list[str]]:
    """The module that argv asks for, and argv without the mode's flag; each
    module has parse_args(argv) and main(argv)."""
    for flag, module in MODES:
        if flag in argv:
            return module, [arg for arg in argv if arg != flag]
    return layer, argv


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The arguments as the mode's own parser reads them, without running
    anything (exits 2 with the parser's message on bad arguments)."""
    module, rest = mode(argv)
    return module.parse_args(rest)


def main(argv: list[str] | None = None) -> int:
    """Runs the mode that argv asks for (default: sys.argv) and returns its exit status."""
    module, rest = mode(list(sys.argv[1:] if argv is None else argv))
    return module.main(rest)


if __name__ == "__main__":
    sys.exit(main())
