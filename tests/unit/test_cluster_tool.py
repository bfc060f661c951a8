"""tools/cluster.py's pieces that need no root: the agent it writes for Open
MPI's launcher, the mpirun line, the rates. (make test-cluster runs the
suite on a real namespace cluster.)"""

from __future__ import annotations

import importlib.util
import os
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def cluster(tmp_path, monkeypatch):
    monkeypatch.setenv("A2A_CLUSTER_STATE", str(tmp_path))
    spec = importlib.util.spec_from_file_location("cluster_tool", os.path.join(ROOT, "tools", "cluster.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_agent_enters_the_node_of_each_address(cluster, tmp_path):
    cluster.write_state(3, "1gbit")
    agent = (tmp_path / "agent.sh").read_text()
    for index in range(3):
        assert f"{cluster.address(index)}|{cluster.node_name(index)}) node={cluster.node_name(index)}" in agent
    assert 'ip netns exec "$node" unshare --uts sh -c "hostname $node; $*"' in agent
    done = subprocess.run(["sh", str(tmp_path / "agent.sh"), "10.9.9.9", "true"], capture_output=True, text=True,
                          check=False)
    assert done.returncode == 2 and "unknown node 10.9.9.9" in done.stderr


def test_the_mpirun_line_places_ranks_per_node_unbound_on_the_subnet(cluster):
    line = cluster.mpirun_command(2, 3, ["python", "x.py"], "/bin/mpirun")
    text = " ".join(line)
    assert line[:4] == ["/bin/mpirun", "--allow-run-as-root", "-np", "6"]
    assert "--host 10.213.0.1:3,10.213.0.2:3" in text and "--map-by ppr:3:node" in text
    assert "--bind-to none" in text and "btl_tcp_if_include 10.213.0.0/24" in text
    assert line[-2:] == ["python", "x.py"]


def test_rates(cluster):
    assert cluster.parse_rate("10gbit") == 1e10 and cluster.parse_rate("500mbit") == 5e8
    with pytest.raises(ValueError, match="kbit, mbit or gbit"):
        cluster.parse_rate("fast")
