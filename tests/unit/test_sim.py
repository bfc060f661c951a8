"""a2a.sim, the scale model: its phases against the implementation's (bytes
and messages per phase), Tutel's Figure 18 with the A100 preset, the fit
(recovering known parameters; the local preset from its committed
measurement, with the linear / 2DH ratios within 25%), the loader and the
command line. No timing here: the measurement is committed data."""

from __future__ import annotations

import builtins
import glob
import json
import math
import os

import numpy as np
import pytest

from a2a import sim
from a2a.sim import __main__ as cli
from a2a.sim import fitting

MIB = 1 << 20
DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")
LOCAL_RUNS = sorted(glob.glob(os.path.join(DATA, "sim_local_*.json")))
# docs/scaling.md states these for the committed measurement (rms 37.7%: absolute times on the shared
# host moved by up to 4x between runs; the ratios, measured within a run, did not).
LOCAL_RMS_MAX = 0.40
RATIO_ERROR_MAX = 0.25


def a100(ranks, check="none"):
    return sim.preset("a100", ranks=ranks).replace(check=check)


# ---------------------------------------------------------------------------
# The phases are the implementation's


def test_linear_phase_moves_what_the_exchange_moves():
    top = sim.preset("a100", ranks=64)
    p = sim.predict(top, "linear", 64 * MIB)
    assert [ph.name for ph in p.phases] == ["check", "exchange"]
    exchange = p.phases[1]
    assert exchange.bytes == 64 * MIB and exchange.messages == 64  # W messages of S/W, the self one included
    assert p.time_s == pytest.approx(sum(ph.time_s for ph in p.phases))


def test_2dh_phases_are_algorithm_2s():
    top = sim.preset("a100", ranks=64)  # 8 nodes x 8
    p = sim.predict(top, "2dh", 64 * MIB)
    by_name = {ph.name: ph for ph in p.phases}
    assert list(by_name) == ["check", "copy1", "intra", "copy2", "inter"]
    assert by_name["copy1"].bytes == by_name["copy2"].bytes == 64 * MIB
    assert by_name["copy1"].messages == 64  # W chunks transposed
    assert by_name["intra"].messages == 8 and by_name["intra"].bytes == 64 * MIB  # L rows of S/L
    assert by_name["inter"].messages == 8 and by_name["inter"].bytes == 64 * MIB  # N rows of S/N


@pytest.mark.parametrize("nodes,local", [(1, 8), (8, 1)])
def test_degenerate_2dh_is_linear(nodes, local):
    top = sim.preset("a100").replace(nodes=nodes, local_size=local)
    assert sim.predict(top, "2dh", MIB).phase_times()["exchange"] == sim.predict(top, "linear", MIB).phase_times()[
        "exchange"]


def test_size_is_rounded_down_to_whole_chunks_and_busbw():
    top = sim.preset("a100", ranks=64)
    p = sim.predict(top, "linear", 1000)
    assert p.size == 960
    assert p.busbw == pytest.approx(960 / p.time_s * 63 / 64)


def test_in_band_check_rides_on_every_exchange():
    """On MPI the check travels in the call's own exchanges, at every size and for
    2DH too: no message and no byte of its own, `in_band_cost` times the CPU time
    of the exchanges that carry it (linear's one, 2DH's two)."""
    top = sim.preset("local", ranks=4, local_size=2)
    for size in (1024, 4 * (16 << 10) + 4, 16 << 20):
        linear = sim.predict(top, "linear", size)
        check, exchange = linear.phases[0], linear.phases[1]
        assert (check.name, check.bytes, check.messages) == ("check", 0, 0)
        assert check.time_s == pytest.approx(top.in_band_cost * exchange.time_s)
        two_dh = sim.predict(top, "2dh", size).phase_times()
        assert two_dh["check"] == pytest.approx(top.in_band_cost * (two_dh["intra"] + two_dh["inter"]))
    assert "check" not in sim.predict(top.replace(check="none"), "2dh", 1024).phase_times()


def test_flex_layout_and_paths_follow_the_library():
    # docs/algorithms.md: W = 4, E = 8, C = 4, M = 8, float32: chunk 256 B.
    dispatch = sim.flex_layout((8, 4, 8), 0, 1, 4, 4)
    assert dispatch == sim.FlexLayout(1, 256, 2, 128) and dispatch.chunk_bytes == 256
    combine = sim.flex_layout((2, 16, 8), 1, 0, 4, 4)
    assert combine == sim.FlexLayout(2, 128, 1, 256)
    mpi, nccl = sim.preset("local", ranks=4, local_size=2), sim.preset("a100", ranks=16)
    assert sim.flex_path(mpi, dispatch, "linear") == "packed"  # small: packed
    assert sim.flex_path(mpi, dispatch, "2dh") == "packed"
    big = sim.FlexLayout(1, 256 << 10, 2, 128 << 10)  # pieces of 128 KiB, 2 per peer
    assert sim.flex_path(mpi, big, "linear") == "pieces"
    many = sim.FlexLayout(1, 256 << 10, 128, 2 << 10)  # 128 pieces of 2 KiB: too many
    assert sim.flex_path(mpi, many, "linear") == "datatypes"
    assert sim.flex_path(nccl, many, "linear") == "packed"  # no datatypes without MPI
    assert sim.flex_path(mpi, sim.FlexLayout(1, 4096, 1, 4096), "linear") == "contiguous"
    with pytest.raises(ValueError, match="not divisible"):
        sim.flex_layout((6, 4, 8), 0, 1, 4, 4)


def test_flex_packed_adds_the_unpack_copy():
    top = sim.preset("local", ranks=4, local_size=2)
    layout = sim.flex_layout((8, 4, 8), 0, 1, 4, 4)
    p = sim.predict_flex(top, "2dh", layout)
    assert [ph.name for ph in p.phases] == ["check", "copy1", "intra", "copy2", "inter", "unpack"]
    assert p.phases[-1].messages == 2 * 4  # concat_outer x W blocks
    pieces = sim.predict_flex(top, "linear", sim.FlexLayout(1, 256 << 10, 2, 128 << 10))
    assert pieces.phases[-1].messages == 4 * 2  # W peers x 2 pieces


@pytest.mark.parametrize("algo", ["linear", "2dh"])
@pytest.mark.parametrize("nodes,local", [(2, 2), (4, 2), (2, 4), (3, 3)])
def test_v_with_even_counts_is_the_uniform_call(algo, nodes, local):
    """The matrix path of predict_v (per-rank traffic) against the symmetric formulas."""
    top = sim.preset("local").replace(nodes=nodes, local_size=local)
    ranks = nodes * local
    even = np.full((ranks, ranks), 4096)
    by_matrix = sim.predict_v(top, algo, even)
    by_size = sim.predict_v(top, algo, size_bytes=4096 * ranks)
    assert by_matrix.phase_times() == pytest.approx(by_size.phase_times())
    uniform = sim.predict(top, algo, 4096 * ranks).phase_times()
    planned = sim.predict_v(top, algo, even, plan=False).phase_times()
    assert planned == pytest.approx(uniform)
    assert set(by_matrix.phase_times()) - set(uniform) <= {"counts check", "counts", "relay counts"}


def test_v_uneven_counts_cost_the_slowest_rank():
    top = sim.preset("local").replace(nodes=2, local_size=2)
    counts = np.full((4, 4), 4096)
    heavy = counts.copy()
    heavy[0, 3] = 4096 * 8  # rank 0 sends much more to rank 3
    assert sim.predict_v(top, "linear", heavy).time_s > sim.predict_v(top, "linear", counts).time_s
    with pytest.raises(ValueError, match="4 x 4"):
        sim.predict_v(top, "linear", np.ones((3, 3)))


def test_bad_arguments():
    top = sim.preset("a100")
    with pytest.raises(ValueError, match="algo"):
        sim.predict(top, "ring", MIB)
    with pytest.raises(ValueError, match="size_bytes"):
        sim.predict(top, "linear", -1)
    with pytest.raises(ValueError, match="multiple"):
        top.with_ranks(60)
    with pytest.raises(ValueError, match="unknown preset"):
        sim.preset("tpu")
    with pytest.raises(ValueError, match="intra_bandwidth"):
        top.replace(intra_bandwidth=0)
    with pytest.raises(ValueError, match="check"):
        top.replace(check="maybe")


# ---------------------------------------------------------------------------
# Tutel's Figure 18 with the A100 preset


def test_figure_18_qualitatively():
    """1 MiB: 2DH faster from 64 GPUs on. 256 MiB: linear faster at 64, 2DH at 2048+.
    32 MiB: linear at 64, 2DH at scale (Tutel, Appendix A.5)."""
    for w in (64, 256, 2048, 4096):
        assert sim.predict(a100(w), "2dh", MIB).time_s < sim.predict(a100(w), "linear", MIB).time_s
    for size in (32 * MIB, 256 * MIB):
        assert sim.predict(a100(64), "linear", size).time_s < sim.predict(a100(64), "2dh", size).time_s
        for w in (2048, 4096):
            assert sim.predict(a100(w), "2dh", size).time_s < sim.predict(a100(w), "linear", size).time_s
    scan = sim.power_of_two_ranks(8, 4096)
    crossovers = [sim.crossover(a100(64), size, scan) for size in (MIB, 32 * MIB, 256 * MIB)]
    assert crossovers[0] <= 64 and 64 < crossovers[1] <= crossovers[2] <= 2048
    # The library's own argument check (a round over the host) does not change the picture.
    assert sim.crossover(a100(64, "round"), MIB, scan) <= 64


def test_crossover_none_when_2dh_never_wins():
    assert sim.crossover(a100(64), 16 << 30, [16, 32, 64]) is None


# ---------------------------------------------------------------------------
# The fit


def synthetic(truth, shapes, sizes):
    rows = []
    for ranks, local in shapes:
        for size in sizes:
            for algo in ("linear", "2dh"):
                p = sim.predict(truth.with_ranks(ranks, local), algo, size)
                rows.append(fitting.Measurement(algo, p.size, ranks, local, p.time_s))
    return rows


def test_fit_recovers_known_parameters():
    start = sim.preset("local").replace(intra_latency=1e-6, copy_latency=1e-6)
    truth = start.replace(intra_bandwidth=3.3e9, intra_latency=7e-6, intra_half_message=9000.0,
                          copy_bandwidth=5.5e9, copy_latency=1.5e-6, sharing_exponent=1.6)
    names = ("intra_bandwidth", "intra_latency", "intra_half_message", "copy_bandwidth", "copy_latency",
             "sharing_exponent", "nic_bandwidth")
    rows = synthetic(truth, [(4, 2), (8, 2), (16, 4)], [1 << k for k in range(10, 25, 2)])
    result = sim.fit(start, rows, names)
    assert result.kept == ("nic_bandwidth",)  # emulated: no row depends on the NICs
    assert result.max_error < 1e-6
    for name in names[:-1]:
        assert getattr(result.topology, name) == pytest.approx(getattr(truth, name), rel=1e-3), name


def test_fit_rejects_unknown_parameters_and_no_rows():
    with pytest.raises(ValueError, match="positive start"):
        sim.fit(sim.preset("local"), synthetic(sim.preset("local"), [(4, 2)], [1024]), ["intra_latency"])
    with pytest.raises(ValueError, match="not a parameter"):
        sim.fit(sim.preset("local"), synthetic(sim.preset("local"), [(4, 2)], [1024]), ["speed"])
    with pytest.raises(ValueError, match="no measurements"):
        sim.fit(sim.preset("local"), [])


def test_local_preset_is_the_fit_of_its_committed_measurement():
    """The committed runs (tests/data/sim_local_*.json: 2 x 2 and 4 x 2 emulated
    nodes, linear and 2dh), fitted again from a start away from the preset, give
    the preset's numbers, within the stated error; and the model predicts each
    measured linear / 2DH ratio within 25%."""
    assert len(LOCAL_RUNS) == 2, "the committed measurement is missing"
    rows = []
    for path in LOCAL_RUNS:
        rows += sim.load_measurements(path)[0]
    preset = sim.preset("local")
    names = sim.FIT_PARAMETERS["local"]
    start = preset.replace(**{name: getattr(preset, name) * (1.5 if i % 2 else 0.7) for i, name in enumerate(names)})
    result = sim.fit(start, fitting.median_rows(rows), names)
    assert len(result.rows) == 32
    for name in result.fitted:
        assert getattr(result.topology, name) == pytest.approx(getattr(preset, name), rel=0.02), name
    assert result.rms_error <= LOCAL_RMS_MAX
    ratios = fitting.ratio_rows(result.rows)
    assert {(r["nodes"], r["local_size"]) for r in ratios} == {(2, 2), (4, 2)}
    bad = [r for r in ratios if abs(r["error"]) > RATIO_ERROR_MAX]
    assert not bad, bad


# ---------------------------------------------------------------------------
# Loading rows


def bench_row(**fields):
    row = {"size": 4096, "count": 256, "type": "float", "time_us": 50.0, "algo": "linear", "baseline": False,
           "ranks": 4, "local_size": 2, "num_nodes": 2, "inner_algo": None, "shape": [1024]}
    row.update(fields)
    return row


def test_loader_reads_bench_rows_and_skips_baselines(tmp_path):
    rows = [bench_row(), bench_row(algo="2dh", time_us=80.0), bench_row(algo="mpi", baseline=True),
            bench_row(algo="flex", shape=[8, 4, 32], inner_algo="linear"), bench_row(algo="v", inner_algo="2dh"),
            bench_row(algo="ring")]
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(rows))
    measurements, skipped = sim.load_measurements(path)
    assert [m.algo for m in measurements] == ["linear", "2dh", "flex", "v"]
    assert measurements[0].time_s == pytest.approx(50e-6)
    assert len(skipped) == 2 and "baseline" in skipped[0] and "ring" in skipped[1]
    for m in measurements:  # every kind predicts
        assert sim.predict_measurement(sim.preset("local"), m).time_s > 0
    # The same fields from another writer: nccl-tests' time in us, num_nodes instead of local_size.
    other = [{"algo": "2dh", "size": 4096, "time": 12.5, "ranks": 8, "num_nodes": 4}]
    (tmp_path / "other.json").write_text(json.dumps({"rows": other}))
    [m] = sim.load_measurements(tmp_path / "other.json")[0]
    assert (m.ranks, m.local_size, m.time_s) == (8, 2, pytest.approx(12.5e-6))


NCCL_TESTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "nccl_tests")


@pytest.mark.parametrize("name, algo, ranks, local_size, rows", [
    ("nccl_tests_ext_alltoall_2x2_2dh.txt", "2dh", 4, 2, 4),  # ours: "# a2a: ... algorithm 2dh", "node N"
    ("alltoall_perf_2.19.6_8xH100.txt", "linear", 8, 8, 21),  # NVIDIA's: one host, size 0 skipped
    ("alltoall_perf_2023_2x8xA100.txt", "linear", 16, 8, 11),  # two hosts; no "test starting" line
])
def test_loader_reads_alltoall_perf_output(name, algo, ranks, local_size, rows):
    measurements, skipped = sim.load_measurements(os.path.join(NCCL_TESTS, name))
    assert len(measurements) == rows and all(m.size > 0 for m in measurements)
    assert {(m.algo, m.ranks, m.local_size) for m in measurements} == {(algo, ranks, local_size)}
    assert all("size 0" in line for line in skipped)


def test_loader_refuses_other_programs_and_text(tmp_path):
    with open(os.path.join(NCCL_TESTS, "nccl_tests_ext_alltoall_2x2_2dh.txt"), encoding="utf-8") as fh:
        other = fh.read()
    (tmp_path / "v.txt").write_text(other.replace("alltoall_perf", "alltoallv_perf"))
    with pytest.raises(ValueError, match="fitted to alltoall_perf"):
        sim.load_measurements(tmp_path / "v.txt")
    (tmp_path / "junk.txt").write_text("size time\n1 2\n")
    with pytest.raises(ValueError, match="neither JSON nor nccl-tests output"):
        sim.load_measurements(tmp_path / "junk.txt")


@pytest.mark.parametrize("row,message", [
    ({"algo": "linear", "size": 1, "ranks": 4, "local_size": 2}, "no time"),
    ({"algo": "linear", "size": 1, "time_us": 1, "local_size": 2}, "'ranks'"),
    ({"algo": "linear", "size": 1, "time_us": 1, "ranks": 4}, "local_size"),
    ({"algo": "linear", "size": 1, "time_us": 0, "ranks": 4, "local_size": 2}, "> 0"),
    ({"algo": "flex", "size": 1, "time_us": 1, "ranks": 4, "local_size": 2, "type": "float"}, "'shape'"),
    ({"algo": "linear", "size": 1, "time_us": 1, "ranks": 6, "local_size": 4}, "whole nodes"),
])
def test_loader_errors_name_the_row(tmp_path, row, message):
    path = tmp_path / "rows.json"
    path.write_text(json.dumps([row]))
    with pytest.raises(ValueError, match=message) as info:
        sim.load_measurements(path)
    assert "row 0" in str(info.value)


def test_median_rows_merge_runs():
    rows = [fitting.Measurement("linear", 64, 4, 2, t) for t in (3.0, 1.0, 2.0)]
    [merged] = fitting.median_rows(rows + [fitting.Measurement("2dh", 64, 4, 2, 5.0)])[:1]
    assert merged.time_s == 2.0


# ---------------------------------------------------------------------------
# The command line


def test_predict_json_records(tmp_path, capsys):
    out = tmp_path / "pred.json"
    assert cli.main(["predict", "--preset", "a100,h100", "--ranks", "64,2048", "--sizes", "1M,256M", "--check",
                     "none", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "crossover" in text and "1M:" in text and "256M:" in text
    records = json.loads(out.read_text())
    assert len(records) == 2 * 2 * 2 * 2
    record = records[0]
    assert {"preset", "ranks", "size", "algo", "time_s", "phases", "busbw"} <= set(record)
    assert record["time_s"] == pytest.approx(sum(record["phases"].values()))


def test_predict_plot(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "fig.png"
    assert cli.main(["predict", "--ranks", "64,128", "--sizes", "1M", "--plot", str(out), "--plot-y", "busbw"]) == 0
    assert out.read_bytes()[:4] == b"\x89PNG"


def test_predict_plot_without_matplotlib(tmp_path, monkeypatch, capsys):
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    assert cli.main(["predict", "--ranks", "64", "--sizes", "1M", "--plot", str(tmp_path / "x.png")]) == 2
    assert "needs matplotlib" in capsys.readouterr().err


def test_fit_command_and_params_round_trip(tmp_path, capsys):
    truth = sim.preset("local").replace(intra_bandwidth=2e9)
    rows = [{"algo": m.algo, "size": m.size, "time_s": m.time_s, "ranks": m.ranks, "local_size": m.local_size}
            for m in synthetic(truth, [(4, 2), (8, 2)], [1 << k for k in range(10, 24, 3)])]
    (tmp_path / "b.json").write_text(json.dumps(rows))
    out = tmp_path / "fitted.json"
    assert cli.main(["fit", str(tmp_path / "b.json"), "--out", str(out), "--json", str(tmp_path / "r.json")]) == 0
    text = capsys.readouterr().out
    assert "error: rms" in text and "linear / 2dh" in text
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["rms_error"] < 1e-6 and len(report["rows"]) == len(rows)
    assert cli.load_topology(str(out)).intra_bandwidth == pytest.approx(2e9, rel=1e-4)
    assert cli.main(["predict", "--params", str(out), "--ranks", "4", "--local-size", "2", "--sizes", "1M"]) == 0
    assert cli.main(["predict", "--params", str(tmp_path / "b.json")]) == 2
    assert "a2a.sim.topology" in capsys.readouterr().err


def test_cli_errors(capsys):
    assert cli.main(["predict", "--ranks", "60"]) == 2
    assert "not a whole number of nodes" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["predict", "--sizes", "1X"])
    assert cli.main(["presets"]) == 0
    assert "a100:" in capsys.readouterr().out


def test_every_preset_is_sane():
    for name, top in sim.PRESETS.items():
        assert top.name == name
        p = sim.predict(top, "linear", MIB)
        assert 0 < p.time_s < 1 and math.isfinite(p.busbw)
