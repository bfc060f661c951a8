"""What every package of the runtime uses, and nothing of MoE in it.

- host_values.py: small host arrays agreed across ranks (all-gather,
  all-reduce), on the device the communicator needs;
- buffers.py: the pool of the big per-call buffers, reused step to step;
- overlap.py: the communication thread (CPU) or side stream (CUDA) that
  overlaps exchanges with compute, and the MPI thread-level check it needs;
- initialization.py: the uniform initializers of Tutel's parameters;
- agreement.py: what every rank must construct and call alike, checked in one
  small all-gather (the construction's fields; a call's tokens);
- precision.py: the dtypes of a call (autocast's for the tokens, the gate's
  own for the routing, the input's for the output), as Tutel's layer has them.
"""
