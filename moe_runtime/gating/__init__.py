"""The gate: scores, top-k choices and gates, the auxiliary losses, and
Tutel's capacity rules (what a capacity factor means in rows per expert).

- gates.py: LinearTopKGate, CosineTopKGate, ``decide`` (one call's GateDecision);
- topk.py: softmax, top-k, gates and GShard's loss as one autograd node (``decide``'s);
- losses.py: GShard's, load-importance, z-loss;
- capacity.py: this rank's capacity for a factor (the layer agrees the max).
"""
