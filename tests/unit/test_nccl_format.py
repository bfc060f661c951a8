"""a2a.nccl_format: reads real nccl-tests output (two samples written
from nccl-tests' printf formats, of 2023 and of 2.19.6), nccl_tests_ext's rows
(no in-place group) and python -m a2a.bench's (two extra columns); the
runs of both under mpirun are read in tests/c/run_nccl_tests_ext.py."""

from __future__ import annotations

import os

import pytest

from a2a import nccl_format
from a2a.nccl_format import FormatError, parse

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "nccl_tests")
COLUMNS = """\
#                                                              out-of-place                       in-place
#       size         count      type   redop    root     time   algbw   busbw  #wrong     time   algbw   busbw  #wrong
#        (B)    (elements)                               (us)  (GB/s)  (GB/s)             (us)  (GB/s)  (GB/s)
"""


def sample(name: str) -> nccl_format.Report:
    with open(os.path.join(DATA, name), encoding="utf-8") as f:
        return parse(f.read())


def check_alltoall_rows(report: nccl_format.Report, ranks: int) -> None:
    """What holds in any alltoall_perf output: busbw = algbw (n-1)/n in both
    groups, in-place unchecked, and the average over both groups' busbw."""
    busbws = []
    for row in report.rows:
        assert (row.type, row.redop, row.root, row.extra) == ("float", "none", -1, ())
        assert row.size == row.count * ranks * 4
        for group in (row.out_of_place, row.in_place):
            assert group is not None
            assert group.busbw == pytest.approx(group.algbw * (ranks - 1) / ranks, abs=0.011)
            assert group.time_us > 0
            busbws.append(group.busbw)
        assert row.out_of_place.wrong == 0 and row.in_place.wrong is None  # nccl-tests checks no in-place alltoall
    assert report.avg_bus_bandwidth == pytest.approx(sum(busbws) / len(busbws), abs=0.01)
    assert (report.out_of_bounds, report.out_of_bounds_ok) == (0, True)
    assert report.other_lines == []


def test_nccl_tests_2_19_sample():
    report = sample("alltoall_perf_2.19.6_8xH100.txt")
    assert report.program == "alltoall_perf"
    assert report.settings == {
        "nthread": 1, "ngpus": 1, "minbytes": 8, "maxbytes": 128 << 20, "step": 2, "step_kind": "factor",
        "warmup_iters": 1, "iters": 20, "agg_iters": 1, "validation": 1, "graph": 0, "unalign": 0,
    }
    assert [d.rank for d in report.devices] == list(range(8))
    first = report.devices[0]
    assert (first.host, first.device, first.bus, first.name) == ("node017", "0", "0000:18:00", "NVIDIA H100 80GB HBM3")
    # -b 8 -e 128M -f 2: 25 sizes; below 128 B, 8 ranks get no 16-byte block each (size 0).
    assert [r.size for r in report.rows] == [0] * 4 + [1 << k for k in range(7, 28)]
    assert report.rows[-1].out_of_place.busbw == 165.23
    check_alltoall_rows(report, 8)


def test_nccl_tests_2023_sample():
    # Before 2.18: no version lines, "[0x07]" bus ids, "%5g" #wrong, "%6.2f" bandwidths.
    report = sample("alltoall_perf_2023_2x8xA100.txt")
    assert report.program is None
    assert report.settings["warmup_iters"] == 5 and "unalign" not in report.settings
    assert len(report.devices) == 16 and report.devices[8].host == "gpu-a002" and report.devices[8].bus == "0x07"
    assert [r.size for r in report.rows] == [1 << k for k in range(20, 31)]
    assert report.rows[-1].out_of_place.time_us > 10000  # printed "%7.0f"
    check_alltoall_rows(report, 16)


def test_rows_without_the_in_place_group():
    # nccl_tests_ext: a2a's collectives are out of place; the in-place group is not printed.
    text = COLUMNS + "        1024            64     float    none      -1     8.57    0.12    0.09       0\n"
    (row,) = parse(text).rows
    assert row.out_of_place == nccl_format.Group(8.57, 0.12, 0.09, 0) and row.in_place is None


def test_a_blank_out_of_place_group_is_told_apart_by_its_columns():
    # nccl-tests' null body (32 blanks) before the in-place group.
    leading = f"{1024:12d}  {256:12d}  {'float':>8}  {'none':>6}  {-1:6d}"
    line = leading + " " * 32 + "    17.10    0.06    0.05       0"
    (row,) = parse(COLUMNS + line + "\n").rows
    assert row.out_of_place is None and row.in_place == nccl_format.Group(17.10, 0.06, 0.05, 0)


# The rows and footer of `python -m a2a.bench --algo linear -b 1K -e 4K` (2 sizes, with its MPI baseline).
PYTHON_BENCH = """\
#                                                             out-of-place
#       size         count      type   redop    root     time   algbw   busbw  #wrong    algo   vs MPI
#        (B)    (elements)                               (us)  (GB/s)  (GB/s)                  (algbw)
        1024            64     float    none      -1    11.31    0.09    0.07       0  linear    0.69x
        1024            64     float    none      -1     7.82    0.13    0.10       0     mpi        -
        4096           256     float    none      -1    16.42    0.25    0.19       0  linear    0.72x
        4096           256     float    none      -1    11.87    0.35    0.26       0     mpi        -
# Out of bounds values : 0 OK
# Avg bus bandwidth    : 0.127497 
#
#   linear  avg busbw    0.127 GB/s   vs MPI (geomean of ratios): 0.71x
#   mpi     avg busbw    0.179 GB/s
#
"""


def test_python_bench_output():
    # One placement (out-of-place), then two columns of its own: they land in `extra`.
    report = parse(PYTHON_BENCH)
    assert [(r.size, r.extra) for r in report.rows] == [(1024, ("linear", "0.69x")), (1024, ("mpi", "-")),
                                                        (4096, ("linear", "0.72x")), (4096, ("mpi", "-"))]
    assert all(r.in_place is None and r.out_of_place.wrong == 0 for r in report.rows)
    assert report.rows[2].out_of_place == nccl_format.Group(16.42, 0.25, 0.19, 0)
    assert (report.out_of_bounds, report.avg_bus_bandwidth, report.other_lines) == (0, 0.127497, [])


def test_failures_unchecked_rows_and_foreign_lines():
    text = (
        "node017:4242:4242 [0] NCCL INFO Bootstrap : Using eth0:10.0.0.17<0>\n" + COLUMNS
        + "     1048576         65536     float    none      -1    40.17   26.10   22.84  1.04858e+06    39.56   26.51   23.19     N/A\n"
        + "     2097152        131072     float    none      -1    70.00   29.96   26.21     N/A    69.00   30.39   26.60     N/A\n"
        + "# Out of bounds values : 8 FAILED\n# Avg bus bandwidth    : 24.71 FAILED\n"
    )
    report = parse(text)
    assert report.other_lines == ["node017:4242:4242 [0] NCCL INFO Bootstrap : Using eth0:10.0.0.17<0>"]
    assert report.rows[0].out_of_place.wrong == 1048580  # "%6g" keeps 6 digits
    assert report.rows[1].out_of_place.wrong is None
    assert (report.out_of_bounds, report.out_of_bounds_ok, report.avg_bus_bandwidth) == (8, False, 24.71)


@pytest.mark.parametrize(
    "text, message",
    [
        ("           8             2     float    none      -1    17.08    0.00    0.00      0\n", "before any column header"),
        (COLUMNS.replace("#wrong\n", "#wrong    i_min\n", 1), "per-iteration"),
        (COLUMNS + "# Avg bus bandwidth    : fast\n", "average bus bandwidth"),
    ],
    ids=["row-first", "per-iteration", "bad-average"],
)
def test_what_cannot_be_read_is_an_error(text, message):
    with pytest.raises(FormatError, match=message):
        parse(text)
