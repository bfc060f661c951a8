"""What an MoELayer's flows hold, by the attribute names of earlier releases
(None where the layer's flow has none): a mixin of MoELayer."""

from __future__ import annotations

__all__ = ["FlowStateNames"]


class FlowStateNames:
    """``layer.parallel``, ``valid_rs``, ``flex``, ``capacity_tracker``, ``shared_cache``, ``expert_cache``,
    ``assignment_cache`` and ``assignment_stats``, read from ``layer.flow`` and ``layer._flows``."""

    parallel = property(lambda self: self.flow.name if self.flow.name in ("data_centric", "model_centric")
                        else "expert", doc="Hexa-MoE's flow when the experts are sharded along H, else 'expert'.")
    valid_rs = property(lambda self: list(getattr(self.flow, "valid_rs", [])), doc="The expert flow's valid r.")
    flex = property(lambda self: getattr(self.flow, "state", None), doc="FlexMoE's state (flex.state.FlexState).")
    capacity_tracker = property(lambda self: getattr(self.flow, "tracker", None), doc="flow='dynamic''s state.")
    shared_cache = property(lambda self: getattr(self._flows.get("data_centric"), "cache", None))
    expert_cache = property(lambda self: getattr(self.flow, "expert_cache", None))
    assignment_cache = property(lambda self: getattr(self.flow, "assignment_cache", None))
    assignment_stats = property(lambda self: getattr(self.flow, "assignment_stats", None),
                                doc="The last call's sample-assignment caching (None without sample_ids).")
