"""python -m moe_runtime.bench.tutel on one rank: the printed table."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from moe_runtime.bench import tutel as bench_tutel


def test_one_rank_quick_run_prints_both_comparisons(capsys):
    assert bench_tutel.main(["--quick", "--np", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# python -m moe_runtime.bench.tutel")
    assert "outputs bitwise equal: True" in out, out
    assert "Tutel surface / native:" in out and "Tutel ops / a2a:" in out
