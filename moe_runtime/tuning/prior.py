"""The dictionary's prior: the exchange time of one training step of the
layer at a configuration, predicted by the scale model (:mod:`a2a.sim`).

For r >= 1 a step exchanges, in each of its d chunks, the chunk's rows to
the experts and back, forward and again backward (flows.py)::

    to the experts    all_to_all_flex((X, Cd/g, M), split_axis=0, concat_axis=1)
    back              all_to_all_flex((n_l, W Cd/g, M), split_axis=1, concat_axis=0)
    step              d * 2 * (to + back)

with X = E r g blocks, g = s / r, Cd = C_b / d rows per chunk and C_b the
capacity rounded up to a multiple of d g (capacity.buffer_capacity): the
same bytes per step at every d, in messages d times smaller. Each exchange
is predicted on the path the library takes for it (contiguous, pieces,
datatypes or packed: :func:`a2a.sim.flex_path`), with its argument check.

r = 0 exchanges nothing; its weight all-gather and gradient reduce-scatter
are not predicted, so the prior has no opinion of it (None): r = 0 is one
trial and is never pruned. The dictionary compares predictions only among
the (d, algorithm) of one r (tuner.py says why).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from a2a import sim

from ..gating.capacity import buffer_capacity
from .dictionary import Config

__all__ = ["ExchangePrior"]

ITEMSIZES = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2}


class ExchangePrior:
    """``prior(signature, capacity, config)``: predicted seconds of the
    exchanges of one step (forward and backward), or None for r = 0.

    Args:
        topology: an :class:`a2a.sim.Topology` or a preset name (``"local"``,
            ``"cluster"``, ``"cluster-1g"``, ``"a100"`` ...: ``a2a.sim.PRESETS``);
            it is reshaped to the signature's world size and ranks per node.

    The signature is the layer's (``MoELayer`` binds the dictionary with
    world, local_size, num_nodes, experts, model_dim, dtype, ...).
    """

    def __init__(self, topology: sim.Topology | str = "local"):
        self.topology = sim.preset(topology) if isinstance(topology, str) else topology
        if not isinstance(self.topology, sim.Topology):
            raise TypeError(f"topology must be an a2a.sim.Topology or a preset name, got {type(topology).__name__}")

    def __call__(self, signature: Mapping[str, Any], capacity: int, config: Config) -> float | None:
        if config.r == 0:
            return None
        world, experts, model_dim = (int(signature[k]) for k in ("world", "experts", "model_dim"))
        dtype = str(signature["dtype"])
        if dtype not in ITEMSIZES:
            raise ValueError(f"ExchangePrior: unknown dtype {dtype!r}; known: {', '.join(ITEMSIZES)}")
        itemsize = ITEMSIZES[dtype]
        sharers = world // experts if experts < world else 1
        local_experts = experts // world if sharers == 1 else 1
        group = sharers // config.r
        rows = buffer_capacity(max(capacity, 1), config.d * group)
        block_rows = rows // config.d // group  # Cd / g
        top = self.topology.with_ranks(world, int(signature["local_size"]))
        to_experts = sim.flex_layout((experts * config.r * group, block_rows, model_dim), 0, 1, itemsize, world)
        back = sim.flex_layout((local_experts, world * block_rows, model_dim), 1, 0, itemsize, world)
        one_chunk = (sim.predict_flex(top, config.algo, to_experts).time_s
                     + sim.predict_flex(top, config.algo, back).time_s)
        return config.d * 2 * one_chunk

    def __repr__(self) -> str:
        return f"ExchangePrior({self.topology.name})"
