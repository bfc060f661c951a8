"""Reads the text output of nccl-tests' perf programs (``alltoall_perf`` and
the others, nccl-tests 2.11 and later: the ``root`` column and ``#wrong``),
of ``nccl_tests_ext/`` (the same format) and of ``python -m a2a.bench`` (its
rows carry two more columns).

    from a2a.nccl_format import parse
    report = parse(open("alltoall_perf.txt").read())
    for row in report.rows:
        print(row.size, row.out_of_place.busbw, row.out_of_place.wrong)
    assert report.out_of_bounds == 0 and report.out_of_bounds_ok

What a row of nccl-tests looks like (src/util.cu)::

    #       size         count      type   redop    root     time   algbw   busbw  #wrong     time   algbw   busbw  #wrong
         1048576         32768     float    none      -1    40.17   26.10   22.84       0    39.56   26.51   23.19     N/A

Five fields, then the out-of-place group and the in-place group (time in
us, algbw and busbw in GB/s, wrong elements or ``N/A``). A group that was
not run is printed as blanks; the row then has fewer fields and the
columns tell which group is there. Lines that are neither comments nor rows
(NCCL's INFO lines, MPI's warnings) are kept in :attr:`Report.other_lines`.
Per-iteration columns (``-I 1``) are not read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

__all__ = ["Device", "FormatError", "Group", "Report", "Row", "parse"]


class FormatError(ValueError):
    """A line that looks like part of the format but cannot be read; the message quotes it."""


@dataclass(frozen=True)
class Group:
    """One placement's results: out-of-place or in-place."""

    time_us: float
    algbw: float  # GB/s
    busbw: float  # GB/s
    wrong: int | None  # None where nccl-tests prints N/A (not checked)


@dataclass(frozen=True)
class Row:
    """One result line."""

    size: int  # bytes
    count: int  # elements
    type: str
    redop: str
    root: int
    out_of_place: Group | None
    in_place: Group | None
    extra: tuple[str, ...] = ()  # fields after the groups (a2a.bench: algo and ratio)


@dataclass(frozen=True)
class Device:
    """A ``#  Rank ... on HOST device ...`` line."""

    rank: int
    group: int
    pid: int
    host: str
    device: str  # "0" for a GPU, "cpu" for nccl_tests_ext's host buffers
    bus: str  # what is in brackets: the PCI address, or where the rank sits
    name: str


@dataclass
class Report:
    """Everything read from one run's output."""

    program: str | None = None  # from "# Collective test starting: NAME"
    settings: dict[str, int] = field(default_factory=dict)  # the "# nThread ..." line, by name
    devices: list[Device] = field(default_factory=list)
    rows: list[Row] = field(default_factory=list)
    out_of_bounds: int | None = None
    out_of_bounds_ok: bool | None = None
    avg_bus_bandwidth: float | None = None
    other_lines: list[str] = field(default_factory=list)


_SETTINGS = re.compile(
    r"^#\s*nThread (?P<nthread>\d+) nGpus (?P<ngpus>\d+) minBytes (?P<minbytes>\d+) maxBytes (?P<maxbytes>\d+)"
    r" step: (?P<step>\d+)\((?P<step_kind>factor|bytes)\) warmup iters: (?P<warmup_iters>\d+)"
    r" iters: (?P<iters>\d+)(?: agg iters: (?P<agg_iters>\d+))? validation: (?P<validation>\d+)"
    r"(?: graph: (?P<graph>\d+))?(?: unalign: (?P<unalign>\d+))?"
)
_DEVICE = re.compile(
    r"^#\s+Rank\s+(\d+)\s+Group\s+(\d+)\s+Pid\s+(\d+)\s+on\s+(\S+)\s+device\s+(\S+)\s+\[([^\]]*)\]\s*(.*?)\s*$"
)
_PROGRAM = re.compile(r"^#\s*Collective test starting:\s*(\S+)")
_OUT_OF_BOUNDS = re.compile(r"^#\s*Out of bounds values\s*:\s*(\d+)\s+(OK|FAILED)\b")
_AVG_BUSBW = re.compile(r"^#\s*Avg bus bandwidth\s*:\s*(\S+)")
_COLUMNS = re.compile(r"^#\s+size\s+count\s+type\s+redop\s+root\b(.*)$")
_TOKEN = re.compile(r"\S+")
# nccl-tests' row layout: "%12li  %12li  %8s  %6s  %6s", then groups of "  %7s  %6s  %6s  %6s" (33 characters).
_GROUP_WIDTH = 33


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def _group(tokens: list[str]) -> Group | None:
    """A group from four fields, or None when they are not one."""
    if len(tokens) < 4:
        return None
    time_us, algbw, busbw = (_number(t) for t in tokens[:3])
    if time_us is None or algbw is None or busbw is None:
        return None
    if tokens[3] == "N/A":
        return Group(time_us, algbw, busbw, None)
    wrong = _number(tokens[3])  # "%6g": large counts come as 1.23457e+06
    if wrong is None or wrong < 0:
        return None
    return Group(time_us, algbw, busbw, int(wrong))


def _row(line: str, groups: tuple[str, ...]) -> Row | None:
    """A result row, or None when the line is not one."""
    matches = list(_TOKEN.finditer(line))
    tokens = [m.group() for m in matches]
    if len(tokens) < 9 or not (tokens[0].isdigit() and tokens[1].isdigit()):
        return None
    try:
        root = int(tokens[4])
    except ValueError:
        return None
    found: dict[str, Group] = {}
    at = 5
    # A blank group: the next field starts at least a group's width past
    # the end of the previous one, so it belongs to the next placement.
    placement = 0
    previous_end = matches[4].end()
    while at < len(tokens) and placement < len(groups):
        group = _group(tokens[at : at + 4])
        if group is None:
            break
        skipped = (matches[at].start() - previous_end) // _GROUP_WIDTH
        placement += skipped
        if placement >= len(groups):
            break
        found[groups[placement]] = group
        previous_end = matches[at + 3].end()
        placement += 1
        at += 4
    if not found:
        return None
    return Row(
        size=int(tokens[0]),
        count=int(tokens[1]),
        type=tokens[2],
        redop=tokens[3],
        root=root,
        out_of_place=found.get("out-of-place"),
        in_place=found.get("in-place"),
        extra=tuple(tokens[at:]),
    )


def parse(text: str) -> Report:
    """Reads one run's output (nccl-tests, nccl_tests_ext or python -m a2a.bench) into a :class:`Report`.

    Raises FormatError for a column header it cannot read (per-iteration
    columns), for a result footer with an unreadable value, or when a row
    comes before any column header."""
    report = Report()
    groups: tuple[str, ...] | None = None
    placements_line = ""
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped:
            continue
        if stripped.startswith("#"):
            if (m := _PROGRAM.match(stripped)) is not None:
                report.program = m.group(1)
            elif (m := _SETTINGS.match(stripped)) is not None:
                report.settings = {k: (v if k == "step_kind" else int(v)) for k, v in m.groupdict().items() if v}
            elif (m := _DEVICE.match(line)) is not None:
                rank, group, pid, host, device, bus, name = m.groups()
                report.devices.append(Device(int(rank), int(group), int(pid), host, device, bus, name))
            elif (m := _COLUMNS.match(stripped)) is not None:
                if "i_min" in m.group(1):
                    raise FormatError(f"per-iteration columns (-I 1) are not read: {line!r}")
                names = [p for p in ("out-of-place", "in-place") if p in placements_line]
                groups = tuple(names) or ("out-of-place", "in-place")
            elif "out-of-place" in stripped or "in-place" in stripped:
                placements_line = stripped
            elif (m := _OUT_OF_BOUNDS.match(stripped)) is not None:
                report.out_of_bounds, report.out_of_bounds_ok = int(m.group(1)), m.group(2) == "OK"
            elif (m := _AVG_BUSBW.match(stripped)) is not None:
                value = _number(m.group(1))
                if value is None:
                    raise FormatError(f"unreadable average bus bandwidth: {line!r}")
                report.avg_bus_bandwidth = value
            continue
        row = _row(line, groups or ("out-of-place", "in-place"))
        if row is None:
            report.other_lines.append(line)
            continue
        if groups is None:
            raise FormatError(f"a result row before any column header: {line!r}")
        report.rows.append(row)
    return report
