"""A cluster of N nodes on this machine: each node a network namespace (and,
for its processes, a UTS namespace with a hostname of its own), joined by
veth pairs to a Linux bridge in a namespace of its own. Open MPI then uses
TCP between nodes and shared memory within each, as on a real cluster.

    python -m a2a.cluster up 4 [--rate 10gbit]      # nodes a2a-n0 .. a2a-n3
    python -m a2a.cluster run --nodes 2 --ranks-per-node 2 -- python -m pytest tests/mpi
    python -m a2a.cluster link 1 down               # a fault: node 1's link down (up, rate R, kill)
    python -m a2a.cluster run --ft --nodes 2 ...    # with Open MPI's fault tolerance (ULFM)
    python -m a2a.cluster status
    python -m a2a.cluster down                      # idempotent

(``tools/cluster.py`` is the same command.) The pieces, one job each:

- :mod:`.nodes`: the namespaces, links and their rates (``up``, ``down``, ``status``);
- :mod:`.launch`: an MPI job across the nodes (``run``: the agent Open MPI's launcher uses, the mpirun line);
- :mod:`.faults`: what a network can do to a job (a link down or slowed, a node's processes killed).

Layout (nothing outside these namespaces changes)::

    namespace NAME-br:   bridge br0, ports p0 .. p(N-1)
    namespace NAME-nI:   lo, eth0 = 10.213.0.(I+1)/24 (veth to pI), hostname NAME-nI for its processes

NAME is ``A2A_CLUSTER_NAME`` (default ``a2a``): clusters of other names
live beside it (each has its own bridge, so they share the subnet without
meeting). It needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN) and says so at once
without it.
"""

from __future__ import annotations

from .faults import kill_node, set_link, set_rate
from .launch import mpirun_command, run
from .nodes import Cluster, current, down, parse_rate, up

__all__ = ["Cluster", "current", "down", "kill_node", "mpirun_command", "parse_rate", "run", "set_link",
           "set_rate", "up"]
