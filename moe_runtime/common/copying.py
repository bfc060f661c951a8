"""``copy.deepcopy`` of an MoELayer (an EMA of the model, a teacher, a
second instance): a mixin of MoELayer.

The copy has the layer's parameters, buffers, settings and what its flows
learned (placement, FlexMoE's slots, the dictionary's entries, dynamic
capacities), copied. It shares the layer's communicator (a2a.Comm copies as
itself: a handle, as torch modules share their process group). What belongs
to calls made is not copied: the last ``l_aux`` and ``last_plan`` (None in
the copy), the pooled buffers, captured CUDA graphs, the exchange thread, a
dictionary search still running (it starts again at its key's next step).
Like constructing one, a copy that runs collectives must be made on every
rank."""

from __future__ import annotations

import copy
from typing import Any

__all__ = ["LayerCopy"]

PER_CALL = ("l_aux", "last_plan")  # the last call's: the copy has made none


class LayerCopy:
    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        copied = type(self).__new__(type(self))
        memo[id(self)] = copied
        for name, value in self.__dict__.items():
            copied.__dict__[name] = None if name in PER_CALL else copy.deepcopy(value, memo)
        return copied
