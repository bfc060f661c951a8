"""tests/run_mpi.py (the `make test-mpi` runner) and its per-rank wrapper."""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys

import pytest
import run_mpi

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_wrapper():
    spec = importlib.util.spec_from_file_location("_rank_pytest", os.path.join(TESTS, "mpi", "_rank_pytest.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_matrix_covers_the_required_sizes_and_topologies():
    full = [c for c in run_mpi.CONFIGS if c.paths == [run_mpi.MPI_TESTS]]
    detected = {c.np for c in full if c.local_size is None}
    assert detected == {1, 2, 3, 4, 8}
    emulated = {(c.np // c.local_size, c.local_size) for c in full if c.local_size and c.np % c.local_size == 0}
    assert {(2, 2), (4, 2), (2, 4), (3, 1)} <= emulated
    assert any(c.np % c.local_size for c in full if c.local_size), "no irregular topology (2dh rejection)"
    timeout_runs = [c for c in run_mpi.CONFIGS if run_mpi.TIMEOUT_TESTS in c.paths]
    assert timeout_runs and all(c.env.get("A2A_TEST_TIMEOUT") == "1" for c in timeout_runs)
    assert len({c.name for c in run_mpi.CONFIGS}) == len(run_mpi.CONFIGS)


def test_run_env_sets_the_timeout_and_topology(monkeypatch):
    monkeypatch.setenv("A2A_MPI_MAX_COUNT", "5")  # must not leak from the caller's shell
    monkeypatch.setenv("A2A_LOCAL_SIZE", "3")
    config = run_mpi.Config("x", 8, 4)
    env = run_mpi.run_env(config, 60)
    assert env["A2A_TIMEOUT_S"] == "60"
    assert env["A2A_LOCAL_SIZE"] == "4"
    assert "A2A_MPI_MAX_COUNT" not in env
    assert "A2A_LOCAL_SIZE" not in run_mpi.run_env(run_mpi.Config("y", 2), 60)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("....\n12 passed, 3 skipped in 1.50s\n", "12 passed, 3 skipped in 1.50s"),
        ("== 1 failed, 2 passed in 0.3s ==\n[warn] Epoll MOD(4) on fd 20 failed\n", "1 failed, 2 passed in 0.3s"),
        ("a.py::test_x\n\n115 tests collected in 8.66s\n", "115 tests collected in 8.66s"),
        ("nothing here\n", "no pytest summary"),
    ],
)
def test_pytest_summary(text, expected):
    assert run_mpi.pytest_summary(text) == expected


def test_excerpt_starts_at_the_failures():
    log = "\n".join(["....F", "=" * 10 + " FAILURES " + "=" * 10, *[f"line {i}" for i in range(500)], "1 failed in 2s"])
    text = run_mpi.excerpt(log, 20)
    assert text.startswith("=" * 10 + " FAILURES")
    assert "line 18" in text and "line 300" not in text
    assert text.endswith("1 failed in 2s")
    assert run_mpi.excerpt("a\nb", 20) == "a\nb"


def selection(*, only=(), gpu=False, test_device=None, cluster=False) -> argparse.Namespace:
    return argparse.Namespace(np=None, local_size=None, only=list(only), gpu=gpu, test_device=test_device,
                              cluster=cluster)


def test_select_by_name():
    args = selection(only=["np2,2x4", "np1"])
    assert [c.name for c in run_mpi.select(args)] == ["np2", "2x4", "np1"]
    args.only = ["nope"]
    with pytest.raises(SystemExit):
        run_mpi.select(args)


def test_gpu_configurations_run_the_runtime_suite_on_cuda_outside_the_default_matrix():
    gpu = [c for c in run_mpi.CONFIGS if c.gpu]
    assert {c.name for c in gpu} == {"gpu-moe-np2", "gpu-moe-2x2"}
    assert {(c.np, c.local_size) for c in gpu} == {(2, None), (4, 2)}  # one node, and two (2dh)
    assert all(c.paths == [run_mpi.RUNTIME_TESTS] and c.env == {"A2A_TEST_DEVICE": "cuda"} for c in gpu)
    default = run_mpi.select(selection())
    assert default and not any(c.gpu for c in default)
    assert run_mpi.select(selection(gpu=True)) == gpu
    assert [c.name for c in run_mpi.select(selection(only=["gpu-moe-np2"]))] == ["gpu-moe-np2"]
    # --only and --gpu together: the named ones, then the other GPU ones
    assert [c.name for c in run_mpi.select(selection(only=["np2", "gpu-moe-2x2"], gpu=True))] == [
        "np2", "gpu-moe-2x2", "gpu-moe-np2"]


def test_the_test_device_is_forced_per_run_and_never_leaks_from_the_shell(monkeypatch):
    forced = run_mpi.select(selection(gpu=True, test_device="cpu"))
    assert [c.name for c in forced] == ["gpu-moe-np2@cpu", "gpu-moe-2x2@cpu"]
    assert all(run_mpi.run_env(c, 60)["A2A_TEST_DEVICE"] == "cpu" for c in forced)
    monkeypatch.setenv("A2A_TEST_DEVICE", "cuda")
    moe = next(c for c in run_mpi.CONFIGS if c.name == "moe-np4")
    assert "A2A_TEST_DEVICE" not in run_mpi.run_env(moe, 60)


@pytest.mark.parametrize(
    "env, rank",
    [({}, 0), ({"OMPI_COMM_WORLD_RANK": "3"}, 3), ({"PMIX_RANK": "5"}, 5), ({"PMI_RANK": "2"}, 2)],
)
def test_wrapper_finds_the_rank(monkeypatch, env, rank):
    wrapper = load_wrapper()
    for key in wrapper.RANK_VARIABLES:
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert wrapper.world_rank() == rank


def test_wrapper_parses_its_arguments():
    wrapper = load_wrapper()
    assert wrapper.parse(["--log-dir", "d", "--", "-q", "tests/mpi"]) == ("d", ["-q", "tests/mpi"])
    assert wrapper.parse(["-q"])[1] == ["-q"]


def run_runner(tmp_path, *args):
    return subprocess.run(
        [sys.executable, os.path.join(TESTS, "run_mpi.py"), "--log-dir", str(tmp_path), *args],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


def test_runner_end_to_end_only_rank0_prints(tmp_path):
    done = run_runner(tmp_path, "--np", "2", "-k", "test_rank_and_size_match_mpi")
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.strip().splitlines()
    assert lines[-1] == "1 passed, 0 failed"
    assert lines[0].startswith("PASS  np2") and "1 passed" in lines[0]
    logs = tmp_path / "np2"
    assert (logs / "rank0.rc").read_text().strip() == "0"
    assert (logs / "rank1.rc").read_text().strip() == "0"
    # Rank 1's pytest output went to its log, not to the console.
    assert "passed" in (logs / "rank1.log").read_text()
    assert "rank1" not in done.stdout


def test_runner_reports_a_failing_configuration(tmp_path):
    # No test matches: pytest exits 5 on every rank, which must count as a failure.
    done = run_runner(tmp_path, "--np", "2", "--local-size", "1", "-k", "no_such_test_anywhere")
    assert done.returncode == 1
    lines = done.stdout.strip().splitlines()
    assert lines[-1] == "0 passed, 1 failed"
    assert lines[0].startswith("FAIL  np2-local1")
    assert "failing ranks: [0, 1]" in lines[0]
    assert "rank 1, pytest exit code 5" in done.stdout


def test_runner_collects_the_gpu_configuration_without_a_gpu(tmp_path):
    done = run_runner(tmp_path, "--only", "gpu-moe-np2", "--collect-only")
    assert done.returncode == 0, done.stdout + done.stderr
    first = done.stdout.strip().splitlines()[0]
    assert first.startswith("PASS  gpu-moe-np2") and " tests collected in " in first, first
    assert (tmp_path / "gpu-moe-np2" / "rank1.rc").read_text().strip() == "0"


def test_the_cluster_runs_the_node_configurations_with_the_topology_detected():
    chosen = run_mpi.select(selection(cluster=True))
    assert [c.name for c in chosen] == [name + "-cluster" for name in run_mpi.CLUSTER_CONFIGS]
    assert all(c.cluster for c in chosen)
    assert [c.cluster_shape() for c in chosen] == [(2, 2), (4, 2), (3, 1), (2, 2)]
    assert "TCP between them" in chosen[0].describe()
    assert [c.name for c in run_mpi.select(selection(only=["np2"], cluster=True))] == ["np2-cluster"]
