"""The expert-specific operators of a2a._C without autograd: the re-index
vector (:class:`ESIndex`, :func:`es_index`) and ``esmm_raw`` / ``ess_raw`` /
``estmm_raw`` (argument checks, outputs allocated beside the inputs, the
call on the input's device and stream). The public ops (a2a._es_ops) and
their autograd (a2a._torch_es_ops) are both built on these; see
a2a._es_ops for what they compute.
"""

from __future__ import annotations

from typing import Any

from . import _C
from ._arrays import (
    ArrayView,
    address_of,
    argument_view,
    claim_out,
    copy_of,
    empty_like,
    shown_copy,
    view,
)
from ._errors import InvalidArgumentError
from ._moe_kernels import FLOAT_DTYPES
from ._routing import INDEX_DTYPES, MAX_EXPERTS, _as_int

__all__ = ["ESIndex", "es_index", "esmm_raw", "ess_raw", "estmm_raw", "native_index", "require_index"]

ROWS = {"token": 0, "choice": 1}  # a2a_es_rows_t
LAYOUTS = {"nk": 0, "kn": 1}  # a2a_es_weight_layout_t
DEFAULT_TILE = 64


def _fail(op: str, message: str):
    raise InvalidArgumentError(f"{op}: {message}")


class ESIndex:
    """The re-index vector of one routing (made by :func:`a2a.es_index`).

    ``slots`` (num_slots,) int64: the choice ids t * k + j grouped by expert,
    expert e's at ``expert_starts[e] .. expert_starts[e] + counts[e] - 1`` in
    Tutel's slot order, then -1 up to ``expert_starts[e + 1]`` (a multiple of
    ``tile``). The arrays have the framework and device of the indices; the
    properties give copies (the kernels trust the index, so it cannot be
    changed through them).
    """

    __slots__ = ("_counts", "_indices", "_num_slots", "_slots", "_starts", "_tile")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("an a2a.ESIndex is made by a2a.es_index, not directly")

    @classmethod
    def _create(cls, indices: ArrayView, slots: Any, starts: Any, counts: Any, tile: int, num_slots: int) -> ESIndex:
        self = object.__new__(cls)
        self._indices, self._slots, self._starts, self._counts = indices, slots, starts, counts
        self._tile, self._num_slots = tile, num_slots
        return self

    _show = staticmethod(shown_copy)

    @property
    def indices(self) -> Any:
        """(T, k) the expert of each choice (a copy of the input); negative: not routed."""
        return self._show(self._indices.obj)

    @property
    def slots(self) -> Any:
        """(num_slots,) int64: choice ids grouped by expert, -1 = padding (a copy)."""
        return self._show(self._slots[: self._num_slots])

    @property
    def expert_starts(self) -> Any:
        """(E + 1,) int64: first slot of each expert, multiples of tile (a copy)."""
        return self._show(self._starts)

    @property
    def counts(self) -> Any:
        """(E,) int64: routed choices per expert (a copy)."""
        return self._show(self._counts)

    @property
    def num_tokens(self) -> int:
        """T, the tokens routed."""
        return self._indices.shape[0]

    @property
    def top_k(self) -> int:
        """k, the choices per token."""
        return self._indices.shape[1]

    @property
    def num_experts(self) -> int:
        """E, the experts the index routes to."""
        return self._counts.shape[0]

    @property
    def tile(self) -> int:
        """The padding multiple of every expert's sub-vector."""
        return self._tile

    @property
    def num_slots(self) -> int:
        """Length of the re-index vector (expert_starts[E])."""
        return self._num_slots

    def rows(self, rows: str) -> int:
        """Rows of an operand by token (T) or by choice (T * k)."""
        return self.num_tokens * (self.top_k if rows == "choice" else 1)

    def __repr__(self) -> str:
        return (f"ESIndex(num_tokens={self.num_tokens}, top_k={self.top_k}, num_experts={self.num_experts}, "
                f"tile={self.tile}, num_slots={self.num_slots}, on {self._indices.framework} "
                f"{self._indices.device_text})")


def native_index(index: ESIndex) -> tuple:
    return (index.num_tokens, index.top_k, index.num_experts, index.tile, index.num_slots, address_of(index._slots),
            address_of(index._starts), address_of(index._counts))


def es_index(indices: Any, num_experts: int, *, tile: int = DEFAULT_TILE) -> ESIndex:
    """The re-index vector of ``indices`` (T, k) int32/int64 (negative: not
    routed) over ``num_experts`` experts, each expert's sub-vector padded
    with -1 to a multiple of ``tile`` (the GPU kernels' row tile)."""
    op = "es_index"
    v = argument_view(indices, "indices", op)
    if len(v.shape) != 2 or v.dtype_name not in INDEX_DTYPES or v.shape[1] == 0:
        _fail(op, f"indices must be a 2-D (tokens, top_k >= 1) array of int32 or int64; got {v.describe()}")
    idx = view(copy_of(v.obj), "indices")  # private: the kernels trust the index
    num_experts = _as_int(num_experts, "num_experts", op, 1, MAX_EXPERTS)
    tile = _as_int(tile, "tile", op, 1)
    num_tokens, top_k = idx.shape
    capacity = _C.es_index_capacity(num_tokens, top_k, num_experts, tile)
    execution = idx.execution()
    slots = empty_like(idx, (max(capacity, 1),), "int64")
    starts = empty_like(idx, (num_experts + 1,), "int64")
    counts = empty_like(idx, (num_experts,), "int64")
    workspace = empty_like(idx, (_C.es_index_workspace_size(execution, num_tokens, top_k, num_experts),), "uint8")
    with idx.device_guard():
        num_slots = _C.es_index(execution, idx.address, idx.dtype_code, num_tokens, top_k, num_experts, tile,
                                address_of(workspace), workspace.nbytes, address_of(slots), capacity,
                                address_of(starts), address_of(counts))
    return ESIndex._create(idx, slots, starts, counts, tile, num_slots)


def require_index(index: Any, op: str) -> ESIndex:
    if not isinstance(index, ESIndex):
        _fail(op, f"index must be an a2a.ESIndex (from a2a.es_index), got {type(index).__name__}")
    return index


def _choice(value: Any, options: dict[str, int], what: str, op: str) -> str:
    if not isinstance(value, str) or value not in options:
        _fail(op, f"{what} must be one of {', '.join(map(repr, options))}; got {value!r}")
    return value


def _operand(x: Any, what: str, op: str, index: ESIndex, rows: str | None = None,
             dtype: str | None = None) -> ArrayView:
    """A 2-D float array beside the index: (index.rows(rows), D) when rows is given."""
    a = argument_view(x, what, op)
    if not a.same_place(index._indices):
        _fail(op, f"{what} ({a.describe()}) is not where the index is ({index._indices.framework} on "
                  f"{index._indices.device_text})")
    if a.dtype_name not in FLOAT_DTYPES or (dtype is not None and a.dtype_name != dtype):
        _fail(op, f"{what} must be of {dtype or ', '.join(FLOAT_DTYPES)}; got {a.describe()}")
    if rows is not None and (len(a.shape) != 2 or a.shape[0] != index.rows(rows)):
        _fail(op, f"{what} must be ({index.rows(rows)}, width) (by {rows}: {index.num_tokens} tokens"
                  f"{f' x top_k {index.top_k}' if rows == 'choice' else ''}); got {a.describe()}")
    return a


def _gates(gates: Any, op: str, index: ESIndex, data: ArrayView) -> ArrayView | None:
    if gates is None:
        return None
    g = _operand(gates, "gates", op, index)
    shape = (index.num_tokens, index.top_k)
    if g.shape != shape or g.dtype_name not in ("float32", data.dtype_name):
        _fail(op, f"gates must be {shape} of float32 or {data.dtype_name} (the data's dtype); got {g.describe()}")
    return g


def _exec_args(g: ArrayView | None, data: ArrayView) -> tuple[int, int]:
    return (0, data.dtype_code) if g is None else (g.address, g.dtype_code)


def _output(out: Any, like: ArrayView, shape: tuple[int, ...], op: str) -> Any:
    if out is None:
        return empty_like(like, shape)
    o = argument_view(out, "out", op)
    if not o.same_place(like) or o.dtype_name != like.dtype_name or tuple(o.shape) != shape or not o.writeable:
        _fail(op, f"out is a {o.describe()}; expected a writeable {like.framework} {like.dtype_name} array of shape "
                  f"{shape} on {like.device_text}")
    recorded = claim_out(out)
    if recorded is not None:
        _fail(op, recorded)
    return o.obj


def esmm_raw(x: Any, w: Any, index: ESIndex, bias: Any, gates: Any, x_rows: str, y_rows: str, w_layout: str,
             op: str = "esmm", out: Any = None) -> Any:
    """esmm without autograd (the checks and the kernel call)."""
    _choice(x_rows, ROWS, "x_rows", op)
    _choice(y_rows, ROWS, "y_rows", op)
    _choice(w_layout, LAYOUTS, "w_layout", op)
    a = _operand(x, "x", op, index, x_rows)
    depth = a.shape[1]
    wv = _operand(w, "w", op, index, dtype=a.dtype_name)
    if len(wv.shape) != 3 or wv.shape[0] != index.num_experts or wv.shape[1 if w_layout == "kn" else 2] != depth:
        want = "(E, K, N)" if w_layout == "kn" else "(E, N, K)"
        _fail(op, f"w must be {want} with E = {index.num_experts} experts and K = {depth} (x's width) for "
                  f"w_layout={w_layout!r}; got {wv.describe()}")
    n = wv.shape[2 if w_layout == "kn" else 1]
    b = None
    if bias is not None:
        b = _operand(bias, "bias", op, index, dtype=a.dtype_name)
        if tuple(b.shape) != (index.num_experts, n):
            _fail(op, f"bias must be ({index.num_experts}, {n}) (E, N); got {b.describe()}")
    g = _gates(gates, op, index, a)
    y = _output(out, a, (index.rows(y_rows), n), op)
    workspace_bytes = _C.esmm_workspace_size(native_index(index), ROWS[y_rows], n, a.dtype_code)
    workspace = empty_like(a, (workspace_bytes,), "uint8") if workspace_bytes else None
    with a.device_guard():
        _C.esmm(a.execution(), native_index(index), a.address, ROWS[x_rows], depth, wv.address, LAYOUTS[w_layout],
                0 if b is None else b.address, *_exec_args(g, a), a.dtype_code, n, address_of(y), ROWS[y_rows],
                0 if workspace is None else address_of(workspace), workspace_bytes)
    return y


def ess_raw(x: Any, index: ESIndex, gates: Any, rows: str, op: str = "ess") -> Any:
    _choice(rows, ROWS, "rows", op)
    a = _operand(x, "x", op, index, rows)
    g = _gates(gates, op, index, a)
    out = empty_like(a, (index.num_experts, a.shape[1]))
    with a.device_guard():
        _C.ess(a.execution(), native_index(index), a.address, ROWS[rows], *_exec_args(g, a), a.dtype_code,
               a.shape[1], address_of(out))
    return out


def estmm_raw(a: Any, b: Any, index: ESIndex, gates: Any, a_rows: str, b_rows: str, op: str = "estmm") -> Any:
    _choice(a_rows, ROWS, "a_rows", op)
    _choice(b_rows, ROWS, "b_rows", op)
    av = _operand(a, "a", op, index, a_rows)
    bv = _operand(b, "b", op, index, b_rows, dtype=av.dtype_name)
    g = _gates(gates, op, index, av)
    out = empty_like(av, (index.num_experts, av.shape[1], bv.shape[1]))
    with av.device_guard():
        _C.estmm(av.execution(), native_index(index), av.address, ROWS[a_rows], av.shape[1], bv.address,
                 ROWS[b_rows], bv.shape[1], *_exec_args(g, av), av.dtype_code, address_of(out))
    return out
