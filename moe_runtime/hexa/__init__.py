"""Hexa-MoE: experts sharded along H, run by the expert-specific operators.

- flow.py: the data- and model-centric flows and their settings
  (DataCentric, ModelCentric);
- centric.py: the two computations (token-ordered, nothing dropped);
- experts.py: HiddenShardedExperts; cache.py: the pipeline-shared cache;
- split.py: the heterogeneous split (Section 3.4) by measured latency.
"""
