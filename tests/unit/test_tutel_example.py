"""examples/tutel/helloworld.py (Tutel's helloworld with one import changed)
trains under mpirun on the CPU: gloo initialized by the program, the
layer's collectives over MPI; the loss falls, and a checkpoint it saves
loads into the next run."""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "tutel", "helloworld.py")


def run(*options: str) -> list[float]:
    command = [sys.executable, "-m", "a2a.launch", "--np", "2", "--", sys.executable, EXAMPLE, "--device", "cpu",
               *options]
    done = subprocess.run(command, capture_output=True, text=True, check=False, timeout=240, cwd=ROOT)
    assert done.returncode == 0, f"{' '.join(command)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    losses = [float(value) for value in re.findall(r"^STEP-\d+: loss = ([0-9.]+)", done.stdout, re.MULTILINE)]
    assert losses, f"no STEP lines in:\n{done.stdout[-2000:]}"
    return losses


def test_the_helloworld_trains_and_its_checkpoint_loads(tmp_path):
    path = str(tmp_path / "helloworld-{rank}-of-{size}.pt")
    first = run("--num_steps", "8", "--checkpoint_path", path)
    assert len(first) == 8
    assert all(later < earlier for earlier, later in itertools.pairwise(first)), f"the loss did not fall: {first}"
    assert os.path.exists(path.format(rank=0, size=2)) and os.path.exists(path.format(rank=1, size=2))
    again = run("--num_steps", "2", "--checkpoint_path", path)
    assert again[0] < first[0] * 0.9, f"the next run did not start from the checkpoint: {again[0]} vs {first}"
