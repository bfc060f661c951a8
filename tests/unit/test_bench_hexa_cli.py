"""python -m moe_runtime.bench --hetero and --flows: quick runs give every row of their report and
JSON; the paper's figures are the ones quoted; argument errors."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

from moe_runtime.bench import __main__ as bench
from moe_runtime.bench import flows as bench_flows
from moe_runtime.bench import hetero as bench_hetero


def test_flows_quick_run_on_one_rank(tmp_path, capsys):
    path = tmp_path / "flows.json"
    assert bench.main(["--flows", "--quick", "--np", "1", "--json", str(path)]) == 0
    rows = json.loads(path.read_text())["rows"]
    assert [row["tokens"] for row in rows] == [16, 64]
    for row in rows:
        assert all(row[flow] > 0 for flow in bench_flows.FLOWS) and row["best"] in bench_flows.FLOWS
    assert "model_centric" in capsys.readouterr().out


def test_hetero_quick_run_on_two_ranks(tmp_path):
    path = tmp_path / "hetero.json"
    assert bench.main(["--hetero", "--quick", "--np", "2", "--cases", "balanced,rank 1 slow", "--json",
                       str(path)]) == 0
    out = json.loads(path.read_text())
    assert [row["case"] for row in out["rows"]] == ["balanced", "rank 1 slow"]
    for row in out["rows"]:
        assert len(row["latencies"]) == 2 and sum(row["batch_split"]) == 2 * 64 and sum(row["hidden_split"]) == 64
        for flow in ("data_centric", "model_centric"):
            assert row[f"{flow} uniform"] > 0 and row[f"{flow} proportional"] > 0
    assert out["paper"]["data_centric rank 1 slow"] == pytest.approx(-0.253)


def test_argument_errors():
    with pytest.raises(SystemExit):
        bench_hetero.parse_args(["--cases", "nobody slow"])
    with pytest.raises(SystemExit):
        bench_flows.parse_args(["--tokens", "0"])
    assert bench_hetero.PAPER[("model_centric", "rank 0 slow")] == pytest.approx(-0.063)
