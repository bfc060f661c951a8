"""python -m moe_runtime.bench.assignment on one rank: the printed table, the JSON row, argument errors."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

from moe_runtime.bench import assignment as bench_assignment


def test_one_rank_quick_run_prints_and_writes_the_row(tmp_path, capsys):
    path = tmp_path / "row.json"
    assert bench_assignment.main(["--quick", "--np", "1", "--json", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("# python -m moe_runtime.bench.assignment") and "hit rate" in lines[2]
    row = json.loads(path.read_text())
    assert row["ranks"] == 1 and row["steps"] == 2 * 3  # 2 batches x epochs 2..4
    assert 0.0 <= row["hit_rate"] <= 1.0 and 0 <= row["steps_cached"] <= row["steps"]
    assert row["speedup"] == pytest.approx(row["uncached_ms"] / row["cached_ms"])


@pytest.mark.parametrize("argv, match", [(["--tokens", "10", "--tokens-per-sample", "3"], "multiple of"),
                                         (["--epochs", "1"], "at least 2"), (["--experts", "0"], "positive")])
def test_bad_arguments_are_named(argv, match, capsys):
    with pytest.raises(SystemExit):
        bench_assignment.parse_args(argv)
    assert match in capsys.readouterr().err
