"""FlexMoE: vExpert replicas of hot experts, scheduled from measured steps.

- flow.py: the flow (flow=FlexConfig(...)) and its slot layout;
- config.py: FlexConfig; vexperts.py: the slot table and its primitives
  (Expand, Shrink, Migrate);
- routing.py: Algorithm 3 (locality first); dispatch.py: the exchange to its plan;
- cost.py, scheduler.py: Equation 5's cost model and Algorithms 1-2;
- state.py: the layer's FlexMoE state (history, scheduler, adjust, rebalance).
"""
