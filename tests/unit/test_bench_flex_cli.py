"""python -m moe_runtime.bench --flex on one rank: the report's and the JSON's format, the
skewed popularities, the targets' evaluation, argument errors."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("torch")

from moe_runtime.bench import __main__ as bench
from moe_runtime.bench import flex as bench_flex


def test_one_rank_quick_run_writes_every_configuration(tmp_path, capsys):
    path = tmp_path / "flex.json"
    assert bench.main(["--flex", "--quick", "--np", "1", "--steps", "4", "--warmup", "1", "--json", str(path)]) == 0
    text = capsys.readouterr().out
    assert "# FlexMoE bench: W = 1" in text and "cost-model error" in text
    out = json.loads(path.read_text())
    assert [row["config"] for row in out["rows"]] == ["flex", "flex variance", "dropless", "capacity 1"]
    flex, _, dropless, capacity = out["rows"]
    assert flex["dropped"] == dropless["dropped"] == 0 and len(flex["per_step"]) == 4
    assert flex["balance_ratio"] == dropless["balance_ratio"] == 1.0  # one rank is always balanced
    assert capacity["dropped"] > 0  # f = 1 on skewed routing drops choices
    assert {t["target"].split()[0] for t in out["targets"]} >= {"balance", "step", "cost-model", "variance"}
    assert "--flex" in out["command"]


def test_popularities_are_skewed_and_the_zipf_one_drifts():
    zipf = [bench_flex.popularity("zipf", 16, step, zipf=1.2, drift_every=10, seed=0) for step in (0, 9, 10)]
    assert all(abs(p.sum() - 1) < 1e-12 for p in zipf)
    assert np.array_equal(zipf[0], zipf[1]) and not np.array_equal(zipf[0], zipf[2])
    assert np.argmax(zipf[2]) != np.argmax(zipf[0])  # the hottest expert moved
    top = bench_flex.popularity("top10", 64, 0, zipf=1.2, drift_every=10, seed=0)
    assert np.sort(top)[::-1][:10].sum() == pytest.approx(0.75)  # the paper's top 10 of 64 take ~75%


def test_targets_are_evaluated_with_their_numbers():
    rows = [{"scenario": "zipf", "config": "flex", "step_ms": 90.0, "balance_ratio": 1.05, "cost_error_median": 0.04},
            {"scenario": "zipf", "config": "dropless", "step_ms": 100.0, "balance_ratio": 1.3},
            {"scenario": "zipf", "config": "capacity 1", "step_ms": 80.0, "dropped": 0.3},
            {"scenario": "zipf", "config": "capacity 2", "step_ms": 95.0, "dropped": 0.1}]
    targets = bench_flex.evaluate_targets(rows, 1.2)
    assert [t["met"] for t in targets] == [True, True, True, None]
    assert targets[1]["value"] == pytest.approx(100 / 90)
    assert targets[3]["value"] == 0.1 and "capacity 2" in targets[3]["target"]  # the closest step time
    rows[0]["cost_error_median"] = None
    assert bench_flex.evaluate_targets(rows, 1.2)[2]["met"] is False


@pytest.mark.parametrize(("flag", "value"), [("--scenarios", "uniform"), ("--tokens", "0"), ("--np", "0"),
                                           ("--warmup", "40"), ("--threshold", "0.5")])
def test_bad_arguments_are_named(flag, value, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--flex", flag, value])
    assert flag.lstrip("-").split("-")[0] in capsys.readouterr().err
