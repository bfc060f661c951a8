"""python -m moe_runtime.bench.placement on one rank: the table's and the JSON's format, the
synthetic traces, argument errors."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("torch")

from moe_runtime import placement
from moe_runtime.bench import placement as bench_placement


def test_one_rank_run_writes_every_trace_and_policy(tmp_path, capsys):
    path = tmp_path / "placement.json"
    argv = ["--np", "1", "--batches", "6", "--tokens", "64", "--dim", "8", "--steps", "2", "--repeats", "2",
            "--trials", "2", "--json", str(path)]
    assert bench_placement.main(argv) == 0
    text = capsys.readouterr().out
    assert "Max Load / Avg Max Load" in text and "place (greedy, Adam state included)" in text
    out = json.loads(path.read_text())
    assert [row["trace"] for row in out["rows"]] == ["skewed", "correlated", "layer"]
    for row in out["rows"]:
        for policy in placement.POLICIES:
            assert 1.0 - 1e-12 <= row[f"{policy}_avg_max_load"] <= row[f"{policy}_max_load"] <= 1.0 + 1e-12
    assert [row.get("trials") for row in out["rows"]] == [2, 2, None]
    layer = out["rows"][-1]
    assert layer["experts_moved"] == 0 and layer["bytes_moved"] == 0  # one rank: nothing leaves it
    assert "moe_runtime.bench.placement" in out["command"]


def test_synthetic_traces_are_skewed_or_correlated():
    rng = np.random.default_rng(0)
    skewed = bench_placement.skewed_trace(8, 50, 1000, 1.2, rng)
    assert skewed.shape == (50, 8) and (skewed.sum(axis=1) == 1000).all()
    means = placement.shares(skewed).mean(axis=0)
    assert means.max() > 3 * means.min()
    correlated = bench_placement.correlated_trace(8, 200, 1000, 2, 6.0, rng)
    s = placement.correlation(correlated)
    assert (s > 0.5).sum() == 8 + 2 * 12  # two topics of 4: each pair inside a topic (and the diagonal)


@pytest.mark.parametrize(("flag", "value"), [("--batches", "1"), ("--tokens", "0"), ("--np", "0"),
                                           ("--trials", "0")])
def test_bad_arguments_are_named(flag, value, capsys):
    with pytest.raises(SystemExit):
        bench_placement.main([flag, value])
    assert flag in capsys.readouterr().err
