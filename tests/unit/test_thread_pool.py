"""The CPU kernels' thread pool: a nested parallel_for runs inline instead of
deadlocking, and callers on several threads do not wait for each other.

The pool is internal to liba2a (no symbol of it is exported), so this builds
tests/cpp/thread_pool_test.cpp against the pool's own source, with the C++
compiler on PATH, and runs it."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SOURCES = ("tests/cpp/thread_pool_test.cpp", "csrc/cpu/thread_pool.cpp", "csrc/core/debug.cpp")


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        pytest.skip("no C++ compiler on PATH")
    binary = str(tmp_path_factory.mktemp("thread_pool") / "thread_pool_test")
    command = [compiler, "-std=c++17", "-O1", "-pthread", "-I", "csrc", "-I", "csrc/include", *SOURCES, "-o", binary]
    built = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
    assert built.returncode == 0, built.stderr
    return binary


def test_thread_pool(program):
    env = {k: v for k, v in os.environ.items() if k != "A2A_NUM_THREADS"}
    run = subprocess.run([program], capture_output=True, text=True, timeout=300, check=False, env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count("ok: ") == 5, run.stdout
