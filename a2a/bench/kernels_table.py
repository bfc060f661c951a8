"""The table of the kernel benchmark: one row per op and configuration, and
the footer's geometric means (the columns: ``python -m a2a.bench --op all --help``)."""

from __future__ import annotations

from . import common

__all__ = ["footer_lines", "format_row", "header_lines"]

_COLUMNS = (
    "{:>9}  {:>6}  {:>4}  {:>2}  {:>5}  {:>8}  {:>5}  {:>11}  {:>9}  {:>6}  {:>6}  {:>6}  {:>7}  {:>7}  {:>6}"
)
_NAMES = (
    ("op", ""),
    ("T", ""),
    ("E", ""),
    ("k", ""),
    ("M", ""),
    ("dtype", ""),
    ("C", ""),
    ("bytes", "(B)"),
    ("time", "(us)"),
    ("GB/s", ""),
    ("memcpy", "(GB/s)"),
    ("vs", "memcpy"),
    ("vs", "index"),
    ("vs", "einsum"),
    ("#wrong", ""),
)


def header_lines() -> list[str]:
    def line(cells: list[str]) -> str:
        return ("#" + _COLUMNS.format(*cells)[1:]).rstrip()

    return [line([a for a, _ in _NAMES]), line([b for _, b in _NAMES])]


def _ratio(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_row(row: dict) -> str:
    return _COLUMNS.format(
        row["op"],
        row["tokens"],
        row["experts"],
        row["top_k"],
        row["model_dim"],
        row["dtype"],
        "-" if row["capacity"] is None else row["capacity"],
        row["bytes"],
        common.format_time(row["time_us"], width=0),
        f"{row['gbps']:.2f}",
        f"{row['memcpy_gbps']:.2f}",
        _ratio(row["vs_memcpy"]),
        "-" if row["vs_index"] is None else f"{row['vs_index']:.2f}x",
        "-" if row["vs_einsum"] is None else f"{row['vs_einsum']:.1f}x",
        row["wrong"],
    )


def footer_lines(rows: list[dict], ops: list[str]) -> list[str]:
    done = [r for r in rows if not r.get("skipped")]
    wrong = sum(r["wrong"] for r in done)
    lines = [common.out_of_bounds_line(wrong)]
    skipped = len(rows) - len(done)
    if skipped:
        lines.append(f"# Skipped configurations: {skipped} (see the '# skipped' lines)")
    lines.append("#")
    for op in ops:
        mine = [r for r in done if r["op"] == op]
        if not mine:
            continue
        parts = [
            f"#   {op:<9} {len(mine):3d} rows  geomean: vs memcpy {_ratio(common.geomean([r['vs_memcpy'] for r in mine]))}"
        ]
        vi = common.geomean([r["vs_index"] for r in mine if r["vs_index"]])
        parts.append(f"vs index {_ratio(vi)}x" if vi else "vs index -")
        ve = [r["vs_einsum"] for r in mine if r["vs_einsum"]]
        parts.append(f"vs einsum {common.geomean(ve):.1f}x ({len(ve)} rows)" if ve else "vs einsum -")
        lines.append(", ".join(parts))
    lines.append("#")
    return lines
