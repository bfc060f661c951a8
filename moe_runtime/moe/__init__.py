"""Tutel's ``tutel.moe`` surface over moe_runtime: a Tutel program switches
by changing its imports::

    from tutel import moe as tutel_moe          # before
    from moe_runtime import moe as tutel_moe    # after
    from tutel import system, net               # before
    from moe_runtime.moe import system, net     # after (moe/system.py, moe/net.py)

``moe_layer`` is Tutel's layer (moe/layer.py: a thin adapter over
:class:`moe_runtime.MoELayer`, Tutel's keywords, defaults and checkpoints);
the low-level ops (moe/ops.py) keep Tutel's names and argument orders and
run a2a's kernels. docs/runtime.md has the table of Tutel's API beside ours.
"""

from __future__ import annotations

from .layer import TutelMoELayer, global_expert_count
from .ops import (
    CriticalData,
    FastDispatcher,
    extract_critical,
    fast_cumsum_sub_one,
    fast_decode,
    fast_dispatcher,
    fast_encode,
    top_k_routing,
)

moe_layer = TutelMoELayer

__all__ = ["CriticalData", "FastDispatcher", "extract_critical", "fast_cumsum_sub_one", "fast_decode",
           "fast_dispatcher", "fast_encode", "global_expert_count", "moe_layer", "top_k_routing"]
