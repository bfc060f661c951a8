"""python -m moe_runtime.bench: its command line, its pure helpers, the GShard
peer against the layer (one rank, in this process), and one --quick run on
2 ranks through the launcher. No timing is asserted: benchmarks are not
timed tests."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys

import pytest

from a2a.bench import common
from moe_runtime.bench import __main__ as cli
from moe_runtime.bench import dynamic as bench_dynamic
from moe_runtime.bench import layer, layer_measure, layer_options, layer_summary, layer_tables

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ---------------------------------------------------------------------------
# Command line


def test_defaults_are_the_full_run():
    args = layer_options.parse_args([])
    for name, value in layer_options.DEFAULTS.items():
        assert getattr(args, name) == value, name
    assert (args.threads, args.dtype, args.np, args.json, args.plot) == (1, "float32", None, None, None)
    assert args.factors == [1.0, 2.0, 4.0, 8.0] and args.degrees == [1, 2, 4, 8]
    assert args.algos == ["linear", "2dh"]


def test_quick_preset_and_flags_that_override_it():
    args = layer_options.parse_args(["--quick"])
    for name, value in layer_options.QUICK.items():
        assert getattr(args, name) == value, name
    args = layer_options.parse_args(["--quick", "-T", "96", "--factors", "1,4", "--algos", "2dh", "-d", "bf16"])
    assert (args.tokens, args.factors, args.algos, args.dtype) == (96, [1.0, 4.0], ["2dh"], "bfloat16")
    assert args.model_dim == layer_options.QUICK["model_dim"]


def test_flags():
    args = layer_options.parse_args(
        ["-T", "512", "-M", "64", "-H", "128", "-E", "4", "-k", "1", "--degrees", "1,4", "--peer-tokens", "2048",
         "--peer-factors", "1,2", "-w", "0", "-r", "5", "--tune-repeats", "2", "--threads", "2", "-d", "double"]
    )
    assert (args.tokens, args.model_dim, args.hidden, args.experts, args.top_k) == (512, 64, 128, 4, 1)
    assert (args.degrees, args.peer_tokens, args.peer_factors) == ([1, 4], [2048], [1.0, 2.0])
    assert (args.warmup, args.repeats, args.tune_repeats, args.threads, args.dtype) == (0, 5, 2, 2, "float64")
    assert layer_options.parse_args(["--no-peer"]).peer_tokens == []  # no peer: no comparison cases
    assert layer_options.parse_args(["--peer-tokens", "0"]).peer_tokens == []


@pytest.mark.parametrize(
    "argv",
    [
        "--algos foo",
        "--algos linear,linear",
        "--degrees 0",
        "--degrees 1,1",
        "--factors 0",
        "--factors -1",
        "--factors 1,x",
        "--peer-factors 1,1",
        "--dropless-factors 0",
        "--dynamic-steps -1",
        "-T -1",
        "-T 0 --peer-tokens 0",  # no sweep and no comparison: nothing to measure
        "--transport mpi",  # the transport of CUDA buffers, without --device cuda
        "--device gpu",
        "--quick --gpu-step",
        "-r 0",
        "-w -1",
        "--tune-repeats 0",
        "--threads 0",
        "-k 9",
        "-d half",
        "--np 0",
        "--np 4 --local-size 3",
        "-E 3",  # neither a multiple nor a divisor of the 4 default ranks
        "-E 2 -H 1023",  # 2 ranks share each expert: H must split in 2
    ],
)
def test_bad_flags_exit_with_usage(argv, capsys, monkeypatch):
    from a2a import launch

    monkeypatch.setattr(launch, "under_mpirun", lambda: False)
    with pytest.raises(SystemExit) as info:
        layer_options.parse_args(argv.split())
    assert info.value.code == 2
    assert "error" in capsys.readouterr().err


def test_plot_without_matplotlib_fails_before_the_run(monkeypatch, capsys):
    from a2a.bench import plot

    monkeypatch.setattr(plot, "matplotlib_missing", lambda flag="--plot": "--plot needs matplotlib (test)")
    with pytest.raises(SystemExit) as info:
        layer_options.parse_args(["--plot", "x.png"])
    assert info.value.code == 2 and "--plot needs matplotlib (test)" in capsys.readouterr().err


def test_experts_may_be_shared_by_ranks():
    assert layer_options.parse_args(["-E", "2", "--np", "4"]).experts == 2
    assert layer_options.layout_error(layer_options.parse_args(["-E", "16"]), 8) is None
    assert "multiple or a divisor" in layer_options.layout_error(layer_options.parse_args(["-E", "16"]), 6)


def test_device_is_cpu_unless_asked():
    args = layer_options.parse_args([])
    assert (args.device, args.transport, layer_options.default_np(args)) == ("cpu", None, layer_options.DEFAULT_NP)
    args = layer_options.parse_args(["--device", "cuda"])
    assert (args.device, args.transport, args.np, layer_options.default_np(args)) == ("cuda", None, None, 1)
    args = layer_options.parse_args(["--device", "cuda", "--transport", "mpi", "--np", "4", "-d", "bf16"])
    assert (args.device, args.transport, args.np, args.dtype) == ("cuda", "mpi", 4, "bfloat16")


def test_gpu_step_preset_is_the_issues_comparison_alone():
    args = layer_options.parse_args(["--gpu-step"])
    assert (args.device, args.np, args.dtype) == ("cuda", 1, "bfloat16")
    issue = layer_options.ISSUE_SIZE
    assert (args.model_dim, args.hidden, args.experts, args.top_k) == (
        issue["model_dim"], issue["hidden"], issue["experts"], issue["top_k"])
    # No sweep (nor the dropless and dynamic rows at its tokens): the comparison at T = 4096 and 16384, f = 1.
    assert layer_options.cases(args) == [layer_options.Case(tokens, issue["factor"], True)
                                         for tokens in (issue["tokens"], 16384)]
    assert (args.tokens, args.switch_pairs, args.dropless_factors, args.dynamic_steps) == (0, 0, [], 0)
    assert (args.warmup, args.repeats) == (layer_options.GPU_STEP["warmup"], layer_options.GPU_STEP["repeats"])
    assert not args.no_peer and layer_options.layout_error(args, 1) is None
    # Flags given with it win: the same command on the CPU, smaller.
    args = layer_options.parse_args(["--gpu-step", "--device", "cpu", "-M", "32", "-H", "64", "--peer-tokens", "128"])
    assert (args.device, args.dtype, args.model_dim, args.hidden, args.peer_tokens) == ("cpu", "bfloat16", 32, 64, [128])
    assert args.np == 1 and layer_options.parse_args(["--gpu-step", "--np", "2"]).np == 2


def test_gpu_step_is_its_flags_spelled_out():
    """The module docstring's spelling of --gpu-step parses to the same run."""
    text = ("--device cuda --np 1 --dtype bfloat16 --tokens 0 --peer-tokens 4096,16384 --peer-factors 1 -M 1024 -H 1024 "
            "-E 8 -k 2 -w 3 -r 10 --switch-pairs 0 --dropless-factors '' --dynamic-steps 0 --profile 12")
    assert text in " ".join(layer.__doc__.split())
    spelled = shlex.split(text)
    preset, flags = vars(layer_options.parse_args(["--gpu-step"])), vars(layer_options.parse_args(spelled))
    differing = {name for name in preset if preset[name] != flags[name]}
    assert differing == {"gpu_step"}, differing


def test_gpu_step_at_the_issues_size_is_judged_by_the_targets():
    args = layer_options.parse_args(["--gpu-step"])
    summary = {"tokens": args.peer_tokens[0], "factor": args.peer_factors[0], "comparison": True, "best": None,
               "step_vs_expert": 1.1, "gshard_vs_step": 4.5, "switch": None}
    sizes = {"model_dim": args.model_dim, "hidden": args.hidden, "experts": args.experts, "top_k": args.top_k}
    verdicts = {t["name"]: t["verdict"] for t in layer_summary.evaluate_targets([summary], sizes)}
    assert verdicts == {"adaptive": "not measured", "expert": "met", "gshard": "met", "switch": "not measured"}


@pytest.mark.parametrize("argv", [["--device", "cuda"], ["--device", "cuda", "--np", "4"], ["--gpu-step"]])
def test_device_cuda_without_a_gpu_fails_at_once(argv, launched, monkeypatch, capsys, torch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(argv) == 2
    assert "moe_runtime.bench --device cuda: torch sees no GPU" in capsys.readouterr().err
    assert launched == []  # refused before mpirun starts any rank


def test_device_cuda_with_an_a2a_built_without_cuda_fails_at_once(launched, monkeypatch, capsys, torch):
    import a2a

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(a2a, "config", lambda: {"cuda": False})
    assert cli.main(["--device", "cuda", "--np", "2"]) == 2
    assert "moe_runtime.bench --device cuda: this a2a was built without CUDA" in capsys.readouterr().err
    assert launched == []


def test_cuda_missing_is_the_kernel_benchs_check_too(monkeypatch, torch):
    from a2a.bench import kernels

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert common.cuda_missing() == "--device cuda: torch sees no GPU"
    args = kernels.parse_args(["--op", "encode", "--device", "cuda"])
    assert common.resolve_device(args) == common.cuda_missing()
    args = kernels.parse_args(["--op", "encode"])
    assert common.resolve_device(args) is None and args.device == "cpu"  # the default: cuda only where it runs


def test_no_arguments_launch_four_ranks_as_two_emulated_nodes(launched):
    assert cli.main([]) == 0
    [(np_, command, env)] = launched
    assert np_ == 4
    assert command == [sys.executable, "-m", "moe_runtime.bench"]
    assert env["A2A_LOCAL_SIZE"] == "2"
    assert env[common.COMMAND_ENV] == "python -m moe_runtime.bench"


def test_np_is_stripped_and_local_size_passed_on(launched):
    assert cli.main(["--np", "8", "--local-size", "4", "--quick"]) == 0
    [(np_, command, env)] = launched
    assert np_ == 8
    assert command == [sys.executable, "-m", "moe_runtime.bench", "--local-size", "4", "--quick"]
    assert env["A2A_LOCAL_SIZE"] == "4"


def test_explicit_np_uses_the_real_topology(launched):
    cli.main(["--np", "2"])
    [(np_, _command, env)] = launched
    assert np_ == 2 and "A2A_LOCAL_SIZE" not in env


# ---------------------------------------------------------------------------
# Pure helpers


def test_static_configs_run_data_parallel_once():
    assert layer_measure.static_configs([0, 1], [1, 2], ["linear", "2dh"]) == [
        (0, 1, "linear"),
        (1, 1, "linear"),
        (1, 1, "2dh"),
        (1, 2, "linear"),
        (1, 2, "2dh"),
    ]
    assert len(layer_measure.static_configs([0, 1, 2, 4], [1, 2, 4, 8], ["linear"])) == 1 + 3 * 4
    assert layer_summary.config_label(1, 4, "2dh") == "r1/d4/2dh"


def _summary(tokens=256, factor=1.0, best=100.0, worst=150.0, adaptive=102.0, expert=95.0, gshard=None,
             comparison=False, switch=None):
    static = comparison is False
    return {
        "tokens": tokens,
        "factor": factor,
        "comparison": comparison,
        "capacity": 64,
        "best": {"config": "r1/d1/linear", "time_ms": best} if static else None,
        "worst": {"config": "r0/d1/linear", "time_ms": worst} if static else None,
        "adaptive": {"config": "r1/d1/linear", "time_ms": adaptive, "steps": 37, "trials": 9},
        "adaptive_vs_best": adaptive / best if static else None,
        "worst_vs_adaptive": worst / adaptive if static else None,
        "expert": {"time_ms": expert, "shape": [2, 256, 1024, 1024]},
        "step_vs_expert": adaptive / expert,
        "gshard_ms": gshard,
        "gshard_vs_step": None if gshard is None else gshard / adaptive,
        "switch": switch,
    }


ISSUE = {"model_dim": 1024, "hidden": 1024, "experts": 8, "top_k": 2}


def test_targets_met_and_missed():
    summaries = [
        _summary(best=100, worst=150, adaptive=102, expert=95),  # 1.02x best, 1.47x worst, 1.07x expert: met
        _summary(factor=2, best=100, worst=150, adaptive=104, expert=80),  # 1.04x best: missed; 1.3x expert: missed
        _summary(tokens=4096, adaptive=1000, expert=900, gshard=4500, comparison=True),  # 4.5x GShard: met
    ]
    adaptive, expert, gshard, switch = layer_summary.evaluate_targets(summaries, ISSUE)
    assert [c["verdict"] for c in adaptive["cases"]] == ["met", "missed"]  # the comparison case has no statics
    assert adaptive["verdict"] == "missed"
    assert [c["verdict"] for c in expert["cases"]] == ["met", "missed", "met"]
    assert [c["verdict"] for c in gshard["cases"]] == ["met"] and gshard["cases"][0]["issue_size"]
    assert gshard["verdict"] == "met"
    assert switch["cases"] == [] and switch["verdict"] == "not measured"
    lines = "\n".join(layer_tables.target_lines([adaptive, expert, gshard]))
    assert "T=256 f=2: adaptive / best 1.040, worst / adaptive 1.44x: missed" in lines
    assert "T=4096 f=1: GShard / step 4.50x: met" in lines


def test_worst_must_be_far_enough_and_gshard_counts_only_at_the_issue_size():
    [adaptive, _, gshard, _] = layer_summary.evaluate_targets(
        [_summary(best=100, worst=110, adaptive=100), _summary(tokens=128, gshard=150, comparison=True)], ISSUE
    )
    assert adaptive["verdict"] == "missed"  # within 3%, but the worst is only 1.1x
    assert gshard["cases"][0]["issue_size"] is False
    assert gshard["verdict"] == "not measured"
    other = layer_summary.evaluate_targets([_summary(tokens=4096, gshard=9000, comparison=True)],
                                           {**ISSUE, "hidden": 512})
    assert other[2]["verdict"] == "not measured"


def _pairs(config, *times):
    return [{"config": config, "switch_ms": a, "steady_ms": b, "again_ms": c} for a, b, c in times]


def test_switch_cost_is_the_median_difference_of_the_pairs():
    pairs = (_pairs("r0/d1/linear", (404, 400, 400), (398, 400, 404), (401, 400, 400))
             + _pairs("r1/d2/2dh", (103, 100, 99), (99, 100, 100), (100, 100, 100)))
    switch = layer_summary.summarize_switch(pairs, True)
    assert switch["pairs"] == 6 and switch["samples"] == pairs
    assert [(c["config"], c["switch_ms"], c["steady_ms"], c["cost_ms"]) for c in switch["configs"]] == [
        ("r0/d1/linear", 401, 400, 1), ("r1/d2/2dh", 100, 100, 0)]
    assert switch["cost_ms"] == 0.5  # median of 4, -2, 1, 3, -1, 0
    assert switch["relative"] == pytest.approx((0.0025 + 0.0) / 2)  # median of the six relative differences
    assert switch["control"] == 0.0  # median of again - steady: 0, +1%, 0, -1%, 0, 0
    assert [c["control"] for c in switch["configs"]] == [0.0, 0.0]
    cheap, dear = (layer_summary.summarize_switch(_pairs("r1/d1/linear", (a, 100, 101)), True) for a in (100.5, 102))
    allocating = layer_summary.summarize_switch(_pairs("r1/d1/linear", (100, 100, 100)), False)
    [*_, switch_target] = layer_summary.evaluate_targets(
        [_summary(switch=cheap), _summary(factor=2, switch=dear), _summary(factor=4, switch=allocating)], ISSUE)
    assert [c["verdict"] for c in switch_target["cases"]] == ["met", "missed", "missed"]
    assert switch_target["verdict"] == "missed"
    lines = "\n".join(layer_tables.target_lines([switch_target]))
    assert "T=256 f=2: switch cost +2.00 ms, +2.00% of a step (control +1.00%), buffers unchanged: missed" in lines
    assert "T=256 f=4: switch cost +0.00 ms, +0.00% of a step (control +0.00%), buffers ALLOCATED: missed" in lines
    rows = layer_tables.format_switch(_summary(switch=switch))
    assert [row.split() for row in rows] == [
        ["256", "1", "r0/d1/linear", "401.00", "400.00", "+1.00", "+0.25%", "+0.00%"],
        ["256", "1", "r1/d2/2dh", "100.00", "100.00", "+0.00", "+0.00%", "+0.00%"],
        ["256", "1", "all", "-", "-", "+0.50", "+0.12%", "+0.00%"],
    ]
    header = layer_tables.switch_header_lines()[0]
    assert all(len(row) == len(header) and _ends(row)[-1] == _ends(header)[-1] for row in rows)


def test_dropless_rows_line_up_with_their_header():
    header = layer_tables.dropless_header_lines()[0]
    rows = [{"dispatcher": "capacity", "factor": 1.25, "tokens": 256, "time_ms": 120.5, "vs_dropless": 1.1,
             "rows_sent": 480, "mib_sent": 7.5, "dropped": 12, "peak_mib": 30.25, "peak_vs_dropless": 1.5},
            {"dispatcher": "dropless", "factor": None, "tokens": 256, "time_ms": 109.5, "vs_dropless": 1.0,
             "rows_sent": 384, "mib_sent": 6.0, "dropped": 0, "peak_mib": 20.17, "peak_vs_dropless": 1.0}]
    for row in rows:
        line = layer_tables.format_dropless(row)
        assert len(line) == len(header) and _ends(line)[-1] == _ends(header)[-1]
    assert layer_tables.format_dropless(rows[1]).split() == ["dropless", "-", "256", "109.50", "1.00x", "384", "6.00",
                                                            "0", "20.17", "1.00x"]
    assert layer_options.parse_args(["--dropless-factors", "1.5,3"]).dropless_factors == [1.5, 3.0]
    assert layer_options.parse_args(["--dropless-factors", ""]).dropless_factors == []


def test_dynamic_rows_line_up_with_their_header():
    header = bench_dynamic.dynamic_header_lines()[0]
    rows = [{"dispatcher": "static", "factor": 3.25, "tokens": 256, "steps": 8, "time_ms": 120.5, "vs_static": 1.0,
             "dropped": 0, "rows_per_expert": 104.0, "changes": None},
            {"dispatcher": "dynamic", "factor": None, "tokens": 256, "steps": 8, "time_ms": 99.0, "vs_static": 0.82,
             "dropped": 0, "rows_per_expert": 71.5, "changes": 3}]
    for row in rows:
        line = bench_dynamic.format_dynamic(row)
        assert len(line) == len(header) and _ends(line)[-1] == _ends(header)[-1]
    assert bench_dynamic.format_dynamic(rows[1]).split() == ["dynamic", "-", "256", "8", "99.00", "0.82x", "0",
                                                             "71.5", "3"]
    assert layer_options.parse_args(["--dynamic-steps", "0"]).dynamic_steps == 0


def _ends(line: str) -> list[int]:
    """Where each word ends ("vs best" is one column name)."""
    return [m.end() for m in re.finditer(r"\S+", line.replace("vs best", "vs_best"))]


def test_rows_line_up_with_their_headers():
    row = {"tokens": 4096, "factor": 1.0, "capacity": 1024, "buffer_capacity": 1024, "r": 1, "d": 8,
           "algo": "linear", "time_ms": 12345.678, "vs_best": 1.5}
    header = layer_tables.header_lines()[0]
    assert _ends(header) == _ends(layer_tables.format_row(row))  # right-aligned: every value ends under its name
    assert layer_tables.format_row(row).split() == ["4096", "1", "1024", "1024", "1", "8", "linear", "12345.68",
                                                    "1.50x"]
    header = layer_tables.summary_header_lines()[0]
    for summary in (_summary(gshard=300.0), _summary(comparison=True)):
        line = layer_tables.format_summary(summary)
        assert len(line) == len(header) and _ends(line)[-1] == _ends(header)[-1]
        fields = line.split()
        assert len(fields) == 15 and fields[0] == "256" and fields[10] == "37/9"
    assert layer_tables.format_summary(_summary(comparison=True)).split()[2:4] == ["-", "-"]


# ---------------------------------------------------------------------------
# The GShard peer computes what the layer computes (one rank, in this process)


def test_the_peer_equals_the_layer(comm, torch):
    from moe_runtime.bench.peer import check_peer

    result = check_peer(comm, experts=4, top_k=2, factors=(1.0, 0.5, 2.0))
    assert result.passed, result
    assert result.output_error < 1e-12 and result.grad_error < 1e-12


def test_the_check_catches_a_peer_with_another_capacity(comm, torch, monkeypatch):
    from moe_runtime.bench import peer as bench_peer

    # One slot more per expert: a choice the layer drops reaches the peer's expert.
    rule = bench_peer.rule_capacity
    monkeypatch.setattr(bench_peer, "rule_capacity", lambda *a: rule(*a) + 1)
    result = bench_peer.check_peer(comm, experts=4, top_k=2, factors=(0.5,))
    assert not result.passed and result.output_error > 1e-3


# ---------------------------------------------------------------------------
# A real run


def _clean_env() -> dict[str, str]:
    keys = ("OMPI_", "PMIX_", "PMI_", "MPI_LOCALNRANKS", "A2A_LOCAL_SIZE", common.COMMAND_ENV)
    return {k: v for k, v in os.environ.items() if not k.startswith(keys)}


def test_quick_run_on_two_ranks(tmp_path, torch):
    out, plot = tmp_path / "bench.json", tmp_path / "bench.png"
    argv = ["--np", "2", "--quick", "--json", str(out)]
    try:
        import matplotlib  # noqa: F401

        argv += ["--plot", str(plot)]
    except ImportError:
        plot = None
    proc = subprocess.run([sys.executable, "-m", "moe_runtime.bench", *argv], check=False, cwd=REPO,
                          env=_clean_env(), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    record = json.loads(out.read_text())
    assert record["ranks"] == 2 and "--np 2" in record["command"] and record["valid_rs"] == [0, 1]
    assert record["peer_check"]["passed"] is True
    assert "peer check" in proc.stdout and ": OK" in proc.stdout

    quick = layer_options.QUICK
    static = [row for row in record["rows"] if row["kind"] == "static"]
    configs = layer_measure.static_configs([0, 1], quick["degrees"], quick["algos"])
    assert len(static) == len(quick["factors"]) * len(configs)
    assert all(row["tokens"] == quick["tokens"] and row["time_ms"] > 0 and row["vs_best"] >= 1 for row in static)
    assert all(row["capacity"] <= row["buffer_capacity"] and len(row["samples_ms"]) == quick["repeats"]
               for row in static)
    kinds = [row["kind"] for row in record["rows"] if row["kind"] != "static"]
    assert kinds == ["adaptive", "expert", "gshard"] * (len(quick["factors"]) + len(quick["peer_factors"]))

    summaries = record["summaries"]
    assert [(s["tokens"], s["factor"]) for s in summaries] == [
        *((quick["tokens"], f) for f in quick["factors"]),
        *((tokens, f) for tokens in quick["peer_tokens"] for f in quick["peer_factors"]),
    ]
    for s in summaries:
        assert s["adaptive"]["steps"] > s["adaptive"]["trials"] > 0
        assert s["expert"]["time_ms"] > 0 and s["gshard_ms"] > 0
        assert (s["best"] is None) == s["comparison"]
    # Switching r, timed in the sweep cases: every r of the layer, at the dictionary's d and algorithm.
    for s in summaries:
        if s["comparison"]:
            assert s["switch"] is None
            continue
        switch = s["switch"]
        assert switch["pairs"] == quick["switch_pairs"] * 2 == len(switch["samples"])
        assert [c["config"].split("/")[0] for c in switch["configs"]] == ["r0", "r1"]
        assert all(p["switch_ms"] > 0 and p["steady_ms"] > 0 and p["again_ms"] > 0 for p in switch["samples"])
        assert switch["buffers_unchanged"] is True
    assert [t["name"] for t in record["targets"]] == ["adaptive", "expert", "gshard", "switch"]
    assert all(t["verdict"] in ("met", "missed", "not measured") for t in record["targets"])
    assert record["targets"][2]["verdict"] == "not measured"  # --quick is not the issue's size
    assert len(record["targets"][3]["cases"]) == len(quick["factors"])

    table = [line.split() for line in proc.stdout.splitlines() if line and not line.startswith("#")]
    switch_rows = len(quick["factors"]) * (2 + 1)  # per sweep case: r0, r1, all
    dropless = record["dropless"]
    dynamic = record["dynamic"]
    assert len(table) == len(static) + len(summaries) + switch_rows + len(dropless) + len(dynamic)
    # The capacity dispatcher at each --dropless-factors against the dropless one.
    assert [(r["dispatcher"], r["factor"]) for r in dropless] == [
        *(("capacity", f) for f in quick["dropless_factors"]), ("dropless", None)]
    assert dropless[-1]["dropped"] == 0 and dropless[-1]["vs_dropless"] == 1.0
    assert all(r["time_ms"] > 0 and r["rows_sent"] > 0 and r["mib_sent"] > 0 and r["peak_mib"] > 0 for r in dropless)
    # The no-drop static factor, dropless and the per-expert dynamic capacity on the skewed steps.
    assert [r["dispatcher"] for r in dynamic] == ["static", "dropless", "dynamic"]
    assert all(r["dropped"] == 0 and r["steps"] == quick["dynamic_steps"] == len(r["samples_ms"]) for r in dynamic)
    static_row, _, dynamic_row = dynamic
    assert static_row["factor"] > 1 and static_row["vs_static"] == 1.0  # the skew needs more than the mean share
    assert dynamic_row["changes"] >= 1 and dynamic_row["rows_per_expert"] < static_row["rows_per_expert"]
    assert "# targets" in proc.stdout
    if plot is not None:
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_gpu_step_command_on_one_cpu_rank(tmp_path, torch):
    """The --gpu-step command with --device cpu and small sizes, on 1 rank (no mpirun): the
    comparison case alone, and the JSON fields a summary of the GPU run reads."""
    out = tmp_path / "step.json"
    argv = ["--gpu-step", "--device", "cpu", "-M", "32", "-H", "64", "--peer-tokens", "128", "-r", "2",
            "-w", "1", "--tune-repeats", "1", "--json", str(out)]
    proc = subprocess.run([sys.executable, "-m", "moe_runtime.bench", *argv], check=False, cwd=REPO,
                          env=_clean_env(), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    record = json.loads(out.read_text())
    assert (record["ranks"], record["device"], record["gpu"], record["dtype"]) == (1, "cpu", None, "bfloat16")
    assert record["valid_rs"] == [0, 1] and record["peer_check"]["passed"] is True
    assert record["peer_check"]["factors"] == [1.0]  # the comparison's factor only: no sweep
    installed = [check["name"] for check in record["peers_check"] if not check["missing"]]
    assert [row["kind"] for row in record["rows"]] == ["adaptive", "expert", "gshard", *installed]
    assert record["dropless"] == [] and record["dynamic"] == []
    [s] = record["summaries"]
    # Tutel's and Megatron-Core's rows and float64 checks where installed (make peers), "not installed" where
    # not; no graphed row without a GPU.
    assert [check["name"] for check in record["peers_check"]] == list(layer_summary.PEER_KINDS)
    for check in record["peers_check"]:
        shown = s["peers"][check["name"]]
        if check["missing"]:
            assert check["missing"] == shown["missing"] == "not installed (make peers)"
        else:
            assert check["passed"] and shown["time_ms"] > 0 and shown["vs_step"] > 0
            assert f"peer check {check['name']} {check['version']}" in proc.stdout
    assert s["graphed_ms"] is None and s["captured_ms"] is None and "T=128 f=1: " in proc.stdout
    assert (s["tokens"], s["factor"], s["comparison"], s["switch"]) == (128, 1.0, True, None)
    assert s["adaptive"]["config"].split("/")[0] in ("r0", "r1") and s["adaptive"]["time_ms"] > 0
    assert s["expert"]["time_ms"] > 0 and s["gshard_ms"] > 0
    assert s["step_vs_expert"] == pytest.approx(s["adaptive"]["time_ms"] / s["expert"]["time_ms"])
    assert s["gshard_vs_step"] == pytest.approx(s["gshard_ms"] / s["adaptive"]["time_ms"])
    targets = {t["name"]: t for t in record["targets"]}
    assert targets["expert"]["verdict"] in ("met", "missed") and len(targets["expert"]["cases"]) == 1
    [gshard] = targets["gshard"]["cases"]
    assert gshard["issue_size"] is False and targets["gshard"]["verdict"] == "not measured"  # smaller than the issue's

