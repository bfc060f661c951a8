"""python -m a2a.bench: its pure helpers, its command line, and short real runs."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from a2a.bench import collectives as bench
from a2a.bench import collectives_data, common

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
K, M, G = 1 << 10, 1 << 20, 1 << 30


# ---------------------------------------------------------------------------
# Sizes


@pytest.mark.parametrize(
    "text, expect",
    [
        ("0", 0),
        ("64", 64),
        ("1K", K),
        ("1k", K),
        ("64M", 64 * M),
        ("2G", 2 * G),
        ("1KB", K),
        ("4KiB", 4 * K),
        (" 8m ", 8 * M),
        (128, 128),
    ],
)
def test_parse_size(text, expect):
    assert common.parse_size(text) == expect


@pytest.mark.parametrize("text", ["", "K", "1.5K", "-1", "1X", "1 K B", "abc"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError):
        common.parse_size(text)


def test_sweep_by_factor_like_nccl_tests():
    assert bench.sweep_sizes(K, 64 * M, 4) == [K * 4**i for i in range(9)]
    assert bench.sweep_sizes(K, 5 * K, 2) == [K, 2 * K, 4 * K]  # stops before passing maxbytes
    assert bench.sweep_sizes(8, 8, 2) == [8]


def test_sweep_by_bytes_when_factor_is_one():
    assert bench.sweep_sizes(0, 100, 1, 50) == [0, 50, 100]
    assert bench.sweep_sizes(0, 0, 1, 0) == [0]
    assert bench.sweep_sizes(10, 35, 1, 10) == [10, 20, 30]


@pytest.mark.parametrize("args", [(10, 5, 2, 1), (-1, 5, 2, 1), (0, 64, 2, 1), (0, 64, 1, 0)])
def test_sweep_rejects(args):
    with pytest.raises(ValueError):
        bench.sweep_sizes(*args)


def test_sizes_round_down_to_whole_elements_per_peer():
    # nccl-tests: count = size / itemsize / ranks; the row shows ranks * count * itemsize.
    assert bench.per_peer_count(1000, 3, 4) == 83
    assert bench.per_peer_count(1024, 4, 4) == 64
    assert bench.per_peer_count(7, 2, 4) == 0


def test_bus_bandwidth_formula():
    algbw, busbw = bench.bandwidths(2_000_000_000, 2.0, 4)
    assert algbw == pytest.approx(1.0)  # GB/s with GB = 1e9
    assert busbw == pytest.approx(1.0 * 3 / 4)
    assert bench.bandwidths(1000, 1e-6, 8)[1] == pytest.approx(1.0 * 7 / 8)
    assert bench.bandwidths(1000, 1.0, 1)[1] == 0.0  # one rank moves nothing over the "bus"
    assert bench.bandwidths(1000, 0.0, 4) == (0.0, 0.0)


# ---------------------------------------------------------------------------
# Uneven counts and the flex shape


@pytest.mark.parametrize("nranks", range(1, 10))
@pytest.mark.parametrize("count", [0, 1, 5, 1000])
def test_v_counts_are_uneven_but_every_rank_moves_the_even_size(nranks, count):
    counts = common.v_counts(nranks, count)
    assert all(c >= 0 for row in counts for c in row)
    for r in range(nranks):
        assert sum(counts[r]) == nranks * count  # sent by r
        assert sum(counts[s][r] for s in range(nranks)) == nranks * count  # received by r
    if nranks >= 2 and count >= 3:
        assert len({c for row in counts for c in row}) > 1
    assert counts == common.v_counts(nranks, count)  # deterministic: every rank computes the same


def test_v_counts_depend_on_rank_plus_peer():
    counts = common.v_counts(4, 300)
    assert counts[0] == [400, 200, 500, 100]
    assert counts[1] == counts[0][1:] + counts[0][:1]


@pytest.mark.parametrize("nranks", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("count", [0, 1, 7, 64, 1000, 1 << 18])
def test_flex_shape(nranks, count):
    experts, capacity, hidden = bench.flex_shape(count, nranks, 2, 1024)
    assert experts == 2 * nranks
    assert 1 <= hidden <= 1024
    assert experts * capacity * hidden <= nranks * count
    if count >= 2 and (count // 2) & (count // 2 - 1) == 0:  # powers of two fill exactly
        assert experts * capacity * hidden == nranks * count


# ---------------------------------------------------------------------------
# Deterministic data and the check


def test_block_values_match_the_pure_python_reference():
    for modulus in (127, 251, 2039, collectives_data.BIG_PRIME):
        for src, dst, start, n in [(0, 0, 0, 10), (3, 1, 0, 300), (5, 7, 1000, 50), (1, 2, 123456, 7)]:
            expect = [bench.expected_value(src, dst, start + i, modulus) for i in range(n)]
            assert bench.block_values(src, dst, n, modulus, start).tolist() == expect


@pytest.mark.parametrize("name", [d for d in bench.DTYPES if not bench.DTYPES[d].needs_torch])
def test_values_and_poison_are_exact_in_their_dtype(name):
    dtype = bench.DTYPES[name]
    values = np.arange(dtype.modulus + 1, dtype=np.int64)  # every value, and the poison (modulus)
    cast = values.astype(dtype.storage)
    assert cast.itemsize == dtype.itemsize
    assert (cast.astype(np.int64) == values).all()
    from mpi4py import MPI

    assert dtype.itemsize % getattr(MPI, dtype.mpi_type).Get_size() == 0  # the baseline moves the same bytes


def test_bfloat16_values_are_exact():
    torch = pytest.importorskip("torch")
    dtype = bench.DTYPES["bfloat16"]
    values = torch.arange(dtype.modulus + 1, dtype=torch.float32)
    assert torch.equal(values.to(torch.bfloat16).float(), values)


def test_gloo_is_timed_apart_after_the_turns_of_the_others(monkeypatch):
    timed = []
    monkeypatch.setattr(bench, "_time", lambda case, args: timed.append(case.algo) or len(timed))
    cases = [bench.Case(algo, 0, 0, lambda: None, lambda: None, lambda: 0, apart=algo == "gloo")
             for algo in ("mpi", "gloo", "linear")]
    args = bench.parse_args(["-r", "3", "-w", "0"])
    medians = bench._measure_group(cases, args)
    assert timed == ["mpi", "linear"] * 3 + ["gloo"] * 3
    assert medians == [3, 8, 4]  # the median sample of each, in the order of `cases`


def _reference_all_to_all(nranks: int, count: int, modulus: int) -> list[np.ndarray]:
    """What every rank receives, computed the slow way: rank s sends
    expected_value(s, d, i) to rank d, which stores it at d's block s."""
    sends = [
        [[bench.expected_value(s, d, i, modulus) for i in range(count)] for d in range(nranks)]
        for s in range(nranks)
    ]
    return [np.array([v for s in range(nranks) for v in sends[s][d]], dtype=np.int64) for d in range(nranks)]


def test_check_counts_zero_for_a_correct_exchange_and_catches_mistakes():
    nranks, count, modulus = 4, 9, 127
    received = _reference_all_to_all(nranks, count, modulus)
    for rank in range(nranks):
        blocks = [(src, rank, count) for src in range(nranks)]
        assert bench._count_wrong(received[rank], blocks, modulus) == 0
    blocks = [(src, 1, count) for src in range(nranks)]
    swapped = received[1].reshape(nranks, count)[[1, 0, 2, 3]].reshape(-1)
    assert bench._count_wrong(swapped, blocks, modulus) == 2 * count  # blocks from the wrong sources
    shifted = np.roll(received[1], 1)
    assert bench._count_wrong(shifted, blocks, modulus) == nranks * count
    poisoned = received[1].copy()
    poisoned[5] = modulus
    assert bench._count_wrong(poisoned, blocks, modulus) == 1


# ---------------------------------------------------------------------------
# Command line


def test_resolve_dtypes():
    def names(text, torch=True):
        return [d.name for d in bench.resolve_dtypes(text, have_torch=torch)]

    assert names("float") == ["float"]
    assert names("fp16") == ["half"] and names("float64") == ["double"] and names("char") == ["int8"]
    assert names("all") == list(bench.DTYPES)
    assert "bfloat16" not in names("all", torch=False)
    with pytest.raises(ValueError, match="torch"):
        bench.resolve_dtypes("bfloat16", have_torch=False)
    with pytest.raises(ValueError, match="does not support"):
        bench.resolve_dtypes("uint32", have_torch=True)


def test_defaults():
    args = bench.parse_args([])
    assert (args.minbytes, args.maxbytes, args.stepfactor) == (K, 64 * M, 4.0)
    assert (args.iters, args.warmup_iters, args.check) == (20, 5, 1)
    assert args.algos == ["linear", "2dh", "flex", "combine", "v", "v-plan"]
    assert [d.name for d in args.dtypes] == ["float"]
    assert args.np is None and args.json is None and not args.no_baseline


def test_flags():
    args = bench.parse_args(
        ["-b", "8", "-e", "128M", "-f", "2", "-n", "3", "-w", "0", "-c", "0"]
        + ["-d", "half", "--algo", "v,linear,v"]
    )
    assert args.sizes[0] == 8 and args.sizes[-1] == 128 * M and len(args.sizes) == 25
    assert (args.iters, args.warmup_iters, args.check) == (3, 0, 0)
    assert args.algos == ["v", "linear"]
    assert bench.parse_args(["-b", "0", "-e", "2M", "-i", "1M"]).sizes == [0, M, 2 * M]  # -i alone: by bytes


@pytest.mark.parametrize(
    "argv",
    [
        "--algo foo",
        "-d uint64",
        "-n 0",
        "-c -1",
        "-b 2M -e 1M",
        "--np 4 --local-size 3",
        "--np 0",
        "--hidden 0",
    ],
)
def test_bad_flags_exit_with_usage(argv, capsys):
    with pytest.raises(SystemExit) as info:
        bench.parse_args(argv.split())
    assert info.value.code == 2
    assert "error" in capsys.readouterr().err


# ---------------------------------------------------------------------------
# --baseline and --plot


@pytest.fixture
def with_torch(monkeypatch):
    """parse_args believes torch is installed (it only looks, never imports)."""
    monkeypatch.setattr(bench, "_have_torch", lambda: True)


@pytest.mark.parametrize(
    "argv, expect",
    [
        ([], ["mpi"]),
        (["--baseline", "gloo"], ["gloo"]),
        (["--baseline", "mpi,gloo"], ["mpi", "gloo"]),
        (["--baseline", " GLOO , mpi,gloo"], ["gloo", "mpi"]),  # order kept, repeats dropped
        (["--baseline", "none"], []),
        (["--no-baseline"], []),
        (["--no-baseline", "--baseline", "none"], []),
        (["--device", "cuda"], ["d2d"]),
        (["--device", "cuda", "--baseline", "d2d"], ["d2d"]),
        (["--device", "cuda", "--baseline", "none"], []),
    ],
)
def test_baseline_flag(argv, expect, with_torch):
    args = bench.parse_args(argv)
    assert args.baselines == expect
    # One ratio column per baseline; with none, the device's default column (all "-").
    assert args.ratio_columns == (expect or (["d2d"] if "cuda" in argv else ["mpi"]))


@pytest.mark.parametrize(
    "argv, message",
    [
        ("--baseline foo", "unknown baseline 'foo'"),
        ("--baseline mpi,", "unknown baseline ''"),
        ("--baseline none,mpi", "none cannot be combined with mpi"),
        ("--baseline d2d", "d2d does not apply to --device cpu"),
        ("--device cuda --baseline gloo", "gloo does not apply to --device cuda"),
        ("--device cuda --baseline mpi", "mpi does not apply to --device cuda"),
        ("--no-baseline --baseline gloo", "--no-baseline contradicts --baseline gloo"),
    ],
)
def test_bad_baselines_exit_with_usage(argv, message, with_torch, capsys):
    with pytest.raises(SystemExit) as info:
        bench.parse_args(argv.split())
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def _hide_module(monkeypatch, name):
    """importlib.util.find_spec finds no `name`, as if it were not installed."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda module, *a: None if module == name else real(module, *a))


def test_gloo_without_torch_fails_before_anything_runs(monkeypatch, launched, capsys):
    _hide_module(monkeypatch, "torch")
    with pytest.raises(SystemExit) as info:
        bench.main(["--baseline", "mpi,gloo"])
    assert info.value.code == 2
    assert "--baseline gloo needs torch" in capsys.readouterr().err
    assert launched == []  # nothing was launched
    assert bench.parse_args(["--baseline", "mpi"]).baselines == ["mpi"]  # the MPI baseline needs no torch


def test_plot_without_matplotlib_fails_before_the_sweep(monkeypatch, launched, capsys):
    _hide_module(monkeypatch, "matplotlib")
    with pytest.raises(SystemExit) as info:
        bench.main(["--plot", "sweep.png"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--plot needs matplotlib" in err and "pip install 'a2a[plots]'" in err
    assert launched == []
    assert bench.parse_args([]).plot is None  # no --plot, no matplotlib needed


def test_plot_is_an_optional_extra():
    import tomllib

    with open(os.path.join(REPO, "pyproject.toml"), "rb") as fh:
        extras = tomllib.load(fh)["project"]["optional-dependencies"]
    assert extras["plot"] == ["matplotlib"]


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _sweep_rows(baselines=("mpi", "gloo"), algos=("linear", "2dh"), sizes=(K, 64 * K, M), dtype="float"):
    """Rows shaped like the sweep's JSON records, with made-up numbers."""
    rows = []
    for size in sizes:
        for algo in (*algos, *baselines):
            algbw = size / 1e6 * (1 + len(algo) / 10)
            rows.append({"algo": algo, "size": size, "type": dtype, "algbw": algbw, "busbw": algbw * 3 / 4,
                         "baseline": algo in baselines, "ranks": 4, "num_nodes": 2, "local_size": 2})
    return rows


def test_plot_sweep_draws_a_png_with_predicted_curves(tmp_path):
    pytest.importorskip("matplotlib")
    from a2a.bench import plot

    rows = _sweep_rows() + _sweep_rows(dtype="half") + [dict(_sweep_rows()[0], size=0)]  # size 0: left out
    predicted = [("linear", size, size / 2e6) for size in (K, 64 * K, M)] + [("2dh", M, 1.0)]
    path = tmp_path / "sweep.png"
    plot.plot_sweep(rows, str(path), predicted=predicted)
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    plain = tmp_path / "plain.png"
    plot.plot_sweep(_sweep_rows(baselines=()), str(plain))  # no baseline: no ratio panel
    assert plain.read_bytes()[:8] == PNG_SIGNATURE
    alone = tmp_path / "predicted.png"
    plot.plot_sweep([], str(alone), predicted=predicted)  # a prediction without a measurement
    assert alone.read_bytes()[:8] == PNG_SIGNATURE
    with pytest.raises(ValueError, match="no rows or predicted points of positive size"):
        plot.plot_sweep([dict(rows[0], size=0)], str(tmp_path / "empty.png"), predicted=[("linear", 0, 1.0)])


def test_predicted_curves_come_from_the_scale_model():
    from a2a import sim

    assert set(bench.PREDICT_PRESETS) == set(sim.PRESETS)
    rows = _sweep_rows() + [dict(_sweep_rows()[0], algo="flex"), dict(_sweep_rows()[0], size=0)]
    curves = bench.predicted_curves(rows, "local", 4, 2)
    measured = sorted({(r["algo"], r["size"]) for r in rows
                       if r["algo"] in ("linear", "2dh") and not r["baseline"] and r["size"]})
    assert [(algo, size) for algo, size, _ in curves] == measured  # flex, baselines and size 0 left out
    topology = sim.preset("local", ranks=4, local_size=2)
    for algo, size, busbw in curves:
        assert busbw == pytest.approx(sim.predict(topology, algo, size).busbw / 1e9)


def test_predict_flag_defaults_by_device_and_rejects_unknown_presets(capsys):
    assert bench.parse_args([]).predict == "local"
    assert bench.parse_args(["--predict", "h100"]).predict == "h100"
    assert bench.parse_args(["--predict", "none"]).predict == "none"
    with pytest.raises(SystemExit):
        bench.parse_args(["--predict", "b200"])
    assert "unknown preset 'b200'" in capsys.readouterr().err


def test_plot_sweep_says_how_to_install_matplotlib(monkeypatch, tmp_path):
    from a2a.bench import plot

    _hide_module(monkeypatch, "matplotlib")
    with pytest.raises(RuntimeError, match=r"pip install 'a2a\[plots\]'"):
        plot.plot_sweep(_sweep_rows(), str(tmp_path / "x.png"))


# ---------------------------------------------------------------------------
# The progress line


class _Terminal(io.StringIO):
    """A stream that says it is a terminal."""

    def isatty(self):
        return True


class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


GROUPS = ["float 1K", "float 64M", "int8 1K", "int8 64M"]  # 10 rows each


def test_progress_shows_on_the_lead_terminal_once_the_sweep_takes_a_while():
    stream, clock = _Terminal(), _Clock()
    progress = common.Progress(GROUPS, 10, label="a2a.bench", stream=stream, after_s=2.0, clock=clock)
    progress.show(0)
    assert stream.getvalue() == ""  # not 2 s yet
    clock.now += 8.4
    progress.show(12)
    first = "[a2a.bench] 12/40 rows, float 64M, 8 s"
    assert stream.getvalue() == "\r" + first
    clock.now += 2
    progress.show(20)  # shorter: blanks out what is left of the longer line
    assert stream.getvalue().endswith("\r" + "[a2a.bench] 20/40 rows, int8 1K, 10 s".ljust(len(first)))
    progress.clear()
    assert stream.getvalue().endswith("\r" + " " * len(first) + "\r")
    before = stream.getvalue()
    progress.clear()  # nothing on screen: nothing written
    assert stream.getvalue() == before and "\n" not in before
    progress.show(39)
    assert stream.getvalue().endswith("[a2a.bench] 39/40 rows, int8 64M, 10 s")
    progress.clear()
    before = stream.getvalue()
    progress.show(40)  # done: no line (the footer follows)
    assert stream.getvalue() == before


@pytest.mark.parametrize("stream, enabled", [(_Terminal(), False), (io.StringIO(), True)])
def test_progress_stays_off_other_ranks_and_off_pipes_and_files(stream, enabled):
    clock = _Clock()
    progress = common.Progress(GROUPS, 10, label="a2a.bench", enabled=enabled, stream=stream, after_s=0.0, clock=clock)
    clock.now += 60
    progress.show(1)
    progress.clear()
    assert stream.getvalue() == ""
    assert not progress.active


# A child that prints like a relaunched sweep: comments, rows, a pause, a last line without newline.
CHILD = (
    "import sys, time\n"
    "print('# header'); print('  1024  x  linear'); print('  1024  x  mpi', flush=True)\n"
    "time.sleep(0.3)\n"
    "print('# note\\n'); sys.stdout.write('  4096  x  linear\\n# Avg bus bandwidth'); sys.stdout.flush()\n"
)


def test_forward_output_passes_stdout_on_unchanged_and_draws_progress_from_the_rows():
    expected = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, check=True).stdout
    stream, out = _Terminal(), io.BytesIO()
    progress = common.Progress(["float 1K", "float 4K"], 2, label="a2a.bench", stream=stream, after_s=0.0)
    code = common.forward_output([sys.executable, "-c", CHILD], dict(os.environ), progress, out=out, tick_s=0.05)
    assert code == 0
    assert out.getvalue() == expected  # byte for byte, the last partial line too
    shown = stream.getvalue()
    assert "\r[a2a.bench] 2/4 rows, float 4K, " in shown  # after the first two rows
    assert "[a2a.bench] 3/4 rows, float 4K, " in shown
    assert shown.endswith("\r") and shown.split("\r")[-2].strip() == ""  # erased at the end
    failing = common.forward_output([sys.executable, "-c", "raise SystemExit(3)"], dict(os.environ), progress,
                                    out=io.BytesIO(), tick_s=0.05)
    assert failing == 3


def test_relaunch_forwards_only_when_stderr_is_a_terminal(launched, monkeypatch):
    from a2a import launch

    forwarded = []
    monkeypatch.setattr(launch, "mpirun_command", lambda np, command: ["mpirun", "-np", str(np), *command])
    monkeypatch.setattr(common, "forward_output", lambda command, env, progress: forwarded.append(command) or 0)
    args = bench.parse_args(["-b", "1K", "-e", "4K"])
    off = bench._progress(args)  # stderr is not a terminal under pytest
    assert common.relaunch("a2a.bench", [], 2, None, default_np=4, default_local_size=2, progress=off) == 0
    assert len(launched) == 1 and forwarded == []
    on = bench._progress(args)
    on.active = True
    assert common.relaunch("a2a.bench", [], 2, None, default_np=4, default_local_size=2, progress=on) == 0
    assert len(launched) == 1 and forwarded == [["mpirun", "-np", "2", sys.executable, "-m", "a2a.bench"]]
    assert on.groups == ["float 1K", "float 4K"] and on.rows_per_group == 7  # mpi + the six algorithms


def _in_process_sweep(monkeypatch, capsys, stderr) -> tuple[str, str]:
    """(stdout, stderr) of a 1-rank sweep whose timings are fixed, so that
    two runs print the same bytes."""
    from a2a import launch

    monkeypatch.setattr(launch, "under_mpirun", lambda: False)
    monkeypatch.setattr(bench, "_measure_group", lambda cases, args: [1e-3 * (i + 1) for i in range(len(cases))])
    monkeypatch.setattr(common, "PROGRESS_AFTER_S", 0.0)
    monkeypatch.setattr(sys, "stderr", stderr)
    assert bench.main(["--np", "1", "-b", "1K", "-e", "16K", "-n", "1", "-w", "0", "--algo", "linear,v"]) == 0
    return capsys.readouterr().out, stderr.getvalue()


def test_progress_never_touches_stdout(monkeypatch, capsys):
    on_terminal, progress = _in_process_sweep(monkeypatch, capsys, _Terminal())
    on_pipe, nothing = _in_process_sweep(monkeypatch, capsys, io.StringIO())
    assert on_terminal == on_pipe  # byte for byte
    assert "[a2a.bench]" not in on_terminal and "\r" not in on_terminal
    assert nothing == ""
    assert "\r[a2a.bench] 0/9 rows, float 1K, 0 s" in progress  # 3 sizes x (mpi, linear, v)
    assert "\r[a2a.bench] 6/9 rows, float 16K" in progress
    assert progress.endswith("\r") and progress.split("\r")[-2].strip() == ""  # erased at the end


def test_strip_np():
    """The relaunch of both benches (a2a.bench, moe_runtime.bench) drops --np."""
    assert common.strip_np(["--np", "4", "-b", "1K"]) == ["-b", "1K"]
    assert common.strip_np(["-b", "1K", "--np=8", "--json", "x"]) == ["-b", "1K", "--json", "x"]
    assert common.strip_np(["--np", "4", "-T", "64"]) == ["-T", "64"]
    assert common.strip_np(["-T", "64", "--np=8", "--json", "x"]) == ["-T", "64", "--json", "x"]


def test_no_arguments_launch_four_ranks_as_two_emulated_nodes(launched):
    assert bench.main([]) == 0
    [(np_, command, env)] = launched
    assert np_ == 4
    assert command == [sys.executable, "-m", "a2a.bench"]
    assert env["A2A_LOCAL_SIZE"] == "2"


def test_np_is_stripped_and_local_size_passed_on(launched):
    assert bench.main(["--np", "6", "--local-size", "3", "-b", "1K"]) == 0
    [(np_, command, env)] = launched
    assert np_ == 6
    assert command == [sys.executable, "-m", "a2a.bench", "--local-size", "3", "-b", "1K"]
    assert env["A2A_LOCAL_SIZE"] == "3"
    assert "--np 6" in env[common.COMMAND_ENV]


def test_explicit_np_uses_the_real_topology(launched):
    bench.main(["--np", "2"])
    [(np_, _command, env)] = launched
    assert np_ == 2 and "A2A_LOCAL_SIZE" not in env


# ---------------------------------------------------------------------------
# Output


def _row(**kw):
    row = {"size": 1024, "count": 64, "type": "float", "redop": "none", "root": -1, "time_us": 12.5}
    row.update(algbw=0.08, busbw=0.06, wrong=0, algo="linear", ratios={"mpi": 1.5}, baseline=False)
    row.update(kw)
    return row


def test_row_lines_up_with_the_header():
    header = bench.header_lines()[1]
    line = bench.format_row(_row(size=67108864, count=4194304, time_us=24007.0, algbw=2.8, busbw=2.1))
    # Right-aligned columns: every header name ends where its value ends.
    header_ends = [m.end() for m in re.finditer(r"\S+", header) if m.group() not in ("#", "vs")]
    assert header_ends == [m.end() for m in re.finditer(r"\S+", line)]
    assert header.split()[1:10] == [
        "size",
        "count",
        "type",
        "redop",
        "root",
        "time",
        "algbw",
        "busbw",
        "#wrong",
    ]
    fields = line.split()
    assert fields[:5] == ["67108864", "4194304", "float", "none", "-1"]
    assert fields[-2:] == ["linear", "1.50x"]


def test_row_without_check_or_baseline():
    fields = bench.format_row(_row(wrong=None, ratios={}, algo="mpi")).split()
    assert fields[-3:] == ["N/A", "mpi", "-"]


def test_one_ratio_column_per_baseline():
    baselines = ["mpi", "gloo"]
    header = bench.header_lines(baselines)[1]
    assert header.split()[-4:] == ["vs", "MPI", "vs", "gloo"]
    line = bench.format_row(_row(ratios={"mpi": 0.5, "gloo": 4.25}), baselines)
    assert line.split()[-3:] == ["linear", "0.50x", "4.25x"]
    header_ends = [m.end() for m in re.finditer(r"\S+", header) if m.group() not in ("#", "vs")]
    assert header_ends == [m.end() for m in re.finditer(r"\S+", line)]
    assert bench.format_row(_row(ratios={"gloo": 2.0}), baselines).split()[-2:] == ["-", "2.00x"]
    units = bench.header_lines(baselines)[2]
    assert units.split()[-2:] == ["(algbw)", "(algbw)"]


def test_footer_gives_the_geomean_against_each_baseline():
    rows = [
        _row(busbw=1.0, ratios={"mpi": 0.5, "gloo": 2.0}),
        _row(busbw=3.0, ratios={"mpi": 2.0, "gloo": 8.0}),
        _row(busbw=2.0, algo="mpi", baseline=True, ratios={}),
        _row(busbw=0.5, algo="gloo", baseline=True, ratios={}),
    ]
    lines = bench.footer_lines(rows, ["linear"], ["mpi", "gloo"])
    assert "#   linear  avg busbw    2.000 GB/s   vs MPI (geomean of ratios): 1.00x, vs gloo: 4.00x" in lines
    assert "#   gloo    avg busbw    0.500 GB/s" in lines


def test_footer():
    rows = [_row(busbw=1.0), _row(busbw=3.0, algo="v", ratios={"mpi": 0.5}), _row(busbw=9.0, algo="mpi", baseline=True)]
    text = "\n".join(bench.footer_lines(rows, ["linear", "v"]))
    assert "# Out of bounds values : 0 OK" in text
    assert "# Avg bus bandwidth    : 2 " in text  # a2a rows only
    rows[1]["wrong"] = 3
    assert "# Out of bounds values : 3 FAILED" in "\n".join(bench.footer_lines(rows, ["linear", "v"]))


# ---------------------------------------------------------------------------
# Real runs


def test_one_rank_in_process(tmp_path, capsys, monkeypatch):
    from a2a import launch

    monkeypatch.setattr(launch, "under_mpirun", lambda: False)
    out = tmp_path / "one.json"
    code = bench.main(["--np", "1", "-b", "1K", "-e", "4K", "-n", "1", "-w", "0", "--json", str(out)])
    assert code == 0
    rows = json.loads(out.read_text())
    assert {r["algo"] for r in rows} == {"linear", "2dh", "flex", "combine", "v", "v-plan", "mpi"}
    assert all(r["wrong"] == 0 and r["ranks"] == 1 for r in rows)
    assert "# Avg bus bandwidth" in capsys.readouterr().out


def test_wrong_elements_fail_the_run(tmp_path, capsys, monkeypatch):
    from a2a import launch

    monkeypatch.setattr(launch, "under_mpirun", lambda: False)
    monkeypatch.setattr(bench, "_count_wrong", lambda got, blocks, modulus: 1)
    out = tmp_path / "bad.json"
    code = bench.main(
        ["--np", "1", "-b", "1K", "-e", "1K", "-n", "1", "--algo", "linear", "--json", str(out)]
    )
    assert code == 1
    assert all(r["wrong"] == 1 for r in json.loads(out.read_text()))
    assert "FAILED" in capsys.readouterr().out


def _clean_env() -> dict[str, str]:
    keys = ("OMPI_", "PMIX_", "PMI_", "MPI_LOCALNRANKS", "A2A_LOCAL_SIZE", common.COMMAND_ENV)
    return {k: v for k, v in os.environ.items() if not k.startswith(keys)}


def _run(argv: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "a2a.bench", *argv],
        check=False,
        cwd=REPO,
        env=_clean_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_self_launched_sweep_on_two_ranks(tmp_path):
    out = tmp_path / "bench.json"
    proc = _run(
        [
            "--np",
            "2",
            "-b",
            "1K",
            "-e",
            "64K",
            "-f",
            "4",
            "-n",
            "2",
            "-w",
            "1",
            "--algo",
            "all",
            "--json",
            str(out),
        ]
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())
    sizes = [K, 4 * K, 16 * K, 64 * K]
    for algo in ("linear", "2dh", "flex", "combine", "v", "v-plan", "mpi"):
        mine = [r for r in rows if r["algo"] == algo]
        assert [r["size"] for r in mine] == sizes, algo
        assert all(r["wrong"] == 0 and r["ranks"] == 2 and r["time_us"] > 0 for r in mine)
        assert all((r["ratio"] is None) == (algo == "mpi") for r in mine)
        assert all(r["baseline"] == (algo == "mpi") for r in mine)
    assert all(r["baseline_algbw"] > 0 and "--np 2" in r["command"] for r in rows)
    table = [line.split() for line in proc.stdout.splitlines() if line and not line.startswith("#")]
    assert len(table) == len(rows) == 7 * len(sizes)
    assert all(fields[8] == "0" for fields in table)  # the #wrong column
    assert "# Out of bounds values : 0 OK" in proc.stdout
    assert "# Avg bus bandwidth" in proc.stdout


def test_two_emulated_nodes_with_2dh_underneath(tmp_path):
    out = tmp_path / "bench.json"
    argv = ["--np", "4", "--local-size", "2", "-b", "1001", "-e", "16K", "-f", "4", "-n", "1", "-w", "0"]
    proc = _run([*argv, "-d", "half", "--inner-algo", "2dh", "--no-baseline", "--json", str(out)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())
    assert {r["algo"] for r in rows} == {"linear", "2dh", "flex", "combine", "v", "v-plan"}
    assert all(r["wrong"] == 0 and r["num_nodes"] == 2 and r["local_size"] == 2 for r in rows)
    # Rounded down to whole elements per peer (4 ranks x 2 B), and for flex to whole (E, C, M) shapes.
    assert [r["size"] for r in rows if r["algo"] == "linear"] == [1000, 4000, 16016]
    for r in rows:
        if r["algo"] == "flex":
            experts, capacity, hidden = r["shape"]
            assert experts == 8 and r["size"] == experts * capacity * hidden * 2 <= r["requested_size"]


def test_gloo_baseline_and_plot_on_two_ranks(tmp_path):
    """--baseline mpi,gloo in one mpirun: a gloo row per size, checked like
    the others, its ratio in the table and the JSON, and a row of a2a over
    the same gloo group (a2a/gloo, what a torchrun job gets); --plot writes a PNG."""
    pytest.importorskip("torch")
    pytest.importorskip("matplotlib")
    out, picture = tmp_path / "bench.json", tmp_path / "bench.png"
    argv = ["--np", "2", "-b", "1K", "-e", "16K", "-f", "4", "-n", "2", "-w", "1", "-r", "2", "-d", "half"]
    proc = _run([*argv, "--algo", "linear,2dh", "--baseline", "mpi,gloo", "--json", str(out), "--plot", str(picture)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())
    sizes = [K, 4 * K, 16 * K]
    for algo in ("linear", "2dh", "a2a/gloo", "mpi", "gloo"):
        mine = [r for r in rows if r["algo"] == algo]
        assert [r["size"] for r in mine] == sizes, algo
        assert all(r["wrong"] == 0 and r["time_us"] > 0 and r["type"] == "half" for r in mine), algo
        assert all(r["baseline"] == (algo in ("mpi", "gloo")) for r in mine)
    for r in rows:
        assert set(r["baseline_algbws"]) == {"mpi", "gloo"} and r["baseline_algbw"] == r["baseline_algbws"]["mpi"]
        if r["baseline"]:
            assert r["ratios"] == {} and r["ratio"] is None
        else:
            assert r["ratios"]["gloo"] == pytest.approx(r["algbw"] / r["baseline_algbws"]["gloo"])
            assert r["ratio"] == r["ratios"]["mpi"]
    header = next(line for line in proc.stdout.splitlines() if "#wrong" in line)
    assert header.split()[-4:] == ["vs", "MPI", "vs", "gloo"]
    table = [line.split() for line in proc.stdout.splitlines() if line and not line.startswith("#")]
    assert [fields[9] for fields in table] == ["linear", "2dh", "a2a/gloo", "mpi", "gloo"] * len(sizes)
    assert all(fields[8] == "0" for fields in table)
    assert "# baseline: gloo = torch" in proc.stdout and "# a2a/gloo = a2a's linear all-to-all" in proc.stdout
    assert "vs gloo: " in proc.stdout  # the footer's geomean
    assert "[a2a.bench]" not in proc.stderr  # stderr is a pipe here: no progress line
    assert picture.read_bytes()[:8] == PNG_SIGNATURE


# ---------------------------------------------------------------------------
# --cluster: the namespace cluster (a2a.cluster) launches the ranks


def test_cluster_shape_and_rate_are_read():
    args = bench.parse_args(["--cluster", "4x2", "--rate", "10gbit"])
    assert args.cluster == (4, 2) and args.rate == "10gbit"
    assert bench.parse_args([]).cluster is None


@pytest.mark.parametrize(
    "argv, message",
    [
        ("--cluster 4", "expected NODESxRANKS_PER_NODE such as 4x2"),
        ("--cluster 0x2", "expected NODESxRANKS_PER_NODE"),
        ("--cluster 2x2 --np 4", "drop --np"),
        ("--cluster 2x2 --local-size 2", "drop --local-size"),
        ("--rate 1gbit", "--rate shapes the namespace cluster's links: it needs --cluster"),
        ("--cluster 2x2 --rate fast", "positive number with kbit, mbit or gbit"),
    ],
)
def test_bad_cluster_arguments_exit_with_usage(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        bench.parse_args(argv.split())
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_cluster_runs_the_same_command_on_its_nodes(monkeypatch):
    from a2a import cluster, launch

    calls = []
    monkeypatch.setattr(launch, "under_mpirun", lambda: False)
    monkeypatch.setattr(cluster, "run", lambda *a, env: calls.append((a, env)) or 0)
    monkeypatch.delenv("A2A_LOCAL_SIZE", raising=False)
    assert bench.main(["--cluster", "4x2", "--rate", "1gbit", "-b", "1K"]) == 0
    [((nodes, local, command, rate), env)] = calls
    assert (nodes, local, rate) == (4, 2, "1gbit")
    assert command == [sys.executable, "-m", "a2a.bench", "--cluster", "4x2", "--rate", "1gbit", "-b", "1K"]
    assert env[common.LINK_ENV] == "1gbit" and "--cluster 4x2" in env[common.COMMAND_ENV]
    assert common.COMMAND_ENV not in os.environ  # passed to the ranks alone


def test_cluster_refuses_emulated_nodes(monkeypatch):
    from a2a import launch

    monkeypatch.setattr(launch, "under_mpirun", lambda: False)
    monkeypatch.setenv("A2A_LOCAL_SIZE", "2")
    with pytest.raises(SystemExit, match="unset A2A_LOCAL_SIZE"):
        bench.main(["--cluster", "2x2"])
