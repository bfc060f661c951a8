"""python -m a2a.bench --layout on the CPU: runs, checks its own output
(#wrong), and rejects bad arguments."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from a2a.bench import layout as _layout_bench


def test_layout_mode_is_recognized():
    assert _layout_bench.is_layout_mode(["--layout", "--device", "cuda"])
    assert not _layout_bench.is_layout_mode(["--op", "all"])
    assert not _layout_bench.is_layout_mode(["--", "--layout"])


def test_cpu_run_moves_every_byte_right(tmp_path):
    json_path = tmp_path / "layout.json"
    command = [sys.executable, "-m", "a2a.bench", "--layout", "--total", "2M", "--chunks", "3,4K,64K", "-r", "1",
               "--json", str(json_path)]
    result = subprocess.run(command, check=False, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [line.split() for line in result.stdout.splitlines() if line and not line.startswith("#")]
    assert [(r[0], r[4]) for r in rows] == [
        ("3", "transpose"),
        ("3", "ranges"),
        ("4096", "transpose"),
        ("4096", "ranges"),
        ("65536", "transpose"),
        ("65536", "ranges"),
    ]
    assert all(r[-1] == "0" for r in rows)  # #wrong
    assert "# Out of bounds values : 0 OK" in result.stdout
    written = json.loads(json_path.read_text())
    assert [(r["chunk_bytes"], r["op"], r["wrong"]) for r in written] == [(int(r[0]), r[4], 0) for r in rows]
    assert all(r["device"] == "cpu" and r["of_copy"] > 0 for r in written)


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--layout", "--cols", "0"], "--cols must be at least 1"),
        (["--layout", "--chunks", "0"], "positive"),
        (["--layout", "--total", "1K", "--chunks", "1M"], "less than one row"),
    ],
)
def test_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit):
        _layout_bench.parse_args(argv)
    assert message in capsys.readouterr().err
