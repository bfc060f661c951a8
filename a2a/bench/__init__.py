"""a2a's benchmarks: ``python -m a2a.bench`` (see ``--help``).

The families, one module each, chosen by the command line
(:mod:`a2a.bench.__main__`), among them:

* :mod:`a2a.bench.collectives`: the nccl-tests ``alltoall_perf``-style sweep of
  the collectives against ``MPI_Alltoall`` (or a device-to-device copy), under
  mpirun (it relaunches itself there);
* :mod:`a2a.bench.kernels` (``--op``): the MoE kernels against a memcpy, torch
  index ops and GShard's dense einsum, in one process;
* :mod:`a2a.bench.layout` (``--layout``): the layout kernels against a copy of
  the same bytes, in one process;
* :mod:`a2a.bench.low_latency` (``--low-latency``): the low-latency dispatch
  and combine against the normal path and ``MPI_Alltoall``, under mpirun;
* :mod:`a2a.bench.gaps` (``--gaps``): the general path's known gaps (small
  messages, v, flex at M = 256) against their targets, under mpirun.

:mod:`a2a.bench.common` holds what they share: sizes, the clock, taking
turns, formatting and the JSON record. :mod:`a2a.nccl_format` reads output
in nccl-tests' format (nccl-tests itself, the C programs of
``nccl_tests_ext/``, and the collectives sweep) back into rows. The sweep
draws the scale model's predictions (:mod:`a2a.sim`, ``--predict``); the
model never imports the benchmarks: what both need (sizes, the uneven
counts) is in :mod:`a2a._sweep`.
"""
