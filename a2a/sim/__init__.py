"""``a2a.sim``: a scale model of a2a's all-to-all algorithms.

An alpha-beta model of linear and 2DH all-to-all (and of the flexible and
uneven forms) over a topology of nodes x ranks per node, phase by phase as
``csrc/core/algorithms.cpp`` runs them; presets for Tutel's A100 testbed, an
H100 cluster and this repository's CPU host; a least-squares fit to
``python -m a2a.bench --json`` rows. Pure Python and NumPy: nothing here
communicates or needs the native library's collectives.

    from a2a import sim
    top = sim.preset("a100", ranks=2048)
    p = sim.predict(top, "2dh", 256 << 20)      # Prediction(time_s, phases, ...)
    p.time_s, p.phase_times()                   # {"check": ..., "copy1": ..., "intra": ..., ...}

    python -m a2a.sim predict --preset a100 --ranks 64,256,2048,4096 --sizes 1M,32M,256M
    python -m a2a.sim fit bench.json --preset local

docs/scaling.md has the formulas, the presets' sources, the fit and the
reproduction of Tutel's Figure 18.
"""

from __future__ import annotations

from .fitting import (
    FitResult,
    FitRow,
    Measurement,
    fit,
    load_measurements,
    predict_measurement,
    ratio_rows,
    size_crossovers,
)
from .model import (
    ALGOS,
    FORMS,
    FlexLayout,
    Phase,
    Prediction,
    Topology,
    crossover,
    flex_layout,
    flex_path,
    power_of_two_ranks,
    predict,
    predict_flex,
    predict_v,
)
from .presets import FIT_OUTLIER_SCALE, FIT_PARAMETERS, PRESETS, preset
from .topology import FITTABLE

__all__ = [
    "ALGOS",
    "FITTABLE",
    "FIT_OUTLIER_SCALE",
    "FIT_PARAMETERS",
    "FORMS",
    "PRESETS",
    "FitResult",
    "FitRow",
    "FlexLayout",
    "Measurement",
    "Phase",
    "Prediction",
    "Topology",
    "crossover",
    "fit",
    "flex_layout",
    "flex_path",
    "load_measurements",
    "power_of_two_ranks",
    "predict",
    "predict_flex",
    "predict_measurement",
    "predict_v",
    "preset",
    "ratio_rows",
    "size_crossovers",
]
