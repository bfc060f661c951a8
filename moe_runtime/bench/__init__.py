"""The benchmarks of moe_runtime, apart from the library: nothing in
moe_runtime imports them.

``python -m moe_runtime.bench`` (:mod:`moe_runtime.bench.__main__`) picks a
mode: the layer's step time against every static configuration, the
dictionary, the expert compute and a GShard-style peer (layer.py, with the
peer in peer.py and the dynamic rows in dynamic.py), or ``--flex``,
``--hetero``, ``--flows`` (flex.py, hetero.py, flows.py). Three run on their
own: ``python -m moe_runtime.bench.cache`` (expert buffering's policies),
``.placement`` (expert placement) and ``.assignment`` (sample-assignment
caching). rank.py holds what the modes share on every rank (the run's
communicator and the slowest rank's time); step_memory.py the peak memory of
a step.
"""
