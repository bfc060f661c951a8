"""tools/gpu_check: the parts that only a GPU run reaches, run here on CPU
data. The targets read the JSON of the very benchmarks the GPU run starts
(here on the CPU, small), the footers of nccl_tests_ext's output; the runner
holds a step to its budget, stray processes included; the summary is written
from real results. (The dry run itself is `make test-gpu-check`.)"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

from gpu_check import __main__ as gpu_check_main
from gpu_check import report, stages, targets
from gpu_check.environment import Environment

DATA = ROOT / "tests" / "data" / "nccl_tests"


def test_the_budgets_add_up_to_the_deadline():
    assert stages.BUILD_BUDGET_S + sum(stage.budget_s for stage in stages.STAGES) <= stages.DEADLINE_S <= 8 * 60
    assert len({stage.key for stage in stages.STAGES}) == len(stages.STAGES)
    # gpu_check.md, build.log, bench.json and one log per stage: the device tool brings back at most 8 files
    assert 3 + len({stage.log for stage in stages.STAGES}) <= 8
    for stage in stages.STAGES:
        for step in stage.steps:
            assert step.dry is not None, f"{step.name}: the dry run must exercise something of it"


def bench(tmp_path: Path, *args: str) -> None:
    command = [sys.executable, "-m", "a2a.bench", *args]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


@pytest.fixture(scope="module")
def cpu_json(tmp_path_factory) -> Path:
    """The benchmarks of the bench stage, on the CPU and small, writing their
    JSON under the names the GPU run gives them."""
    out = tmp_path_factory.mktemp("bench")
    bench(out, "--np", "1", "-b", "1K", "-e", "4K", "-n", "1", "-w", "0", "--algo", "linear,v",
          "--json", str(out / "collectives.json"))
    bench(out, "--layout", "--total", "2M", "--chunks", "4K,64K,256K", "-r", "1", "--json", str(out / "layout.json"))
    bench(out, "--op", "all", "--device", "cpu", "--tokens", "256", "--experts", "8", "--model-dim", "64",
          "--top-k", "2", "--dtype", "bfloat16", "-r", "1", "--no-einsum", "--json", str(out / "kernels.json"))
    bench(out, "--op", "esmm,ess,estmm", "--device", "cpu", "--tokens", "256", "--experts", "8", "--model-dim", "64",
          "--hidden", "64", "--dtype", "bfloat16", "-r", "1", "-n", "1", "--json", str(out / "es_ops.json"))
    bench(out, "--op", "top_k_gate", "--device", "cpu", "--tokens", "256", "--experts", "8", "--top-k", "2", "-r", "1",
          "-n", "1", "--json", str(out / "gate.json"))
    layer = [sys.executable, "-m", "moe_runtime.bench", "--gpu-step", "--device", "cpu", "-M", "32", "-H", "32",
             "--peer-tokens", "128", "-w", "1", "-r", "1", "--tune-repeats", "1", "--json", str(out / "layer.json")]
    done = subprocess.run(layer, cwd=out, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode in (0, 1), done.stdout[-3000:] + done.stderr[-3000:]  # 1: a missed target
    return out


def test_every_benchmark_json_gives_its_targets(cpu_json):
    found = targets.evaluate(cpu_json, [], dry=False)
    by_family = {}
    for target in found:
        assert target.verdict in ("met", "missed", "reported", "not measured") or "not installed" in target.verdict, \
            target
        by_family.setdefault(target.name.split(":")[0].split()[0], []).append(target)
    assert by_family["a2a.bench"][0].measured == "#wrong 0"
    assert by_family["a2a.bench"][0].verdict == "met"
    layout = [t for t in found if t.name.startswith("layout")]
    assert [t.name.split()[1] for t in layout] == ["transpose", "ranges"]  # both ops, chunks >= 64 KiB only
    assert all("#wrong 0" in t.measured and t.verdict in ("met", "missed") for t in layout)
    encode = next(t for t in found if t.name.startswith("encode bf16"))
    assert encode.goal.startswith(">= 0.9") and encode.verdict in ("met", "missed")
    assert {t.name.split()[0] for t in found if "T=256" in t.name} == {"esmm", "ess", "estmm"}
    gates = [t for t in found if t.name.startswith("top_k_gate")]
    assert [t.name.split()[1] for t in gates] == ["forward", "backward"]
    assert all(t.verdict == "reported" and t.measured.endswith("#wrong 0") for t in gates)
    # Only a peer that is not installed (make peers; the GPU check's kit installs them) is not run.
    assert all("not installed" in t.verdict for t in found if t.verdict.startswith("not run"))
    layer = [t for t in found if "layer" in t.name or "GShard" in t.name or t.name.startswith(("tutel", "megatron"))]
    checks, step, against = layer[:3], layer[3], layer[4:]
    assert [t.name.split()[0] for t in checks] == ["the", "tutel", "megatron-core"]
    assert all(t.verdict == "met" or "not installed" in t.verdict for t in checks)
    assert checks[0].verdict == "met"  # GShard's
    assert step.goal == "reported" and " ms = " in step.measured  # T = 128: judged at 4096 and 16384 only
    assert [t.name.split()[0] for t in against] == ["gshard", "tutel", "megatron-core"]
    assert against[0].goal == ">= 6.0x" and against[0].verdict in ("met", "missed")
    assert all(t.verdict in ("met", "missed") or "not installed" in t.verdict for t in against)


def test_nccl_programs_are_judged_by_their_footer():
    sample = (DATA / "nccl_tests_ext_alltoall_2x2_2dh.txt").read_text()
    good = stages.Result("bench", "nccl_tests_ext alltoall_perf", "passed", 1.0, output=sample)
    wrong = stages.Result("bench", "nccl_tests_ext alltoall_perf -G 1", "failed (exit 1)", 1.0,
                          output=sample.replace("Out of bounds values : 0 OK", "Out of bounds values : 3 FAILED"))
    cut = stages.Result("bench", "nccl_tests_ext alltoallv_perf", "not run: out of time (the 8-minute deadline)")
    left_out = stages.Result("bench", "nccl_tests_ext alltoall_flex_perf", "not run: not in --only")
    found = targets.nccl_programs([good, wrong, cut, left_out])
    assert [(t.measured, t.verdict) for t in found[:1]] == [("#wrong 0", "met")]
    assert found[1].verdict == "missed" and "3 FAILED" in found[1].measured
    assert found[2].verdict == "missed"
    assert found[3].verdict == "not run", "a step that --only left out is not a miss"


def environment(tmp_path: Path) -> Environment:
    return Environment(root=ROOT, work=tmp_path, python=sys.executable, env=dict(os.environ))


ESCAPER = """
import os, subprocess, sys, time
# a child in a session of its own, as mpirun's ranks are: killing the step's group misses it
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
open(sys.argv[1], "w").write(str(child.pid))
time.sleep(60)
"""


def test_a_step_over_budget_is_stopped_with_the_processes_that_left_its_group(tmp_path):
    pid_file = tmp_path / "child.pid"
    step = stages.Step("sleeps", 1, lambda e: [e.python, "-c", ESCAPER, str(pid_file)])
    stage = stages.Stage("tests", "a stage", "log.txt", (step,))
    started = time.monotonic()
    result = stages.run_step(stage, step, environment(tmp_path), tmp_path / "log.txt", dry=False, budget_s=2)
    assert result.status == "over budget (2 s)" and not result.ok
    assert time.monotonic() - started < 30
    child = int(pid_file.read_text())
    for _ in range(50):  # reaped by init once killed
        stat = Path(f"/proc/{child}/stat")
        if not stat.exists() or stat.read_text().split()[2] == "Z":
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the escaped child {child} is still running")


def test_a_step_reports_pytest_summary_failures_and_skips(tmp_path):
    output = ("tests/gpu/test_x.py .F.s\nFAILED tests/gpu/test_x.py::test_b - AssertionError: #wrong 3\n"
              "SKIPPED [1] tests/gpu/test_x.py:9: no CUDA device\n= 1 failed, 2 passed, 1 skipped in 3.1s =\n")
    step = stages.Step("pytest-like", 10, lambda e: [e.python, "-c", f"import sys; print({output!r}); sys.exit(1)"])
    stage = stages.Stage("tests", "a stage", "log.txt", (step,))
    result = stages.run_step(stage, step, environment(tmp_path), tmp_path / "log.txt", dry=False, budget_s=10)
    assert result.status == "failed (exit 1)"
    assert result.summary == "1 failed, 2 passed, 1 skipped in 3.1s"
    assert result.skips == ["SKIPPED [1] tests/gpu/test_x.py:9: no CUDA device"]
    assert "FAILED tests/gpu/test_x.py::test_b" in result.excerpt
    quiet = stages.Step("passes, but on no GPU", 10, lambda e: [e.python, "-c", f"print({output!r})"])
    blind = stages.run_step(stage, quiet, environment(tmp_path), tmp_path / "log.txt", dry=False, budget_s=10)
    assert blind.status.startswith("failed (1 skip line(s) say there is no GPU") and not blind.ok
    dry = stages.run_step(stage, stages.Step("no dry part", 1, step.command), environment(tmp_path),
                          tmp_path / "log.txt", dry=True, budget_s=10)
    assert dry.status == "not run: no GPU"


def test_an_early_step_runs_beside_the_others_and_its_wait_has_the_budget(tmp_path):
    """Started after the build, it runs while the next steps do; its stage waits
    for it at most its budget, and its output stays in its own log."""
    early = stages.Step("compiles", 5, lambda e: [e.python, "-c", "import time; time.sleep(1.5); print('built')"],
                        early=True)
    stage = stages.Stage("peers", "a stage", "peers.txt", (early,))
    began = time.monotonic()
    pending = stages.start_step(stage, early, environment(tmp_path), tmp_path / "peers.txt", dry=False, budget_s=5)
    other = stages.Step("meanwhile", 5, lambda e: [e.python, "-c", "import time; time.sleep(1.5); print('ran')"])
    beside = stages.run_step(stages.Stage("tests", "b", "tests.txt", (other,)), other, environment(tmp_path),
                             tmp_path / "tests.txt", dry=False, budget_s=5)
    result = stages.finish_step(pending, budget_s=5)
    assert beside.status == result.status == "passed" and result.summary == "built"
    assert time.monotonic() - began < 2.9, "the two ran one after the other"
    assert "ran" not in (tmp_path / "peers.txt").read_text()
    stuck = stages.start_step(stage, early, environment(tmp_path), tmp_path / "peers.txt", dry=False, budget_s=5)
    assert stages.finish_step(stuck, budget_s=0.2).status == "over budget (0 s)"


def test_only_and_step_choose_the_steps_of_a_rerun():
    args = gpu_check_main.parse_args(["--kit", "k", "--only", "bench", "--step", "gpu-step"])
    picked = [step.name for stage in stages.STAGES for step in stage.steps if gpu_check_main.chosen(args, stage, step)]
    assert picked == ["moe_runtime.bench --gpu-step"]
    everything = gpu_check_main.parse_args(["--kit", "k"])
    assert all(gpu_check_main.chosen(everything, stage, step) for stage in stages.STAGES for step in stage.steps)


def test_the_summary_names_the_machine_the_steps_the_targets_and_the_failures(tmp_path):
    built = stages.Result("build", "kit, a2a for sm_90, nccl_tests_ext", "passed", 40.0, "a2a 0.1.0: CUDA sm_90",
                          budget_s=90)
    results = [stages.Result("tests", "tests/gpu", "failed (exit 1)", 70.0, "1 failed, 898 passed",
                             "FAILED tests/gpu/test_x.py::test_b", ["SKIPPED [2] tests/gpu/test_y.py:3: needs sm_100"],
                             budget_s=80),
               stages.Result("bench", "a2a.bench --layout --device cuda", "passed", 9.0, "done", budget_s=12)]
    found = [targets.Target("layout transpose", ">= 0.80", "worst 0.91", "met")]
    path = tmp_path / "gpu_check.md"
    report.write(path, dry=False, facts={"gpu": "NVIDIA H100 80GB HBM3, 580.159.04, 81559 MiB, 9.0", "date": "x"},
                 build=built, results=results, targets=found, seconds=300.0)
    text = path.read_text()
    assert text.startswith("# GPU check: NVIDIA H100 80GB HBM3")
    assert "**1 step(s) did not pass**" in text
    assert "| tests | tests/gpu | failed (exit 1) | 70.0 | 80 | 1 failed, 898 passed |" in text
    assert "| layout transpose | >= 0.80 | worst 0.91 | met |" in text
    assert "needs sm_100" in text and "FAILED tests/gpu/test_x.py::test_b" in text


def test_both_graphed_steps_are_judged_against_the_expert_compute():
    """The GPU run's comparison case (the CPU run has neither graphed row): cuda_graphs=1 and the whole
    step captured by its caller, each against 1.15x its expert compute at T = 4096."""
    case = {"tokens": 4096, "factor": 1.0, "comparison": True, "adaptive": {"config": "r0/d1/linear", "time_ms": 4.0},
            "expert": {"time_ms": 0.5}, "graphed_ms": 1.3, "captured_ms": 0.55, "gshard_ms": 8.0, "peers": {}}
    found = {t.name.split(" against")[0]: t for t in targets.layer({"summaries": [case], "dtype": "bfloat16"})}
    graphed, captured = found["the step replayed from CUDA graphs"], found[
        "the whole step captured by its caller in one CUDA graph"]
    assert (graphed.goal, graphed.measured, graphed.verdict) == ("<= 1.15x", "1.30 ms / 0.50 ms = 2.60x", "missed")
    assert (captured.goal, captured.measured, captured.verdict) == ("<= 1.15x", "0.55 ms / 0.50 ms = 1.10x", "met")
