"""python -m moe_runtime.bench --overhead on one rank: the table, our row's
counts (those test_runtime_step_budget.py holds, without biases), and a row
for each peer, measured where it is installed (make peers), else saying so."""

from __future__ import annotations

import importlib

import pytest

pytest.importorskip("torch")

from moe_runtime.bench import __main__ as bench_main
from moe_runtime.bench import overhead


def test_the_flag_picks_the_mode_and_bad_arguments_are_refused():
    assert bench_main.mode(["--overhead", "--tokens", "8"]) == (overhead, ["--tokens", "8"])
    assert overhead.parse_args(["--tokens", "8,32"]).tokens == [8, 32]
    with pytest.raises(SystemExit):
        overhead.parse_args(["--tokens", "8,x"])
    with pytest.raises(SystemExit):
        overhead.parse_args(["--steps", "0"])
    with pytest.raises(SystemExit):
        overhead.parse_args(["--no-wait", "--capacity-factor", "0"])  # the dropless flow's


def test_the_dropless_flow_without_a_wait_reads_nothing_back(capsys):
    argv = ["--tokens", "16", "--steps", "2", "--repetitions", "1", "--capacity-factor", "0", "--flow",
            "dropless", "--no-wait"]
    assert overhead.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any("our flow dropless without a wait" in line for line in lines), lines
    ours = next(line.split() for line in lines if line.split()[:2] == ["16", "moe_runtime"])
    assert int(ours[5]) == 0, ours  # reads: a2a's host waits and torch's value reads


def test_one_rank_prints_a_row_per_layer(capsys):
    assert overhead.main(["--tokens", "16", "--steps", "2", "--repetitions", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("# python -m moe_runtime.bench.overhead --tokens 16"), lines[0]
    rows = {line.split()[1]: line.split() for line in lines if line.split()[:1] == ["16"]}
    assert set(rows) == {"moe_runtime", "tutel", "megatron-core"}, lines
    ops, native, reads, rounds = (int(v) for v in rows["moe_runtime"][3:7])
    assert (reads, rounds) == (0, 0) and 0 < ops <= 138 and 0 < native <= 10, rows["moe_runtime"]
    for peer, module in (("tutel", "tutel"), ("megatron-core", "megatron.core")):
        assert ("not installed" in " ".join(rows[peer])) != installed(module), rows[peer]


def installed(module):
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True
