"""The experts' parameters and what computes with them, for every flow.

- ffn.py: FFNExperts, Tutel's layout (n whole experts per rank, or one expert
  shared by s ranks along H; the gathered weights of every r);
- activation.py, ragged_ffn.py: the FFN on ragged rows (the dropless flows); grouped.py: the same as
  grouped GEMMs (torch._grouped_mm) where torch runs them;
- gradients.py: sync_shared_gradients, the all-reduce of what every rank holds;
- replicas.py: what more than one rank holds whole, made rank 0's at construction;
- relocation.py: moving experts (with gradients and optimizer state) between
  ranks, for placement and FlexMoE;
- split.py: parts of a total that sum to it exactly (even, or by speed).
"""
