"""python -m a2a.bench --gaps: its command line, and a short real run on 2 ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from a2a.bench import __main__ as entry
from a2a.bench import gaps

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_flag_picks_this_benchmark():
    assert entry.family(["--gaps", "-r", "3"]) is gaps
    assert entry.family(["-b", "1K"]) is not gaps


@pytest.mark.parametrize("argv, message", [
    (["--gaps", "-r", "0"], "-r/--repeats"),
    (["--gaps", "--np", "1"], "--np must be at least 2"),
])
def test_bad_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit) as stop:
        gaps.parse_args(argv)
    assert stop.value.code == 2 and message in capsys.readouterr().err


def test_the_targets_are_the_issues():
    """The shapes and targets of issue 26, part 3 (a change here moves the goalposts: say so in docs/benchmarks.md)."""
    table = {(g.name, g.algo, g.against, g.time_ratio, g.target, g.hidden) for g in gaps.GAPS}
    assert ("small linear", "linear", "mpi", True, 1.2, 1024) in table
    assert ("small v", "v", "mpi", True, 1.5, 1024) in table
    assert ("v throughput", "v", "linear", False, 0.8, 1024) in table
    assert ("flex combine, M = 256", "combine", "linear", False, 0.9, 256) in table


def test_a_short_run_on_two_ranks(tmp_path):
    out = tmp_path / "gaps.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PMI_", "A2A_LOCAL_SIZE"))}
    proc = subprocess.run([sys.executable, "-m", "a2a.bench", "--gaps", "--np", "2", "-r", "1", "-n", "1", "-w", "0",
                           "--json", str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())
    assert [r["gap"] for r in rows] == [g.name for g in gaps.GAPS for _ in g.sizes]
    for row in rows:
        assert row["wrong"] == 0 and row["ranks"] == 2 and row["time_us"] > 0 and row["against_time_us"] > 0
        assert row["met"] == (row["ratio"] <= row["target"] if row["ratio_of"] == "time" else row["ratio"] >= row["target"])
    assert "rows meet their target" in proc.stdout
