"""The Flow interface and Tutel's flow: what runs the experts on routed tokens.

- base.py: Flow, its Plan, Request, Choice, Context and Call (read first), and
  WholeExpertFlow, what the r = 1, d = 1 flows share;
- agreement.py: the per-call agreement every flow relies on (one all-gather);
- kept.py: that agreement kept, without the all-gather, while every rank's
  row repeats at f > 0 (the flow's first exchange checks it);
- expert.py: Tutel's capacity flow (r, d, algorithm): routing, then one
  autograd node (expert_node.py): encode, the pipelined exchange -> experts
  -> exchange segment (segment.py), decode.

The other flows live in the paper packages above (deployment, dynamic, flex,
hexa); moe_runtime.registry names them all.
"""
