"""What every rank of a layer must construct and call alike, checked across
the ranks with one small all-gather, so that a difference raises the same
error on every rank instead of training silently or timing out.

- :func:`agree_construction` ``(comm, owner, fields)``: the configuration a
  layer was built with, ``{name: value}``. Each value becomes a text
  (:func:`describe`; a function by its ``module.qualname``,
  :func:`callable_name`) and travels as an 8-byte digest: one all-gather of
  one int64 per field (and one for the fields' names). A field that differs
  raises :class:`a2a.MismatchError` on every rank, naming it and each rank's
  value; the values are gathered, by a second all-gather, only then.
- :class:`CallFields`: a call's tokens as the ranks must pass them alike, their
  model dim (the last dimension) and dtype, and whether this rank could
  route them. The layer appends its three ``columns()`` to the row its call
  all-gathers anyway, and ``check()`` reads them back from the gathered
  table before anything whose sizes depend on them: no collective of its own.

Both are collective over `comm` (through common.host_values, either device).
"""

from __future__ import annotations

import dataclasses
import hashlib
import zlib
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

import a2a

from .host_values import all_gather_values

__all__ = ["CallFields", "agree_construction", "callable_name", "describe"]

TEXT_LIMIT = 160  # bytes of a value shown in a mismatch message (longer ones end in "...")


def callable_name(fn: Callable[..., Any]) -> str:
    """A function as every process names it: ``module.qualname``
    (``torch.nn.functional.gelu``); an object such as ``torch.nn.GELU()`` by
    its repr; ``"an unnamed function"`` for a lambda or a function local to
    another (no name identifies it across processes; all such are alike)."""
    qualname = getattr(fn, "__qualname__", None)
    if not isinstance(qualname, str):
        return describe(fn)
    if "<" in qualname:  # <lambda>, f.<locals>.g
        return "an unnamed function"
    module = getattr(fn, "__module__", None)
    return f"{module}.{qualname}" if module else qualname


def describe(value: Any) -> str:
    """`value` as a text that is the same on every rank for the same setting:
    containers element by element, functions by name, objects by their repr
    unless it is the default one (which holds an address): then by type."""
    if isinstance(value, (list, tuple)):
        inner = ", ".join(describe(item) for item in value)
        return f"({inner},)" if isinstance(value, tuple) and len(value) == 1 else f"({inner})"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{key}: {describe(value[key])}" for key in sorted(value, key=str)) + "}"
    if isinstance(value, (str, int, float, bool, torch.dtype)) or value is None:
        return repr(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):  # settings, field by field
        inner = ", ".join(f"{field.name}={describe(getattr(value, field.name))}" for field in dataclasses.fields(value))
        return f"{type(value).__name__}({inner})"
    if callable(value) and hasattr(value, "__qualname__"):
        return callable_name(value)
    if type(value).__repr__ is object.__repr__:
        return f"a {type(value).__qualname__}"
    return repr(value)


def _digest(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little", signed=True)


def _digest_row(names: list[str], texts: list[str]) -> np.ndarray:
    """One rank's row of the construction agreement: the names' digest, then each value's."""
    return np.array([_digest("\0".join(names)), *(_digest(text) for text in texts)], dtype=np.int64)


def _text_rows(texts: list[str]) -> np.ndarray:
    """`texts` as (len(texts) * TEXT_LIMIT,) uint8, each cut to TEXT_LIMIT bytes and zero-padded."""
    rows = np.zeros((len(texts), TEXT_LIMIT), dtype=np.uint8)
    for i, text in enumerate(texts):
        data = text.encode("utf-8")
        if len(data) > TEXT_LIMIT:
            data = data[: TEXT_LIMIT - 3] + b"..."
        rows[i, : len(data)] = np.frombuffer(data, dtype=np.uint8)
    return rows.reshape(-1)


def _gathered_texts(texts: list[str], comm: a2a.Comm) -> list[list[str]]:
    """Every rank's `texts` (the same count on every rank): [rank][i]. Collective (one all-gather)."""
    table = all_gather_values(_text_rows(texts), comm).reshape(comm.size, len(texts), TEXT_LIMIT)
    return [[bytes(row).rstrip(b"\0").decode("utf-8", errors="ignore") for row in rank] for rank in table]


def agree_construction(comm: a2a.Comm, owner: str, fields: Mapping[str, Any]) -> None:
    """Collective: checks that every rank constructed `owner` (e.g.
    ``"MoELayer"``) with the same `fields` ({name: value}; every rank passes
    the same names, in the same order). A difference raises
    :class:`a2a.MismatchError` on every rank: "MoELayer on rank 1: the ranks
    were constructed with different hidden_size_per_expert (rank 0: 64,
    rank 1: 32, rank 2: 64)", each differing field so. One all-gather of
    len(fields) + 1 int64; a second one, of the differing values, only to
    show them."""
    names = list(fields)
    texts = [describe(fields[name]) for name in names]
    row = _digest_row(names, texts)
    table = all_gather_values(row, comm).reshape(comm.size, len(row))
    where = f"{owner} on rank {comm.rank}"
    if (table[:, 0] != table[0, 0]).any():
        raise a2a.MismatchError(f"{where}: the ranks check different configuration fields (this rank: {names}); "
                                "every rank must run the same version of the code")
    differing = [i for i in range(len(names)) if (table[:, 1 + i] != table[0, 1 + i]).any()]
    if not differing:
        return
    shown = _gathered_texts([texts[i] for i in differing], comm)
    parts = []
    for j, i in enumerate(differing):
        values = ", ".join(f"rank {rank}: {shown[rank][j]}" for rank in range(comm.size))
        parts.append(f"{names[i]} ({values})")
    raise a2a.MismatchError(f"{where}: the ranks were constructed with different {'; and '.join(parts)}; every "
                            f"rank must construct the {owner} with the same settings")


def _dtype_code(dtype: torch.dtype) -> int:
    """A dtype as an int64 every process computes alike (a CRC of its name)."""
    return zlib.crc32(str(dtype).encode())


_DTYPE_NAMES: dict[int, str] = {}


def _dtype_name(code: int) -> str:
    if not _DTYPE_NAMES:
        _DTYPE_NAMES.update({_dtype_code(d): str(d) for d in vars(torch).values() if isinstance(d, torch.dtype)})
    return _DTYPE_NAMES.get(int(code), f"a dtype unknown to this rank's torch (code {int(code)})")


class CallFields:
    """One call's tokens `x` as every rank must pass them alike: their model
    dim (x's last dimension) and dtype, and whether this rank could route
    them (``error``: set when x does not end with `model_dim`, or by
    :meth:`attempt`). ``owner``: who calls, with the rank ("MoELayer on rank 1").

    The caller appends :meth:`columns` (WIDTH int64) to its call's agreement
    row and hands those columns of the gathered table to :meth:`check`, which
    raises on every rank: MismatchError naming model_dim or dtype and each
    rank's value; else this rank's own error here and RemoteError on the
    others. A rank whose ``error`` is set skips its work up to that
    agreement and joins it with the same row (its other values unused)."""

    WIDTH = 3  # model dim, dtype code, failed (0 / 1)

    def __init__(self, x: torch.Tensor, model_dim: int, owner: str):
        self.owner = owner
        self.model_dim = int(x.shape[-1]) if x.dim() else -1
        self.dtype = x.dtype
        self.error: BaseException | None = None
        if self.model_dim != model_dim:
            self.error = ValueError(f"{owner}: input {tuple(x.shape)} must end with model_dim {model_dim}")
        elif not x.is_floating_point():
            self.error = TypeError(f"{owner}: input of dtype {x.dtype}; the layer takes floating-point tokens")

    def tokens(self, x: torch.Tensor) -> torch.Tensor:
        """x as (T, its own last dimension): the layer's tokens when there is no error."""
        return x if x.dim() == 2 else x.reshape(-1, max(self.model_dim, 1))

    def attempt(self, step: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """step(*args, **kwargs), this rank's work before the agreement (no
        collective in it), or None if it raised: the error is kept, to be
        raised by :meth:`check` on this rank once every rank knows of it."""
        try:
            return step(*args, **kwargs)
        except Exception as error:  # noqa: BLE001 -- raised again in check(), with every rank
            self.error = error
            return None

    def columns(self) -> list[int]:
        return [self.model_dim, _dtype_code(self.dtype), int(self.error is not None)]

    def check(self, gathered: np.ndarray) -> None:
        """`gathered`: (W, WIDTH), every rank's :meth:`columns`, rank after rank."""
        gathered = np.asarray(gathered).reshape(-1, self.WIDTH)
        parts = []
        for column, name, show in ((0, "model_dim", str), (1, "dtype", _dtype_name)):
            values = gathered[:, column]
            if (values != values[0]).any():
                parts.append(f"{name} ({', '.join(f'rank {i}: {show(v)}' for i, v in enumerate(values))})")
        if parts:
            raise a2a.MismatchError(f"{self.owner}: the ranks passed tokens of different {'; and '.join(parts)}; "
                                    "every rank must pass tokens of the same model dim (last dimension) and dtype")
        if self.error is not None:
            raise self.error
        failed = np.flatnonzero(gathered[:, 2]).tolist()
        if failed:
            raise a2a.RemoteError(f"{self.owner}: rank(s) {failed} could not route their tokens (their own error "
                                  "says why); no rank ran the call")
