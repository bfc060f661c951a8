"""What a network does to a job, done to a running cluster: a node's link
taken down (and back up), a link slowed (or unshaped again), and a whole
node's processes killed (its MPI daemon with them). Each acts on both ends
of the node's link (eth0 in the node, its port on the bridge)."""

from __future__ import annotations

from .nodes import Cluster, current, in_ns, kill_in, parse_rate, require_rights, shape, up_nodes


def _node(cluster: Cluster, node: str | int) -> int:
    require_rights()
    index = cluster.node_index(node)
    nodes = up_nodes(cluster)
    if not 0 <= index < nodes:
        raise ValueError(f"cluster {cluster.name}: no node {node!r} ({nodes} node(s) up)")
    return index


def set_link(node: str | int, state: str, cluster: Cluster | None = None) -> None:
    """Takes node's link ``down`` or brings it ``up``."""
    cluster = cluster or current()
    if state not in ("up", "down"):
        raise ValueError(f"link state {state!r}: up or down")
    index = _node(cluster, node)
    in_ns(cluster.node(index), "ip", "link", "set", "eth0", state)
    in_ns(cluster.bridge_ns, "ip", "link", "set", f"p{index}", state)


def set_rate(node: str | int, rate: str | None, cluster: Cluster | None = None) -> None:
    """Shapes node's link to `rate` (``10mbit``, ...) both ways; None takes the shaping off."""
    cluster = cluster or current()
    if rate is not None:
        parse_rate(rate)
    index = _node(cluster, node)
    shape(cluster.node(index), "eth0", rate)
    shape(cluster.bridge_ns, f"p{index}", rate)


def kill_node(node: str | int, cluster: Cluster | None = None) -> int:
    """SIGKILLs every process of node (ranks and daemon); returns how many."""
    cluster = cluster or current()
    return kill_in(cluster.node(_node(cluster, node)))
