"""python -m a2a.bench --op esmm,ess,estmm: a tiny run gives one row per op
with no wrong element, and the mode is picked from --op alone."""

from __future__ import annotations

import json

from a2a.bench import __main__ as bench_main
from a2a.bench import es_ops


def test_mode_selection():
    assert es_ops.is_es_mode(["--op", "esmm,estmm"])
    assert es_ops.is_es_mode(["--op=ess"])
    assert not es_ops.is_es_mode(["--op", "encode,esmm"])
    assert not es_ops.is_es_mode(["-b", "8"])


def test_tiny_run(tmp_path, capsys):
    out = tmp_path / "rows.json"
    argv = ["--op", "esmm,ess,estmm", "--tokens", "96", "--experts", "4", "--top-k", "2", "--model-dim", "24",
            "--hidden", "40", "-r", "1", "-n", "1", "--device", "cpu", "--json", str(out)]
    assert bench_main.main(argv) == 0
    rows = json.loads(out.read_text())
    assert [r["op"] for r in rows] == ["esmm", "ess", "estmm"]
    assert all(r["wrong"] == 0 and r["gflops"] > 0 and r["vs_padded"] > 0 for r in rows)
    assert "vs dense" in capsys.readouterr().out


def test_profile_rows(tmp_path, capsys):
    """--profile N: a2a's call of each row under torch.profiler, its largest kernels (ops on the CPU) in the
    row's JSON and as comment lines after it."""
    out = tmp_path / "rows.json"
    argv = ["--op", "esmm,ess", "--tokens", "64", "--experts", "4", "--top-k", "2", "--model-dim", "16",
            "--hidden", "16", "-r", "1", "-n", "1", "--device", "cpu", "--profile", "3", "--json", str(out)]
    assert bench_main.main(argv) == 0
    rows = json.loads(out.read_text())
    assert [r["op"] for r in rows] == ["esmm", "ess"]
    for row in rows:
        profile = row["profile"]
        assert profile["busy_ms"] > 0 and 1 <= len(profile["rows"]) <= 3
        assert all(r["calls"] > 0 and 0 < r["share"] <= 1 for r in profile["rows"])
    printed = capsys.readouterr().out
    assert "#   esmm float32: " in printed and "#   ess float32: " in printed
