"""What a2a's benchmark sweep and its scale model agree on: how a size is
spelled (``64M``: powers of 1024, as nccl-tests) and the uneven counts of
the sweep's all_to_all_v rows. It sits below both a2a.bench, which runs the
sweep, and a2a.sim, which predicts and fits it, so that neither imports the
other for them."""

from __future__ import annotations

import re

__all__ = ["parse_size", "size_text", "v_counts"]

_SIZE_RE = re.compile(r"^\s*(\d+)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str | int) -> int:
    """Bytes from "64", "1K", "64M", "1G" (powers of 1024, as nccl-tests), also "1KB", "1KiB"."""
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"size must not be negative, got {text}")
        return text
    match = _SIZE_RE.match(str(text))
    if match is None:
        raise ValueError(f"invalid size {text!r}; expected an integer with an optional K, M or G suffix")
    return int(match.group(1)) * _SIZE_UNITS[match.group(2).lower()]


def size_text(nbytes: int) -> str:
    """The shortest exact spelling parse_size reads back: 64M, 1K, 1000."""
    for suffix in ("T", "G", "M", "K"):
        unit = _SIZE_UNITS[suffix.lower()]
        if nbytes and nbytes % unit == 0:
            return f"{nbytes // unit}{suffix}"
    return str(nbytes)


def v_counts(nranks: int, count: int) -> list[list[int]]:
    """counts[src][dst] for all_to_all_v: count + delta((src + dst) % nranks),
    where delta pairs +h_j and -h_j (h_j = count * (j + 1) // (pairs + 1)).
    As delta sums to 0 over the residues, every row and every column sums to
    nranks * count: each rank sends and receives exactly the even size."""
    pairs = nranks // 2
    delta = [0] * nranks
    for k in range(2 * pairs):
        h = count * (k // 2 + 1) // (pairs + 1)
        delta[k] = h if k % 2 == 0 else -h
    return [[count + delta[(src + dst) % nranks] for dst in range(nranks)] for src in range(nranks)]
