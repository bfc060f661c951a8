"""Dynamic capacity: one capacity per expert, picked each call by a policy.

- flow.py: the flow (flow="dynamic" or DynamicCapacity(...));
- capacity.py: the policy's settings (DynamicCapacity) and state (CapacityTracker);
- ragged.py: the flow's exchange with per-expert capacities.
"""
