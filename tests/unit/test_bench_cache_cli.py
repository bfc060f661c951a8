"""python -m moe_runtime.bench.cache: the table's and the JSON's format, seeded traces, argument errors."""

from __future__ import annotations

import json

import pytest

from moe_runtime.bench import cache as bench_cache
from moe_runtime.deployment.cache_policy import POLICIES


def test_json_rows_cover_every_size_and_policy(capsys):
    assert bench_cache.main(["--experts", "5", "--batches", "60", "--tokens", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["slots"] for r in out["rows"]] == [1, 2, 3, 4, 5]
    for row in out["rows"]:
        assert all(0.0 <= row[p] <= 1.0 for p in POLICIES)
        assert row["belady"] <= min(row[p] for p in POLICIES)
        assert row["memory_saved"] == pytest.approx((5 - row["slots"]) / 5)
    assert set(out["targets"]) >= {"lifo_le_fifo_at_every_size", "lifo_minus_min_mean"}


def test_table_states_the_papers_targets(capsys):
    assert bench_cache.main(["--experts", "4", "--batches", "30", "--tokens", "2"]) == 0
    text = capsys.readouterr().out
    assert "LIFO <= FIFO at every size (paper, Fig. 12b):" in text and "LIFO - MIN: mean" in text
    assert len([line for line in text.splitlines() if line.strip()[:1].isdigit()]) == 4


def test_traces_are_seeded_and_sticky():
    a = bench_cache.synthetic_trace(8, 50, 4, 1.2, 0.8, seed=1)
    assert a == bench_cache.synthetic_trace(8, 50, 4, 1.2, 0.8, seed=1)
    assert a != bench_cache.synthetic_trace(8, 50, 4, 1.2, 0.8, seed=2)
    frozen = bench_cache.synthetic_trace(8, 20, 4, 1.2, 1.0, seed=3)
    assert all(batch <= frozen[0] for batch in frozen)  # sticky=1 only ever reuses the first batch's experts


@pytest.mark.parametrize(("flag", "value"), [("--experts", "0"), ("--sticky", "1.5"), ("--zipf", "-1")])
def test_bad_arguments_are_named(flag, value, capsys):
    with pytest.raises(SystemExit):
        bench_cache.main([flag, value])
    assert flag in capsys.readouterr().err


def test_from_layer_records_the_layers_trace_and_times_every_cache_size(capsys):
    args = ["--from-layer", "--experts", "4", "--batches", "12", "--tokens", "3", "--model-dim", "8", "--hidden",
            "16", "--timed-batches", "5", "--json"]
    assert bench_cache.main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["slots"] for r in out["rows"]] == [1, 2, 3, 4]
    assert [r["slots"] for r in out["timing"]] == [0, 1, 2, 4]  # uncached, then 1, E/4 (=1), E/2, E
    assert all(r["seconds"] > 0 and 0.0 <= r["miss_rate"] <= 1.0 for r in out["timing"])
    inputs = bench_cache.layer_inputs(12, 3, 8, 0.8, seed=0)
    trace = bench_cache.recorded_trace(inputs, 4, 8, 16)
    assert len(trace) == 12 and all(1 <= len(batch) <= 3 and batch <= set(range(4)) for batch in trace)
