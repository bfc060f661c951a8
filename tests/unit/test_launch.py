"""a2a.launch: the mpirun command line it builds, and running under it."""

from __future__ import annotations

import os
import stat
import sys

import pytest

from a2a import launch


def fake_mpirun(tmp_path, version_text: str, name: str = "mpirun") -> str:
    path = tmp_path / name
    path.write_text(f"#!/bin/sh\necho '{version_text}'\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


@pytest.fixture
def open_mpi(tmp_path):
    return fake_mpirun(tmp_path, "mpirun (Open MPI) 5.0.5")


@pytest.mark.parametrize("euid, expect_root_flag", [(0, True), (1000, False)])
def test_allow_run_as_root_only_for_root(monkeypatch, open_mpi, euid, expect_root_flag):
    monkeypatch.setattr(os, "geteuid", lambda: euid)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    argv = launch.mpirun_command(4, ["python", "x.py"], mpirun=open_mpi)
    assert ("--allow-run-as-root" in argv) is expect_root_flag


@pytest.mark.parametrize("np_, cpus", [(8, 2), (3, 2), (2, 2), (1, 64), (4, None)])
def test_open_mpi_always_oversubscribes(monkeypatch, open_mpi, np_, cpus):
    # Open MPI counts slots per physical core and honours cpusets, which
    # os.cpu_count() does not see; the flag is harmless when not needed.
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(os, "cpu_count", lambda: cpus)
    assert "--oversubscribe" in launch.mpirun_command(np_, ["cmd"], mpirun=open_mpi)


def test_argv_layout(monkeypatch, open_mpi):
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    argv = launch.mpirun_command(4, ["python", "-m", "pytest", "-q"], mpirun=open_mpi)
    assert argv[:3] == [open_mpi, "-np", "4"]
    assert argv[-4:] == ["python", "-m", "pytest", "-q"]
    assert set(argv[3:-4]) == {"--allow-run-as-root", "--oversubscribe"}


def test_prrte_is_recognised_as_open_mpi(monkeypatch, tmp_path):
    prte = fake_mpirun(tmp_path, "prterun (PRRTE) 3.0.6", name="prterun")
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert "--allow-run-as-root" in launch.mpirun_command(1, ["cmd"], mpirun=prte)


def test_no_open_mpi_flags_for_other_mpis(monkeypatch, tmp_path):
    mpich = fake_mpirun(tmp_path, "HYDRA build details:\n    Version: 4.2.0", name="mpiexec.hydra")
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    assert launch.mpirun_command(8, ["cmd"], mpirun=mpich) == [mpich, "-np", "8", "cmd"]


def test_find_mpirun_prefers_the_one_beside_python():
    found = launch.find_mpirun()
    assert os.access(found, os.X_OK)
    beside = os.path.join(os.path.dirname(sys.executable), "mpirun")
    if os.access(beside, os.X_OK):
        assert found == beside


def test_find_mpirun_reports_a_missing_mpi(monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="mpirun not found"):
        launch.find_mpirun()


def test_real_mpirun_command_has_the_flags_this_machine_needs():
    argv = launch.mpirun_command(max(2, (os.cpu_count() or 1) + 1), ["true"])
    if os.geteuid() == 0:
        assert "--allow-run-as-root" in argv
    assert "--oversubscribe" in argv


@pytest.mark.parametrize(
    "env, expected",
    [
        ({}, False),
        ({"OMPI_COMM_WORLD_SIZE": "2"}, True),
        ({"PMI_SIZE": "2"}, True),
        ({"PMIX_RANK": "0"}, True),
    ],
)
def test_under_mpirun(monkeypatch, env, expected):
    for key in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS", "PMI_RANK"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert launch.under_mpirun() is expected


def test_main_passes_np_local_size_and_command(monkeypatch):
    calls = []
    monkeypatch.setattr(launch, "run", lambda np, command, env=None: calls.append((np, command, env)) or 7)
    rc = launch.main(["--np", "4", "--local-size", "2", "--", "python", "script.py", "--flag"])
    assert rc == 7
    assert calls == [(4, ["python", "script.py", "--flag"], {"A2A_LOCAL_SIZE": "2"})]


def test_main_without_local_size_sets_no_env(monkeypatch):
    calls = []
    monkeypatch.setattr(launch, "run", lambda np, command, env=None: calls.append((np, command, env)) or 0)
    assert launch.main(["--np", "2", "python", "x.py"]) == 0
    assert calls == [(2, ["python", "x.py"], None)]


def test_main_without_command_is_a_usage_error(monkeypatch, capsys):
    monkeypatch.setattr(launch, "run", lambda *a, **k: pytest.fail("must not run"))
    with pytest.raises(SystemExit) as info:
        launch.main(["--np", "2", "--"])
    assert info.value.code == 2
    assert "no command" in capsys.readouterr().err


def test_run_starts_ranks_with_the_environment():
    script = (
        "import os, sys; "
        "ok = os.environ.get('A2A_LAUNCH_TEST') == '7' and os.environ.get('OMPI_COMM_WORLD_SIZE') in (None, '2'); "
        "sys.exit(0 if ok else 3)"
    )
    assert launch.run(2, [sys.executable, "-c", script], env={"A2A_LAUNCH_TEST": "7"}, timeout=120) == 0


def test_run_returns_the_failing_exit_code():
    assert launch.run(2, [sys.executable, "-c", "import sys; sys.exit(3)"], timeout=120) != 0
