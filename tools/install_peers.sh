#!/usr/bin/env bash
# Installs the layers that `python -m moe_runtime.bench --overhead` measures
# beside ours into the project's venv (make peers): Megatron-Core from PyPI,
# and Tutel from source, built without CUDA (its CPU kernels). Neither is a
# dependency of a2a or moe_runtime; the tests do not need them.
#
#   make peers                                # Tutel from GitHub at the pinned commit
#   TUTEL_SRC=/path/to/tutel make peers       # Tutel from a checkout (no network to GitHub)
set -euo pipefail

PY=${PY:-.venv/bin/python}
# shellcheck source=tools/peers.env
. "$(dirname "$0")/peers.env"
MEGATRON_CORE=megatron-core==$MEGATRON_CORE_VERSION
TUTEL_SRC=${TUTEL_SRC:-git+https://github.com/microsoft/tutel@$TUTEL_COMMIT}

# --no-deps: both need only numpy, packaging and torch, which the venv has
# (pinned); letting pip resolve could replace the pinned torch.
"$PY" -m pip install --quiet --disable-pip-version-check --no-deps "$MEGATRON_CORE"
NO_CUDA=1 "$PY" -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation "$TUTEL_SRC"
"$PY" - <<'PY'
import importlib.metadata as m
print("peers installed:", ", ".join(f"{p} {m.version(p)}" for p in ("tutel", "megatron-core")))
PY
