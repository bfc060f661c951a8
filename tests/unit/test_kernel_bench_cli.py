"""python -m a2a.bench --op ...: the MoE kernel benchmark (a2a/bench/kernels.py)."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

import pytest

from a2a.bench import __main__ as bench
from a2a.bench import common, kernels_baselines
from a2a.bench import kernels as kb

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ["--tokens", "64", "--experts", "4", "--model-dim", "8", "--top-k", "2", "-r", "1", "-n", "1"]


def _needs_kernels():
    pytest.importorskip("torch")
    import a2a

    if not all(
        hasattr(a2a, name) for name in ("route", "fast_encode", "fast_decode", "permute", "unpermute")
    ):
        pytest.skip("this a2a has no MoE kernels")


# ---------------------------------------------------------------------------
# Pure helpers


def test_kernel_mode_is_chosen_by_op():
    assert kb.is_kernel_mode(["--op", "encode"])
    assert kb.is_kernel_mode(["-r", "1", "--op=all"])
    assert not kb.is_kernel_mode(["-b", "1K"])
    assert not kb.is_kernel_mode(["--", "--op"])
    assert not kb.is_kernel_mode(["--opx"])


@pytest.mark.parametrize(
    "tokens, experts, k, factor, max_count, expect",
    [
        (4096, 16, 2, 1.0, 600, 512),  # ceil(k * f * T / E)
        (100, 8, 1, 1.0, 30, 13),
        (100, 8, 2, 0.5, 30, 13),
        (100, 8, 2, 0.0, 30, 30),  # no drops: the largest count
        (100, 8, 2, -2.0, 30, 30),  # like 0 ...
        (100, 8, 2, -1.0, 30, 25),  # ... but at most ceil(k * -f * T / E)
    ],
)
def test_capacity_rule(tokens, experts, k, factor, max_count, expect):
    assert kb.capacity_for(tokens, experts, k, factor, max_count) == expect


def test_moved_bytes():
    common = {"tokens": 100, "experts": 8, "top_k": 2, "model_dim": 16, "itemsize": 2, "routed": 200}
    row = 16 * 2
    assert kb.moved_bytes("encode", capacity=20, kept=150, **common) == 150 * row + 8 * 20 * row + 200 * 4
    assert kb.moved_bytes("encode", capacity=20, kept=150, gates=False, **common) == 150 * row + 160 * row
    assert kb.moved_bytes("decode", capacity=20, kept=150, **common) == 150 * row + 100 * row + 200 * 4
    assert kb.moved_bytes("permute", capacity=None, kept=200, **common) == 2 * 200 * row
    assert kb.moved_bytes("unpermute", capacity=None, kept=200, **common) == 200 * row + 100 * row + 200 * 4
    assert kb.einsum_macs(4096, 16, 512, 1024) == 4096 * 16 * 512 * 1024


def test_geomean():
    assert common.geomean([2.0, 8.0]) == pytest.approx(4.0)
    assert common.geomean([None, 0.0]) is None


def _row(**kw):
    row = {
        "op": "unpermute",
        "tokens": 65536,
        "experts": 64,
        "top_k": 2,
        "model_dim": 4096,
        "dtype": "bfloat16",
        "capacity": None,
    }
    row.update(bytes=1610612736, time_us=123456.7, gbps=13.04, memcpy_gbps=20.5, vs_memcpy=0.64)
    row.update(vs_index=3.21, vs_einsum=None, wrong=0)
    row.update(kw)
    return row


def test_row_lines_up_with_the_header():
    names, units = kb.header_lines()
    line = kb.format_row(_row())
    ends = [m.end() for m in re.finditer(r"\S+", names) if m.group() != "#"]
    assert ends == [m.end() for m in re.finditer(r"\S+", line)]
    assert names.split()[1:] == [
        "op",
        "T",
        "E",
        "k",
        "M",
        "dtype",
        "C",
        "bytes",
        "time",
        "GB/s",
        "memcpy",
        "vs",
        "vs",
        "vs",
        "#wrong",
    ]
    assert units.split()[1:] == ["(B)", "(us)", "(GB/s)", "memcpy", "index", "einsum"]
    assert line.split() == (
        [
            "unpermute",
            "65536",
            "64",
            "2",
            "4096",
            "bfloat16",
            "-",
            "1610612736",
            "123457",
            "13.04",
            "20.50",
            "0.64",
            "3.21x",
            "-",
            "0",
        ]
    )
    assert kb.format_row(_row(op="encode", capacity=2048, vs_einsum=17.04)).split()[6] == "2048"
    assert kb.format_row(_row(op="encode", capacity=2048, vs_einsum=17.04)).split()[-2] == "17.0x"


# ---------------------------------------------------------------------------
# Arguments


def test_defaults():
    args = kb.parse_args(["--op", "all"])
    assert args.ops == list(kb.OPS)
    assert (args.tokens, args.experts, args.model_dim, args.top_k) == (
        [4096, 16384, 65536],
        [8, 64],
        [1024, 4096],
        [1, 2],
    )
    assert args.dtypes == ["float32", "bfloat16"]
    assert args.capacity_factor == [1.0]
    assert args.iters is None and args.repeats == 3 and args.max_gib == 8
    assert args.einsum and args.gates and args.out and args.einsum_max == 2e11


def test_flags():
    args = kb.parse_args(
        ["--op", "decode,encode,decode", "--tokens", "1K,3000", "--dtype", "bf16,fp32,float64,half"]
        + ["--capacity-factor", "0,-1.5", "--no-einsum", "--threads", "1", "-n", "3", "--no-out"]
    )
    assert args.ops == ["decode", "encode"]
    assert args.tokens == [1024, 3000]
    assert args.dtypes == ["bfloat16", "float32", "float64", "float16"]
    assert args.capacity_factor == [0.0, -1.5]
    assert (args.einsum, args.threads, args.iters, args.out) == (False, 1, 3, False)


@pytest.mark.parametrize(
    "argv",
    [
        "--op foo",
        "--op encode,",
        "--op encode --dtype int8",
        "--op encode --tokens 0",
        "--op encode --tokens abc",
        "--op encode --experts 4 --top-k 5",
        "--op encode -r 0",
        "--op encode -n 0",
        "--op encode --threads 0",
        "--op encode --max-gib 0",
        "--op encode --capacity-factor nan",
        "--op encode --device tpu",
    ],
)
def test_bad_flags_exit_with_usage(argv, capsys):
    with pytest.raises(SystemExit) as info:
        bench.main(argv.split())
    assert info.value.code == 2
    assert "error" in capsys.readouterr().err


def test_help_describes_the_kernel_mode(capsys):
    with pytest.raises(SystemExit) as info:
        bench.main(["--op", "all", "--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    assert "--einsum-max" in text and "--max-gib" in text and "minutes" in text
    with pytest.raises(SystemExit):
        bench.main(["--help"])
    assert "--op" in capsys.readouterr().out  # the collectives' help points to it


def test_op_mode_never_launches_mpirun(monkeypatch):
    from a2a import launch

    monkeypatch.setattr(launch, "run", lambda *a, **k: pytest.fail("--op must not start mpirun"))
    monkeypatch.setattr(kb, "main", lambda argv: 7)
    assert bench.main(["--op", "encode"]) == 7


# ---------------------------------------------------------------------------
# Real runs


def _table(stdout: str) -> list[list[str]]:
    return [line.split() for line in stdout.splitlines() if line.strip() and not line.startswith("#")]


def test_tiny_sweep_in_a_subprocess(tmp_path):
    _needs_kernels()
    out = tmp_path / "kernels.json"
    env = {k: v for k, v in os.environ.items() if k not in ("A2A_NUM_THREADS", common.COMMAND_ENV)}
    proc = subprocess.run(
        [sys.executable, "-m", "a2a.bench", "--op", "all", *TINY, "--threads", "1", "--json", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = proc.stdout
    assert "# a2a MoE kernel benchmark: python -m a2a.bench --op all --tokens 64" in text
    assert "# threads: 1 for a2a (A2A_NUM_THREADS=1), torch.set_num_threads(1)" in text
    assert "# Out of bounds values : 0 OK" in text
    table = _table(text)
    assert [(r[0], r[5]) for r in table] == [
        (op, dtype)
        for dtype in ("float32", "bfloat16")
        for op in ("encode", "decode", "permute", "unpermute")
    ]
    for fields in table:
        assert len(fields) == 15
        assert fields[1:5] == ["64", "4", "2", "8"]
        assert fields[6] == ("32" if fields[0] in ("encode", "decode") else "-")  # C = ceil(2 * 64 / 4)
        assert fields[-1] == "0"  # #wrong
        assert float(fields[8]) > 0 and float(fields[9]) > 0 and float(fields[10]) > 0
        assert fields[12].endswith("x")
        assert fields[13].endswith("x") == (fields[0] in ("encode", "decode"))  # einsum: encode/decode only
    rows = json.loads(out.read_text())
    assert len(rows) == len(table) == 8
    for row in rows:
        assert row["wrong"] == 0 and row["skipped"] is None and row["threads"] == 1 and row["device"] == "cpu"
        assert row["iters"]["a2a"] == 1 and row["repeats"] == 1
        assert row["vs_memcpy"] == pytest.approx(row["memcpy_us"] / row["time_us"])
        assert row["gbps"] == pytest.approx(row["bytes"] / row["time_us"] / 1e3)
        assert row["vs_index"] == pytest.approx(row["index_us"] / row["time_us"])
        assert row["memcpy_us"] == min(row["memcpy_numpy_us"], row["memcpy_torch_us"])
        assert "--op all" in row["command"] and row["out"] and row["timestamp"]
        itemsize = 4 if row["dtype"] == "float32" else 2
        if row["op"] == "encode":
            assert row["bytes"] == row["kept"] * 8 * itemsize + 4 * 32 * 8 * itemsize + 64 * 2 * 4
            assert row["kept"] + row["dropped"] == 128
            assert row["einsum_macs"] == 64 * 4 * 32 * 8 and row["vs_einsum"] > 0
        if row["op"] == "permute":
            assert row["bytes"] == 2 * 128 * 8 * itemsize and row["capacity"] is None
            assert row["einsum_us"] is None and row["einsum_skipped"] == "not applicable"


@pytest.mark.parametrize(
    "extra", [["--dtype", "float16,float64", "--no-out"], ["--no-gates", "--capacity-factor", "0"]]
)
def test_other_dtypes_and_modes_check_clean(extra, capsys):
    _needs_kernels()
    assert bench.main(["--op", "all", *TINY, "--no-einsum", *extra]) == 0
    text = capsys.readouterr().out
    assert "# Out of bounds values : 0 OK" in text
    assert all(fields[-1] == "0" and fields[13] == "-" for fields in _table(text))


def test_capacity_below_the_demand_drops(tmp_path):
    _needs_kernels()
    out = tmp_path / "drop.json"
    argv = [
        "--op",
        "encode,decode",
        *TINY,
        "--capacity-factor",
        "0.5",
        "--dtype",
        "float32",
        "--json",
        str(out),
    ]
    assert bench.main(argv) == 0
    rows = json.loads(out.read_text())
    assert [r["capacity"] for r in rows] == [16, 16]  # ceil(2 * 0.5 * 64 / 4)
    assert all(r["dropped"] > 0 and r["kept"] <= 4 * 16 and r["wrong"] == 0 for r in rows)


def test_einsum_above_the_limit_is_skipped(tmp_path):
    _needs_kernels()
    out = tmp_path / "e.json"
    assert (
        bench.main(["--op", "encode", *TINY, "--dtype", "fp32", "--einsum-max", "100", "--json", str(out)])
        == 0
    )
    [row] = json.loads(out.read_text())
    assert row["einsum_us"] is None and row["vs_einsum"] is None
    assert "--einsum-max" in row["einsum_skipped"]


def test_memory_budget_skips_with_a_note(tmp_path, capsys):
    _needs_kernels()
    out = tmp_path / "skip.json"
    # x of 64 x 8 float32 is 2 KiB; everything else is more than 4 KiB.
    assert (
        bench.main(
            [
                "--op",
                "encode,permute",
                *TINY,
                "--dtype",
                "fp32",
                "--max-gib",
                str(4 / 2**20),
                "--json",
                str(out),
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "# skipped: encode T=64 E=4 k=2 M=8 float32: needs about" in text
    assert "# Skipped configurations: 2" in text
    assert _table(text) == []
    rows = json.loads(out.read_text())
    assert len(rows) == 2 and all("--max-gib" in r["skipped"] for r in rows)
    # x itself over the budget: nothing is allocated.
    assert bench.main(["--op", "decode", *TINY, "--dtype", "fp32", "--max-gib", str(1 / 2**20)]) == 0
    assert "x alone needs" in capsys.readouterr().out


def test_wrong_results_fail_the_run(monkeypatch, tmp_path, capsys):
    _needs_kernels()
    monkeypatch.setattr(kb, "_count_wrong", lambda *a, **k: 3)
    out = tmp_path / "bad.json"
    assert bench.main(["--op", "permute", *TINY, "--dtype", "fp32", "--json", str(out)]) == 1
    assert "# Out of bounds values : 3 FAILED" in capsys.readouterr().out
    assert json.loads(out.read_text())[0]["wrong"] == 3


def test_reference_routing_matches_a2a_route():
    """The baselines' routing tables are computed without a2a; they must agree with a2a.route."""
    _needs_kernels()
    import torch

    import a2a

    args = kb.parse_args(["--op", "encode", "--device", "cpu"])
    env = kernels_baselines.Env(args)
    for tokens, experts, k, factor in [
        (100, 8, 2, 1.0),
        (257, 5, 3, 0.7),
        (64, 4, 1, 0.0),
        (50, 16, 2, -0.5),
    ]:
        indices = kernels_baselines.random_indices(env, tokens, experts, k)
        ref = kernels_baselines.reference_routing(env, indices, experts, factor)
        routing = a2a.route(indices, experts, capacity_setting=factor)
        assert ref.capacity == routing.capacity
        assert torch.equal(ref.row_map, torch.as_tensor(routing.row_map))
        assert ref.kept_choices.numel() == tokens * k - routing.num_dropped
        assert math.isclose(float(ref.counts.sum()), tokens * k)
