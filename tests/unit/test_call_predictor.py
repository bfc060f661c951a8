"""The predictor of the predicted check (csrc/core/call_predictor.hpp,
docs/algorithms.md "The predicted check"): after which calls it predicts
which. Internal to liba2a, so this builds tests/cpp/call_predictor_test.cpp
against the header with the C++ compiler on PATH, and runs it."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_call_predictor(tmp_path):
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        pytest.skip("no C++ compiler on PATH")
    binary = str(tmp_path / "call_predictor_test")
    command = [compiler, "-std=c++17", "-O1", "-I", "csrc", "tests/cpp/call_predictor_test.cpp", "-o", binary]
    built = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
    assert built.returncode == 0, built.stderr
    run = subprocess.run([binary], capture_output=True, text=True, timeout=60, check=False)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count("ok: ") == 9, run.stdout
