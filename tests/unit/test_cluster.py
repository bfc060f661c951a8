"""a2a.cluster's pieces that need no root: the names, the agent it writes for
Open MPI's launcher, the mpirun line, the rates, the command line. (make
test-cluster runs the suite, the benchmarks' smoke and the faults on a real
namespace cluster.)"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from a2a import cluster as cl
from a2a.cluster import nodes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def cluster(tmp_path, monkeypatch):
    monkeypatch.setenv("A2A_CLUSTER_STATE", str(tmp_path))
    monkeypatch.delenv("A2A_CLUSTER_NAME", raising=False)
    return cl.current()


def test_the_agent_enters_the_node_of_each_address(cluster, tmp_path):
    nodes.write_state(cluster, 3, "1gbit")
    agent = (tmp_path / "agent.sh").read_text()
    for index in range(3):
        assert f"{nodes.address(index)}|{cluster.node(index)}) node={cluster.node(index)}" in agent
    assert 'ip netns exec "$node" unshare --uts sh -c "hostname $node; $*"' in agent
    done = subprocess.run(["sh", str(tmp_path / "agent.sh"), "10.9.9.9", "true"], capture_output=True, text=True,
                          check=False)
    assert done.returncode == 2 and "unknown node 10.9.9.9" in done.stderr


def test_the_mpirun_line_places_ranks_per_node_unbound_on_the_subnet(cluster):
    line = cl.mpirun_command(2, 3, ["python", "x.py"], "/bin/mpirun", cluster)
    text = " ".join(line)
    assert line[:4] == ["/bin/mpirun", "--allow-run-as-root", "-np", "6"]
    assert "--host 10.213.0.1:3,10.213.0.2:3" in text and "--map-by ppr:3:node" in text
    assert "--bind-to none" in text and "btl_tcp_if_include 10.213.0.0/24" in text
    assert f"plm_ssh_agent {cluster.agent}" in text
    assert line[-2:] == ["python", "x.py"]


def test_rates():
    assert cl.parse_rate("10gbit") == 1e10 and cl.parse_rate("500mbit") == 5e8
    for bad in ("fast", "0gbit", "xgbit"):
        with pytest.raises(ValueError, match="positive number with kbit, mbit or gbit"):
            cl.parse_rate(bad)


def test_names_keep_clusters_apart(monkeypatch, tmp_path):
    monkeypatch.delenv("A2A_CLUSTER_STATE", raising=False)
    monkeypatch.setenv("A2A_CLUSTER_NAME", "ci7")
    other = cl.current()
    assert (other.node(3), other.bridge_ns, other.state_dir) == ("ci7-n3", "ci7-br", "/run/ci7-cluster")
    assert [other.node_index(n) for n in (2, "2", "ci7-n2", "10.213.0.3")] == [2, 2, 2, 2]
    with pytest.raises(ValueError, match="no node 'a2a-n2'"):
        other.node_index("a2a-n2")
    monkeypatch.setenv("A2A_CLUSTER_NAME", "bad name")
    with pytest.raises(ValueError, match="A2A_CLUSTER_NAME"):
        cl.current()


def test_the_command_line_without_root_says_so_at_once():
    if os.geteuid() == 0:
        pytest.skip("as root the command would act")
    done = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "cluster.py"), "up", "2"],
                          capture_output=True, text=True, check=False)
    assert done.returncode != 0 and "needs root" in done.stderr


def test_the_command_line_parses_every_verb():
    from a2a.cluster.__main__ import build_parser

    parser = build_parser()
    assert parser.parse_args(["link", "1", "down"]).state == "down"
    assert parser.parse_args(["rate", "a2a-n0", "10mbit"]).rate == "10mbit"
    assert parser.parse_args(["kill", "2"]).node == "2"
    assert parser.parse_args(["run", "--nodes", "2", "--ft"]).ft
    with pytest.raises(SystemExit):
        parser.parse_args(["link", "1", "sideways"])


def test_the_agent_logs_how_each_daemon_ended(cluster, tmp_path, monkeypatch):
    # Stand-ins for `ip netns exec NODE` and `unshare --uts`, which need root: each runs the rest. And
    # for `hostname`: without the UTS namespace the agent's `hostname NODE` would rename this machine.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool, body in (("ip", 'shift 3\nexec "$@"'), ("unshare", 'shift 1\nexec "$@"'), ("hostname", "true")):
        (bin_dir / tool).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / tool).chmod(0o755)
    host = socket.gethostname()
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    nodes.write_state(cluster, 3, None)
    for address, status in (("10.213.0.2", 0), ("10.213.0.3", 137)):
        done = subprocess.run(["sh", cluster.agent, address, f"exit {status}"], capture_output=True, check=False)
        assert done.returncode == status
    assert (tmp_path / "daemons.log").read_text() == f"{cluster.node(1)} 0\n{cluster.node(2)} 137\n"
    assert socket.gethostname() == host


def test_a_daemon_that_failed_or_never_ended_is_lost(cluster):
    from a2a.cluster.launch import lost_daemons

    with open(cluster.daemons_log, "w") as log:
        log.write(f"{cluster.node(1)} 0\n{cluster.node(2)} 137\n")
    assert lost_daemons(cluster, 2, grace_s=0) == []
    assert lost_daemons(cluster, 4, grace_s=0) == [f"{cluster.node(2)} (status 137)",
                                                   f"{cluster.node(3)} (its end not logged)"]


def test_ft_asks_open_mpi_for_ulfm(cluster):
    plain = cl.mpirun_command(2, 2, ["x"], "/bin/mpirun", cluster)
    assert "--with-ft" not in plain
    assert cl.mpirun_command(2, 2, ["x"], "/bin/mpirun", cluster, ft=True)[:4] == [
        "/bin/mpirun", "--allow-run-as-root", "--with-ft", "ulfm"]
