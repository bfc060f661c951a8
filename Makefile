# make bench   build, then run `python -m a2a.bench` on 4 MPI ranks
# make test    build, then run the whole suite (unit + mpirun + C program; the
#              GPU tests skip themselves without a GPU)
# make test-gpu  the tests in tests/gpu alone (need CUDA and a GPU)
# Both set up .venv from PyPI on first use (tools/bootstrap.sh).

VENV   := .venv
PY     := $(VENV)/bin/python
export PATH := $(abspath $(VENV))/bin:$(PATH)

NATIVE_SOURCES := $(shell find csrc cmake -type f) CMakeLists.txt pyproject.toml

.PHONY: all build bench test test-unit test-mpi test-c test-gpu lint clean

all: build

$(VENV)/.ready: tools/bootstrap.sh
	bash tools/bootstrap.sh
	touch $@

# Editable install: Python edits are live; a native change rebuilds here.
$(VENV)/.built: $(VENV)/.ready $(NATIVE_SOURCES)
	$(PY) -m pip install --quiet --disable-pip-version-check --no-build-isolation --no-deps -e .
	touch $@

build: $(VENV)/.built

bench: build
	$(PY) -m a2a.bench $(BENCH_ARGS)

test: test-unit test-mpi test-c test-gpu

test-unit: build
	$(PY) -m pytest -q tests/unit

test-mpi: build
	$(PY) tests/run_mpi.py

test-c: build
	$(PY) tests/c/run_c_test.py

test-gpu: build
	$(PY) -m pytest -q -rs tests/gpu

lint: build
	$(VENV)/bin/ruff check .

clean:
	rm -rf build $(VENV)
