"""A2A_FLEX_PATH (read once per process): a forced path gives the same bytes,
and an unknown value is an argument error naming the setting, reported like
any other bad argument (through the cross-rank check) instead of thrown
outside it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SCRIPT = """
import numpy as np, a2a
comm = a2a.Comm.from_mpi()
x = np.arange(2 * 16 * 4096, dtype=np.float32).reshape(2, 16, 4096)
try:
    y = a2a.all_to_all_flex(x, comm=comm, split_axis=0, concat_axis=1)
except a2a.InvalidArgumentError as error:
    print("error:", error)
else:
    print("ok:", bool(np.array_equal(y, x)))
"""


def run_with(value: str) -> str:
    env = dict(os.environ, A2A_FLEX_PATH=value)
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout.strip()


@pytest.mark.parametrize("value", ["auto", "pieces", "datatypes", "packed"])
def test_each_forced_path_gives_the_same_bytes(value):
    assert run_with(value) == "ok: True"


def test_unknown_value_is_an_argument_error():
    out = run_with("fastest")
    assert out.startswith("error:") and "A2A_FLEX_PATH='fastest' is not auto, datatypes, pieces or packed" in out, out
