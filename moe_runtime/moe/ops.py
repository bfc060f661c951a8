"""Tutel's low-level MoE ops (``tutel.moe``) under Tutel's names, over a2a's kernels.

A Tutel program routes with ``extract_critical`` (also ``top_k_routing``)
and hands the result, ``crit``, to ``fast_encode`` / ``fast_decode`` or to a
``fast_dispatcher``. Here the slots come from :func:`a2a.route` and the rows
move through :func:`a2a.fast_encode` / :func:`a2a.fast_decode`, with their
autograd (a2a.torch) for the data and the gates.

``crit`` is Tutel's tuple ``(num_global_experts, indices_s, locations_s,
gates_s, capacity, dispatch_count)``. extract_critical returns it as a
:class:`CriticalData`, whose ``routing`` is the a2a.Routing of its slots. A
plain tuple of the same parts works too (programs build and edit crit): its
routing is computed again by a2a.route with its capacity, tokens in order,
and its locations must be those slots (all first choices before any second
choice; a choice at or past the capacity is dropped, whatever its value),
else a ValueError names the first choice that differs. A routing is
remembered with the index and location tensors it describes, for as long as
they live unchanged, so the calls that share them (encode, decode, a
dispatcher's update) route once; and a batch-prioritized crit, whose token
order cannot be read back from its tensors, works as long as its tensors are
those extract_critical returned.

Where this differs from Tutel, and why:

- Rows move in the data's own dtype (float32, float64, float16, bfloat16;
  decode accumulates in float32, in float64 for float64): Tutel moves all
  but CUDA float16 in float32, so its float64 results are float32-accurate.
- ``dispatch_count`` is each expert's number of choices before the capacity,
  and ``capacity_factor <= 0`` takes the largest of those, also under
  batch-prioritized routing (Tutel then reads the last token's row of the
  sorted locations, which is not the counts and can drop choices).
- Batch-prioritized ties keep token order (Tutel's sort is not stable).
- A capacity of 0 (a small positive factor) gives an (E, 0, M) buffer and
  zeros at decode; Tutel's reshape fails on it.
- Bad input raises TypeError / ValueError naming the argument, where Tutel
  asserts or reads out of bounds; ``fast_dispatcher.update(capacity=None)``
  keeps the dispatcher's capacity (Tutel's ``int(None)`` raises).
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.weak import WeakIdKeyDictionary

import a2a

from ..gating.capacity import buffer_capacity
from ..gating.losses import gshard_loss

__all__ = [
    "CriticalData",
    "FastDispatcher",
    "extract_critical",
    "fast_cumsum_sub_one",
    "fast_decode",
    "fast_dispatcher",
    "fast_encode",
    "top_k_routing",
]

DATA_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)  # what a2a's kernels move


class CriticalData(tuple):
    """Tutel's crit: ``(num_global_experts, indices_s, locations_s, gates_s,
    capacity, dispatch_count)``.

    ``indices_s`` / ``locations_s`` / ``gates_s``: lists of k (T,) tensors
    (int32 expert, int32 slot, gate of each token's j-th choice);
    ``capacity``: rows per expert; ``dispatch_count``: (E,) int64 choices per
    expert before the capacity. ``routing`` is the a2a.Routing of the current
    parts (the one extract_critical computed while they are unchanged).
    ``token_priority`` is the (T,) score that ordered the tokens (descending)
    under batch-prioritized routing, None for token order.
    """

    def __new__(cls, num_global_experts: int, indices_s: list, locations_s: list, gates_s: list, capacity: int,
                dispatch_count: torch.Tensor, *, token_priority: torch.Tensor | None = None):
        self = super().__new__(cls, (num_global_experts, indices_s, locations_s, gates_s, capacity, dispatch_count))
        self.token_priority = token_priority
        return self

    def __reduce__(self) -> tuple:
        # Copies and pickles keep the token order, so their routing can be computed again.
        return (_restore_critical, (tuple(self), self.token_priority))

    num_global_experts = property(lambda self: self[0], doc="E, the experts")
    indices_s = property(lambda self: self[1], doc="k (T,) int32 tensors: the expert of each choice")
    locations_s = property(lambda self: self[2], doc="k (T,) int32 tensors: the slot of each choice")
    gates_s = property(lambda self: self[3], doc="k (T,) tensors: the gate of each choice")
    capacity = property(lambda self: self[4], doc="C, the rows per expert")
    dispatch_count = property(lambda self: self[5], doc="(E,) int64: choices per expert before the capacity")

    @property
    def routing(self) -> a2a.Routing:
        """The a2a.Routing of these parts."""
        return _routing_for(self[0], self[1], self[2], self[4], "CriticalData.routing", self.token_priority)

    def __repr__(self) -> str:
        num_tokens = self[1][0].numel() if len(self[1]) else 0
        return (f"CriticalData(num_global_experts={self[0]}, top_k={len(self[1])}, num_tokens={num_tokens}, "
                f"capacity={self[4]})")


def _restore_critical(parts: tuple, token_priority: torch.Tensor | None) -> CriticalData:
    return CriticalData(*parts, token_priority=token_priority)


def fast_cumsum_sub_one(data: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """Tutel's fast_cumsum_sub_one (tutel.jit_kernels.gating): the inclusive
    cumulative sum along `dim`, minus one. On a (T, E) one-hot mask of the
    choices it gives each token its slot at its expert. Tutel's runs a CUDA
    kernel for 2-D data along dim 0 (and refuses the rest); this is
    ``torch.cumsum(data, dim) - 1`` for any shape and dim (integer data gives
    int64)."""
    if not isinstance(data, torch.Tensor):
        raise TypeError(f"fast_cumsum_sub_one: data must be a torch.Tensor, got {type(data).__name__}")
    return torch.cumsum(data, dim=dim) - 1


def extract_critical(scores: torch.Tensor, top_k: int, loss_fn: Any = gshard_loss, capacity_factor: float = 1.0,
                     batch_prioritized_routing: bool = False, normalize_gate: bool = True, alignment: int = 1,
                     group: Any = None, inequivalent_tokens: bool = False) -> tuple[CriticalData, Any]:
    """Tutel's top-k routing of the gate's scores: ``(crit, l_loss)``.

    scores (T, E), floating: each token's top min(top_k, E) experts; their
    scores are the gates, divided by max(their sum, eps) when
    ``normalize_gate`` and k > 1; ``l_loss = loss_fn(scores, topk_ids)``
    (GShard's loss by default; None when loss_fn is None). The capacity,
    with T_max = T (the largest T over ``group`` when
    ``inequivalent_tokens``): ``top_k * int(f * ceil(T_max / E))`` for a
    factor f > 0; for f == 0 the largest number of choices any expert gets on
    any rank of ``group``; for f < 0 the smaller of that and the rule for -f;
    then rounded up to a multiple of ``alignment``. Slots are handed out by
    a2a.route: all first choices before any second choice, tokens in order
    (by descending top score with ``batch_prioritized_routing``, ties in
    token order). ``group`` (a torch.distributed group, an a2a.Comm, or None
    for the job) is used only for f <= 0 and ``inequivalent_tokens``: then
    every rank of it must call this. See :class:`CriticalData` for crit.
    """
    op = "extract_critical"
    if not isinstance(scores, torch.Tensor) or scores.dim() != 2 or not scores.is_floating_point():
        raise ValueError(f"{op}: scores must be a (tokens, experts) floating torch.Tensor; got {_describe(scores)}")
    num_tokens, num_experts = scores.shape
    if num_experts == 0:
        raise ValueError(f"{op}: scores has no experts (shape {tuple(scores.shape)})")
    top_k = min(_positive_int(top_k, "top_k", op), num_experts)  # as Tutel: k above E means E
    alignment = _positive_int(alignment, "alignment", op)
    factor = _finite(capacity_factor, "capacity_factor", op)

    topk_ids = torch.topk(scores, top_k, dim=1).indices  # (T, k) int64
    gates_s = list(scores.gather(1, topk_ids).t().contiguous().unbind(0))
    if normalize_gate and top_k > 1:
        denominator = torch.clamp(sum(gates_s), min=torch.finfo(scores.dtype).eps)
        gates_s = [gate / denominator for gate in gates_s]
    l_loss = None if loss_fn is None else loss_fn(scores, topk_ids)
    dispatch_count = torch.bincount(topk_ids.reshape(-1), minlength=num_experts)

    num_samples, most_chosen = num_tokens, 0
    if factor <= 0 or inequivalent_tokens:
        most_chosen = int(dispatch_count.max()) if factor <= 0 else 0
        agreed_tokens, most_chosen = _group_max([num_tokens, most_chosen], group, scores.device)
        if inequivalent_tokens:
            num_samples = agreed_tokens
    capacity = buffer_capacity(_tutel_capacity(factor, num_samples, num_experts, top_k, most_chosen), alignment)

    indices = topk_ids.to(torch.int32)
    priority = scores.detach().amax(dim=1).contiguous() if batch_prioritized_routing else None
    routing = _route(indices, num_experts, capacity, priority)
    indices_s = list(indices.t().contiguous().unbind(0))
    locations_s = list(routing.locations.t().to(torch.int32).contiguous().unbind(0))
    _remember(routing, num_experts, capacity, indices_s, locations_s, priority)
    crit = CriticalData(num_experts, indices_s, locations_s, gates_s, capacity, dispatch_count,
                        token_priority=priority)
    return crit, l_loss


top_k_routing = extract_critical


def fast_encode(data: torch.Tensor, critial_data: Any, is_postscore: bool = True) -> torch.Tensor:
    """Tutel's fast_encode: data (T, M), C-contiguous -> (E, C, M), each kept
    choice's token row at its expert's slot, zeros elsewhere; scaled by its
    gate when ``is_postscore`` is False (else the gates apply at decode).
    Runs a2a.fast_encode in data's dtype; differentiable in data and, when
    applied here, in crit's gates_s."""
    op = "fast_encode"
    num_experts, indices_s, locations_s, gates_s, capacity = _parts(critial_data, op)
    routing = _routing_for(num_experts, indices_s, locations_s, capacity, op, _priority_of(critial_data))
    tokens = _rows(data, routing.num_tokens, "data", op)
    gates = None if is_postscore else _stacked_gates(gates_s, routing, tokens.dtype, op)
    return _encode(tokens, routing, gates).view(num_experts, capacity, tokens.shape[1])


def fast_decode(data: torch.Tensor, critial_data: Any, is_postscore: bool = True) -> torch.Tensor:
    """Tutel's fast_decode: data (E, C, M) (any C-contiguous shape of E * C
    rows of M) -> (T, M), each token's sum over its kept choices of its row
    at the choice's slot, times the gate when ``is_postscore`` (else
    unscaled: the gates applied at encode). Runs a2a.fast_decode in data's
    dtype; differentiable in data and, when applied here, in crit's gates_s."""
    op = "fast_decode"
    num_experts, indices_s, locations_s, gates_s, capacity = _parts(critial_data, op)
    routing = _routing_for(num_experts, indices_s, locations_s, capacity, op, _priority_of(critial_data))
    rows = _rows(data, num_experts * capacity, "data", op)
    gates = _stacked_gates(gates_s, routing, rows.dtype, op) if is_postscore else None
    return _decode(rows, routing, gates)


class FastDispatcher:
    """Tutel's TutelMoeFastDispatcher (``tutel.moe.fast_dispatcher``): a
    routing kept between calls. ``update`` takes crit's lists (and the
    capacity), ``encode(data)`` gives (E * C, M), ``decode(data)`` (T, M), both
    in ``dispatch_dtype`` (data is converted to it first, differentiably).
    Tutel moves all but CUDA float16 in float32; a2a moves float32, float64,
    float16 and bfloat16 as they are."""

    def __init__(self, num_global_experts: int, capacity: int, model_dim: int, dispatch_dtype: torch.dtype):
        op = "fast_dispatcher"
        self.num_global_experts = _positive_int(num_global_experts, "num_global_experts", op)
        self.capacity = _int(capacity, "capacity", op, 0)
        self.model_dim = _int(model_dim, "model_dim", op, 0)
        if dispatch_dtype not in DATA_DTYPES:
            raise ValueError(f"{op}: dispatch_dtype must be one of {', '.join(map(str, DATA_DTYPES))}; "
                             f"got {dispatch_dtype!r}")
        self.dtype = self.original_dtype = dispatch_dtype
        self.routing: a2a.Routing | None = None

    def update(self, indices_: Any, locations_: Any, gates_: Any, capacity: int | None = None,
               is_postscore: bool = True) -> None:
        """Routes crit's indices_s, locations_s and gates_s with `capacity`
        (0 or None: the dispatcher's own); gates apply at decode when
        ``is_postscore``, else at encode."""
        op = "fast_dispatcher.update"
        if capacity is not None:
            self.capacity = _int(capacity, "capacity", op, 0) or self.capacity
        self.routing = _routing_for(self.num_global_experts, indices_, locations_, self.capacity, op)
        self.indices_, self.locations_, self.gates_ = list(indices_), list(locations_), list(gates_)
        self.sample_size, self.is_postscore = self.routing.num_tokens, bool(is_postscore)
        self._gates = _stacked_gates(self.gates_, self.routing, self.dtype, op)

    def encode(self, data: torch.Tensor) -> torch.Tensor:
        """data (T, model_dim) -> (E * C, model_dim)."""
        routing = self._routing("encode")
        tokens = _rows(data, routing.num_tokens, "data", "fast_dispatcher.encode", self.model_dim).to(self.dtype)
        rows = _encode(tokens, routing, None if self.is_postscore else self._gates)
        return rows.view(self.num_global_experts * self.capacity, self.model_dim)

    def decode(self, data: torch.Tensor) -> torch.Tensor:
        """data (E * C rows of model_dim) -> (T, model_dim)."""
        routing = self._routing("decode")
        rows = _rows(data, self.num_global_experts * self.capacity, "data", "fast_dispatcher.decode", self.model_dim)
        return _decode(rows.to(self.dtype), routing, self._gates if self.is_postscore else None)

    def _routing(self, verb: str) -> a2a.Routing:
        if self.routing is None:
            raise RuntimeError(f"fast_dispatcher.{verb}: call update(indices_, locations_, gates_) first")
        return self.routing


fast_dispatcher = FastDispatcher


# --- the kernels ---------------------------------------------------------------------------------


def _encode(tokens: torch.Tensor, routing: a2a.Routing, gates: torch.Tensor | None) -> torch.Tensor:
    """(T, M) -> (E * C, M) rows (C may be 0)."""
    return a2a.fast_encode(tokens, routing, gates).reshape(routing.num_rows, tokens.shape[1])


def _decode(rows: torch.Tensor, routing: a2a.Routing, gates: torch.Tensor | None) -> torch.Tensor:
    """(E * C, M) rows -> (T, M)."""
    if not routing.per_expert:  # per-expert only for capacity 0, whose buffer is (0, M)
        rows = rows.view(routing.num_experts, routing.capacity, rows.shape[1])
    return a2a.fast_decode(rows, routing, gates)


def _route(indices: torch.Tensor, num_experts: int, capacity: int, priority: torch.Tensor | None) -> a2a.Routing:
    """a2a.route with one capacity; capacity 0 (which a2a's one-capacity layout
    refuses) as E per-expert capacities of 0: an empty buffer, every choice dropped."""
    options: dict[str, Any] = {"capacity": capacity if capacity > 0 else [0] * num_experts}
    if priority is not None:
        options.update(scores=priority, batch_prioritized=True)
    return a2a.route(indices, num_experts, **options)


def _tutel_capacity(factor: float, num_samples: int, num_experts: int, top_k: int, most_chosen: int) -> int:
    """Tutel's capacity before alignment. capacity.py's rule_capacity("tutel")
    raises it to at least 1; Tutel keeps 0 (a small factor drops every choice)."""
    samples_per_expert = -(-num_samples // num_experts)
    if factor > 0:
        return top_k * int(factor * samples_per_expert)
    if factor < 0:
        return min(most_chosen, top_k * int(-factor * samples_per_expert))
    return most_chosen


def _group_max(values: list[int], group: Any, device: torch.device) -> list[int]:
    """The maxima of `values` over the ranks of `group` (as Tutel, nothing
    moves for a group of one rank)."""
    from .communicator import communicator, group_size

    if group_size(group) == 1:
        return values
    if isinstance(group, a2a.Comm):
        comm = group  # any device: these are host numbers
    else:
        comm = communicator(group, "cuda" if device.type == "cuda" else "cpu")
    if comm.device == "cuda":
        buffer = torch.tensor(values, dtype=torch.int64, device=torch.device("cuda", comm.cuda_device))
    else:
        buffer = np.array(values, dtype=np.int64)
    return [int(v) for v in a2a.all_reduce(buffer, comm=comm, op="max").tolist()]


# --- routings of crit's tensors --------------------------------------------------------------------


@dataclass(frozen=True)
class _Record:
    """A routing and the tensors it was made for (held weakly, with their
    in-place version counters): it describes them while both are unchanged."""

    routing: a2a.Routing
    num_experts: int
    capacity: int
    tensors: tuple[tuple[weakref.ref, int], ...]
    priority: torch.Tensor | None

    def same_tensors(self, tensors: tuple[torch.Tensor, ...]) -> bool:
        return len(tensors) == len(self.tensors) and all(
            ref() is t and t._version == version for (ref, version), t in zip(self.tensors, tensors))


# Keyed by the first location tensor, weakly: a record lives as long as that tensor.
_RECORDS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _remember(routing: a2a.Routing, num_experts: int, capacity: int, indices_s: list, locations_s: list,
              priority: torch.Tensor | None) -> None:
    tensors = tuple((weakref.ref(t), t._version) for t in (*indices_s, *locations_s))
    _RECORDS[locations_s[0]] = _Record(routing, num_experts, capacity, tensors, priority)


def _routing_for(num_experts: Any, indices_s: Any, locations_s: Any, capacity: Any, op: str,
                 priority: torch.Tensor | None = None) -> a2a.Routing:
    """The routing of crit's parts: remembered, or computed by a2a.route (in
    the remembered or the given token order) and checked against the locations."""
    num_experts = _positive_int(num_experts, "num_global_experts (crit[0])", op)
    capacity = _int(capacity, "capacity (crit[4])", op, 0)
    indices_s, locations_s = _choices(indices_s, "indices_s", op), _choices(locations_s, "locations_s", op)
    if len(indices_s) != len(locations_s) or indices_s[0].numel() != locations_s[0].numel():
        raise ValueError(f"{op}: indices_s and locations_s must both be k (T,) tensors; got {len(indices_s)} of "
                         f"{indices_s[0].numel()} and {len(locations_s)} of {locations_s[0].numel()} elements")
    record = _RECORDS.get(locations_s[0])
    if record is not None and record.same_tensors((*indices_s, *locations_s)):
        if (record.num_experts, record.capacity) == (num_experts, capacity):
            return record.routing
        priority = record.priority if priority is None else priority
    indices = torch.stack([t.reshape(-1).long() for t in indices_s], dim=1)
    if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= num_experts):
        raise ValueError(f"{op}: indices_s hold experts {int(indices.min())}..{int(indices.max())}; "
                         f"expected 0..{num_experts - 1} (num_global_experts = {num_experts})")
    routing = _route(indices, num_experts, capacity, priority)
    _check_locations(routing, locations_s, capacity, op)
    _remember(routing, num_experts, capacity, indices_s, locations_s, priority)
    return routing


def _check_locations(routing: a2a.Routing, locations_s: list, capacity: int, op: str) -> None:
    """Raises unless the given locations put every choice where a2a.route
    does (a dropped choice anywhere at or past the capacity)."""
    given = torch.stack([t.reshape(-1).long() for t in locations_s], dim=1)
    slots = routing.locations
    wrong = torch.where(slots < capacity, given != slots, given < capacity)
    if not bool(wrong.any()):
        return
    token, choice = (int(i) for i in wrong.nonzero()[0])
    slot, value = int(slots[token, choice]), int(given[token, choice])
    where = f"at slot {slot}" if slot < capacity else f"past the capacity {capacity} (slot {slot}: dropped)"
    raise ValueError(
        f"{op}: locations_s[{choice}][{token}] = {value}, but a2a.route puts choice {choice} of token {token} "
        f"{where}. A crit built by hand must use a2a's slots: all first choices before any second choice, "
        "tokens in order; a batch-prioritized crit works only with the tensors extract_critical returned")


# --- argument checks -------------------------------------------------------------------------------


def _parts(crit: Any, op: str) -> tuple[Any, Any, Any, Any, Any]:
    """crit's (num_global_experts, indices_s, locations_s, gates_s, capacity)."""
    if not isinstance(crit, (tuple, list)) or len(crit) != 6:
        raise TypeError(f"{op}: critial_data must be extract_critical's crit, a tuple (num_global_experts, "
                        f"indices_s, locations_s, gates_s, capacity, dispatch_count); got {_describe(crit)}")
    return crit[0], crit[1], crit[2], crit[3], crit[4]


def _priority_of(crit: Any) -> torch.Tensor | None:
    return crit.token_priority if isinstance(crit, CriticalData) else None


def _choices(tensors: Any, what: str, op: str) -> list[torch.Tensor]:
    """k >= 1 integer tensors of T elements each, on one device."""
    if not isinstance(tensors, (list, tuple)) or not tensors:
        raise TypeError(f"{op}: {what} must be a non-empty list of k (T,) tensors; got {_describe(tensors)}")
    first = tensors[0]
    for j, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor) or t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise TypeError(f"{op}: {what}[{j}] must be an integer torch.Tensor; got {_describe(t)}")
        if t.numel() != first.numel() or t.device != first.device:
            raise ValueError(f"{op}: {what}[{j}] is {_describe(t)}; expected {first.numel()} elements on "
                             f"{first.device}, as {what}[0]")
    return list(tensors)


def _stacked_gates(gates_s: Any, routing: a2a.Routing, data_dtype: torch.dtype, op: str) -> torch.Tensor:
    """crit's gates_s as a2a's (T, k) gates, of float32 or the data's dtype."""
    num_tokens, top_k = routing.num_tokens, routing.top_k
    if not isinstance(gates_s, (list, tuple)) or len(gates_s) != top_k:
        raise TypeError(f"{op}: gates_s must be a list of k = {top_k} (T,) tensors; got {_describe(gates_s)}")
    for j, g in enumerate(gates_s):
        if not isinstance(g, torch.Tensor) or not g.is_floating_point() or g.numel() != num_tokens:
            raise ValueError(f"{op}: gates_s[{j}] must be a floating tensor of T = {num_tokens} elements; "
                             f"got {_describe(g)}")
    gates = torch.stack([g.reshape(-1) for g in gates_s], dim=1)
    if gates.dtype not in (torch.float32, data_dtype):
        gates = gates.to(data_dtype if data_dtype in (torch.float32, torch.float64) else torch.float32)
    return gates


def _rows(data: Any, num_rows: int, what: str, op: str, model_dim: int | None = None) -> torch.Tensor:
    """`data` as a (num_rows, M) view: C-contiguous, floating, leading dims of num_rows elements."""
    if not isinstance(data, torch.Tensor):
        raise TypeError(f"{op}: {what} must be a torch.Tensor, got {type(data).__name__}")
    if not data.is_contiguous():
        raise ValueError(f"{op}: {what} ({_describe(data)}) must be contiguous, as in Tutel; "
                         "call .contiguous() first")
    if data.dtype not in DATA_DTYPES:
        raise ValueError(f"{op}: {what} must be one of {', '.join(map(str, DATA_DTYPES))}; got {_describe(data)}")
    rows = math.prod(data.shape[:-1]) if data.dim() >= 2 else -1
    if rows != num_rows or (model_dim is not None and data.shape[-1] != model_dim):
        dim = "M" if model_dim is None else model_dim
        raise ValueError(f"{op}: {what} must be ({num_rows}, {dim}) (or another shape of {num_rows} rows of "
                         f"{dim}); got {_describe(data)}")
    return data.view(num_rows, data.shape[-1])


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        layout = "" if value.is_contiguous() else "non-contiguous "
        return f"a {layout}{tuple(value.shape)} {value.dtype} tensor on {value.device}"
    if isinstance(value, (list, tuple)):
        return f"a {type(value).__name__} of {len(value)} items"
    return f"{type(value).__name__} {value!r}"


def _int(value: Any, what: str, op: str, minimum: int) -> int:
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{op}: {what} must be an integer, got {_describe(value)}")
    if value < minimum:
        raise ValueError(f"{op}: {what} must be >= {minimum}, got {value}")
    return int(value)


def _positive_int(value: Any, what: str, op: str) -> int:
    return _int(value, what, op, 1)


def _finite(value: Any, what: str, op: str) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{op}: {what} must be a number, got {_describe(value)}") from None
    if not math.isfinite(number):
        raise ValueError(f"{op}: {what} must be finite, got {number}")
    return number
