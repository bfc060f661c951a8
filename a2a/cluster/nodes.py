"""The cluster's namespaces and links: bring them up (shaped or not), say
what is up, and take everything down (idempotent)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass

SUBNET = "10.213.0"
MAX_NODES = 64


@dataclass(frozen=True)
class Cluster:
    """The names of one cluster's pieces: ``A2A_CLUSTER_NAME`` (default ``a2a``) picks them."""

    name: str = "a2a"

    @classmethod
    def from_env(cls) -> Cluster:
        name = os.environ.get("A2A_CLUSTER_NAME", "a2a")
        if not name or not name.replace("-", "").isalnum() or len(name) > 8:
            raise ValueError(f"A2A_CLUSTER_NAME={name!r}: 1 to 8 letters, digits or '-'")
        return cls(name)

    @property
    def bridge_ns(self) -> str:
        return f"{self.name}-br"

    @property
    def state_dir(self) -> str:
        return os.environ.get("A2A_CLUSTER_STATE", f"/run/{self.name}-cluster")

    @property
    def agent(self) -> str:
        return os.path.join(self.state_dir, "agent.sh")

    @property
    def daemons_log(self) -> str:
        """Where the agent writes ``NODE STATUS`` as each node's MPI daemon ends."""
        return os.path.join(self.state_dir, "daemons.log")

    def node(self, index: int) -> str:
        return f"{self.name}-n{index}"

    def node_index(self, node: str | int) -> int:
        """A node given by index, name or address, as its index."""
        text = str(node)
        for prefix in (f"{self.name}-n", f"{SUBNET}."):
            if text.startswith(prefix) and text[len(prefix):].isdigit():
                return int(text[len(prefix):]) - (1 if prefix == f"{SUBNET}." else 0)
        if text.isdigit():
            return int(text)
        raise ValueError(f"cluster: no node {node!r} (a node is an index, {self.node(0)} or {address(0)})")


def current() -> Cluster:
    return Cluster.from_env()


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


def namespaces(cluster: Cluster) -> list[str]:
    listed = sh("ip", "netns", "list", check=False, quiet=True).stdout.split("\n")
    ours = [line.split()[0] for line in listed if line.strip()]
    return [ns for ns in ours if ns == cluster.bridge_ns or ns.startswith(f"{cluster.name}-n")
            and ns[len(cluster.name) + 2:].isdigit()]


def up_nodes(cluster: Cluster) -> int:
    """How many nodes are up (0 when there is no cluster)."""
    present = set(namespaces(cluster))
    if cluster.bridge_ns not in present:
        return 0
    count = 0
    while cluster.node(count) in present:
        count += 1
    return count


def write_state(cluster: Cluster, nodes: int, rate: str | None) -> None:
    os.makedirs(cluster.state_dir, exist_ok=True)
    with open(os.path.join(cluster.state_dir, "state.json"), "w") as out:
        json.dump({"nodes": nodes, "rate": rate, "subnet": SUBNET + ".0/24"}, out)
    write_agent(cluster, nodes)


def write_agent(cluster: Cluster, nodes: int) -> None:
    # Open MPI's ssh launcher calls: agent HOST COMMAND... ; HOST is a node's address. Like an ssh client,
    # the agent stays on the launching node (no exec): it outlives a node that is killed or cut off, and
    # logs how the node's daemon ended.
    lines = ["#!/bin/sh", "# Written by a2a.cluster: enters the node's namespaces instead of ssh.",
             'host="$1"; shift', 'case "$host" in']
    for index in range(nodes):
        lines.append(f'  {address(index)}|{cluster.node(index)}) node={cluster.node(index)} ;;')
    lines += ['  *) echo "cluster agent: unknown node $host" >&2; exit 2 ;;', "esac",
              'ip netns exec "$node" unshare --uts sh -c "hostname $node; $*"', 'status=$?',
              f'echo "$node $status" >> {cluster.daemons_log}', 'exit $status']
    with open(cluster.agent, "w") as out:
        out.write("\n".join(lines) + "\n")
    os.chmod(cluster.agent, 0o755)


def read_state(cluster: Cluster) -> dict:
    try:
        with open(os.path.join(cluster.state_dir, "state.json")) as src:
            return json.load(src)
    except FileNotFoundError:
        return {}


def parse_rate(rate: str) -> float:
    """Bits per second of a tc rate (``10gbit``, ``100mbit``, ``500kbit``)."""
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bit": 1.0}
    for unit, scale in units.items():
        if rate.endswith(unit):
            try:
                bits = float(rate[: -len(unit)])
            except ValueError:
                break
            if bits > 0:
                return bits * scale
    raise ValueError(f"--rate {rate!r}: a positive number with kbit, mbit or gbit (e.g. 10gbit)")


def shape(namespace: str, device: str, rate: str | None) -> None:
    """A token bucket of `rate` on `device`'s egress (burst: 10 ms at the rate, at least 64 KiB);
    None takes the shaping off."""
    if rate is None:
        in_ns(namespace, "tc", "qdisc", "del", "dev", device, "root", check=False)
        return
    bits = parse_rate(rate)
    burst = max(64 * 1024, int(bits / 8 * 0.01))
    in_ns(namespace, "tc", "qdisc", "replace", "dev", device, "root", "tbf", "rate", rate,
          "burst", str(burst), "latency", "100ms")


def up(nodes: int, rate: str | None = None, cluster: Cluster | None = None) -> None:
    cluster = cluster or current()
    require_rights()
    if not 1 <= nodes <= MAX_NODES:
        sys.exit(f"cluster: 1 to {MAX_NODES} nodes, not {nodes}")
    if rate is not None:
        parse_rate(rate)
    down(quiet=True, cluster=cluster)
    bridge = cluster.bridge_ns
    try:
        sh("ip", "netns", "add", bridge)
        in_ns(bridge, "ip", "link", "add", "br0", "type", "bridge")
        in_ns(bridge, "ip", "link", "set", "br0", "up")
        for index in range(nodes):
            node = cluster.node(index)
            sh("ip", "netns", "add", node)
            in_ns(node, "ip", "link", "set", "lo", "up")
            # Made inside the node's namespace, its peer moved to the bridge's: nothing in the host's.
            in_ns(node, "ip", "link", "add", "eth0", "type", "veth", "peer", "name", f"p{index}", "netns", bridge)
            in_ns(node, "ip", "addr", "add", f"{address(index)}/24", "dev", "eth0")
            in_ns(node, "ip", "link", "set", "eth0", "up")
            in_ns(bridge, "ip", "link", "set", f"p{index}", "master", "br0")
            in_ns(bridge, "ip", "link", "set", f"p{index}", "up")
            if rate is not None:
                shape(node, "eth0", rate)
                shape(bridge, f"p{index}", rate)
        write_state(cluster, nodes, rate)
    except BaseException:
        down(quiet=True, cluster=cluster)
        raise
    print(f"cluster: {nodes} node(s) up ({', '.join(cluster.node(i) + '=' + address(i) for i in range(nodes))})"
          + (f", links shaped to {rate}" if rate else ", links unshaped"))


def kill_in(namespace: str) -> int:
    """SIGKILLs every process in `namespace`; returns how many."""
    pids = sh("ip", "netns", "pids", namespace, check=False, quiet=True).stdout.split()
    killed = 0
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
            killed += 1
        except (ProcessLookupError, ValueError):
            pass
    return killed


def down(quiet: bool = False, cluster: Cluster | None = None) -> None:
    """Ends every process in the cluster's namespaces, then removes them. Idempotent."""
    cluster = cluster or current()
    present = namespaces(cluster)
    for namespace in present:
        kill_in(namespace)
    for namespace in present:
        sh("ip", "netns", "delete", namespace, check=False, quiet=quiet)
    shutil.rmtree(cluster.state_dir, ignore_errors=True)
    if not quiet:
        print(f"cluster: down ({len(present)} namespace(s) removed)")


def status(cluster: Cluster | None = None) -> str:
    cluster = cluster or current()
    nodes, state = up_nodes(cluster), read_state(cluster)
    if not nodes:
        return "cluster: down"
    return f"cluster {cluster.name}: {nodes} node(s) up, links {state.get('rate') or 'unshaped'}, " \
           f"subnet {state.get('subnet')}"
