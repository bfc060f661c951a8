"""What the C-program runners share (run_c_test.py, run_nccl_tests_ext.py):
building a CMake project against the installed liba2a through
find_package(a2a), and the environment of one mpirun of its programs."""

from __future__ import annotations

import os
import shutil
import subprocess

import a2a


def cmake_build(source: str, build: str, *extra_build_args: str) -> None:
    """Configures `source` into `build` with the installed a2a's CMake package and builds it."""
    cmake = shutil.which("cmake") or "cmake"
    configure = [cmake, "-S", source, "-B", build, f"-Da2a_DIR={a2a.get_cmake_dir()}"]
    subprocess.run(configure, check=True, stdout=subprocess.DEVNULL)
    subprocess.run([cmake, "--build", build, *extra_build_args], check=True, stdout=subprocess.DEVNULL)


def mpirun_env(local_size: int | None) -> dict[str, str]:
    """This environment with bounded waits, and emulated nodes of `local_size`
    ranks when given (never an A2A_LOCAL_SIZE inherited from the caller)."""
    env = dict(os.environ, A2A_TIMEOUT_S="60")
    env.pop("A2A_LOCAL_SIZE", None)
    if local_size:
        env["A2A_LOCAL_SIZE"] = str(local_size)
    return env
