"""The Deployment paper's mechanisms (dynamic gating, expert buffering,
placement) and sample-assignment caching.

- flow.py: the dropless flow and its settings, Dropless(expert_cache=,
  assignment_cache=);
- dropless.py: the dropless exchange (permute, all_to_all_v, ragged FFN);
- expert_cache.py, cache_policy.py: expert buffering for inference;
- assignment_cache.py, cached_dispatch.py: the predicted dispatch;
- placement.py: placement policies and metrics; positions.py: the layer's
  position table and MoELayer.place.
"""
