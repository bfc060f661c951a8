"""MoELayer(cuda_graphs=N): a training step's forward and backward captured
into CUDA graphs and replayed, one pair per call signature, at most N pairs
(torch.cuda.make_graphed_callables: a few eager runs on a side stream, then
the capture of the forward and of its backward).

::

    call (recording autograd) -> signature: the call's arguments, the tokens'
        model dim, dtype and requires_grad, the layer's training mode and
        autocast; the tokens' shape; T; which parameter tensors; pending
      W > 1: ONE all-gather of that row over the layer's host twin (MPI: no
        wait for the GPU) -> the table, the same on every rank, so that every
        rank decides alike below
      signature hashes differ across ranks -> the eager call, whose agreement
        raises MismatchError on every rank naming the field
      a call that cannot be captured -> ValueError (below), on every rank
      some rank's last replay still awaits its backward -> the eager call (a
        replay would overwrite what that backward reads: 1F1B pipelining)
      the table seen before -> replay its forward graph now, its backward
        graph when autograd reaches the step (its gradients leave as copies:
        an accumulation over micro-batches must not alias the graph's memory)
      a new table, fewer than N pairs -> capture (collective), then replay;
        N pairs held -> the eager call; new parameter tensors drop the pairs

A replay does no host work of the call: the checks, the agreement and the
plan were made at capture, where every rank's call was checked as any eager
call is; at W > 1 the all-gather above checks each replay's call across
ranks. ``layer.last_plan`` describes the captured call. The output of a
replay lives in the graph's memory until the graph's next replay, as
make_graphed_callables' outputs do. The buffers the graph writes are its
own (BufferPool.isolated): no eager call of the layer shares them.

A caller may also capture the layer inside its own graph (a whole training
step in one ``torch.cuda.graph``, optimizer included): the call then runs
eagerly into that capture (call_in_graphs, in_callers_graph), after the same
refusals, with buffers kept for the graph (BufferPool.for_capture) until
``layer.drop_captured_buffers()``; the layer's own graphs step aside, and at
W > 1 ``layer.check()`` completes the checks the capture posted.

What cannot be captured is refused with ValueError before any capture (the
same on every rank): a host or staged-MPI communicator (the staged transport
waits for the stream at every exchange), NCCL alone at W > 1 (``from_torch``
over a NCCL-only subgroup without ``control_group``: a replay's check would
wait for the stream; with the gloo group beside NCCL it crosses gloo, as it
crosses MPI under ``from_mpi``), flows other than
"expert" and ``Dropless(wait=False)``, and the dictionary (they time steps,
read counts back or change their plan between calls), capacity factors that
read counts back (f < 0, and f == 0 without ``dropless_capacity="worst_case"``,
but for ``Dropless(wait=False)``), ``sample_ids``,
``layer.routing_trace`` (it reads each call's counts) and autocast with its
cache on (torch's make_graphed_callables refuses it). Calls that autograd
does not record (inference, ``torch.no_grad()``) run eagerly.
"""

from __future__ import annotations

import weakref
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

import a2a

from ..gating.capacity import set_by_tokens
from .host_values import all_gather_values

__all__ = ["CALLERS_CAPTURE", "StepGraphs", "autograd_records", "call_in_graphs",
           "captured_by_caller", "check_capturable", "complete_posted_checks", "in_callers_graph"]

WARMUP_RUNS = 3  # make_graphed_callables' eager runs before the capture (its default)


@dataclass
class _Captured:
    step: torch.nn.Module  # its forward replaced by the graphed one
    # The pooled sets the warm-up runs and the capture took (BufferPool.isolated; the capture's is held by the
    # graphs' outputs too): kept while the graphs live, and never an eager call's.
    buffers: list


class _Step(torch.nn.Module):
    """The layer's eager call as make_graphed_callables takes it: tensors in,
    a tuple of tensors out (y and its l_aux); its parameters are the layer's."""

    def __init__(self, layer: torch.nn.Module, call: Callable[..., torch.Tensor], arguments: dict[str, Any]):
        super().__init__()
        self.layer, self._call, self._arguments = layer, call, arguments

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self._call(x, **self._arguments)
        return y, y.l_aux


def _hash(value: Any) -> int:
    return zlib.crc32(repr(value).encode())  # the same in every process (Python's hash() is salted)


class StepGraphs:
    """The captured steps of one layer (see the module docstring)."""

    def __init__(self, limit: int):
        self.limit = limit
        self._captured: dict[bytes, _Captured] = {}
        self._parameters = b""  # every rank's parameters hash of the captured graphs
        self._pending: object | None = None  # the replay whose backward has not run yet (see _await_backward)

    def __len__(self) -> int:
        return len(self._captured)

    def __deepcopy__(self, memo: dict[int, Any]) -> StepGraphs:
        """None of the captured steps: they read the original layer's tensors. The copy captures its own."""
        return StepGraphs(self.limit)

    def clear(self) -> None:
        """Drops every captured pair (the next call of each signature captures anew)."""
        self._captured.clear()

    def run(self, layer: Any, eager: Callable[..., torch.Tensor], x: torch.Tensor,
            arguments: dict[str, Any]) -> torch.Tensor:
        """The call through its graphs, or `eager(x, **arguments)` where none may serve it."""
        if not autograd_records(layer, x):
            return eager(x, **arguments)  # inference runs eagerly
        comm = layer.comm
        alone = _nccl_alone(comm)
        if alone:  # before the all-gather below, which would cross NCCL
            raise ValueError(_refused(alone))
        row = np.array([*_signature(layer, x, arguments), int(self._pending is not None)], dtype=np.int64)
        table = row.reshape(1, -1) if comm.size == 1 else \
            all_gather_values(row, layer.flow.context.kept.comm).reshape(comm.size, -1)
        if (table[:, 0] != table[0, 0]).any():
            return eager(x, **arguments)  # its agreement raises MismatchError on every rank, naming the field
        check_capturable(layer, arguments)  # the same on every rank: the same call, the same layer
        if table[:, -1].any():  # a replay's backward has not run: replaying now would overwrite what it reads
            return eager(x, **arguments)
        key = table[:, :-1].tobytes()
        captured = self._captured.get(key)
        if captured is None:
            parameters = table[:, 3].tobytes()
            if parameters != self._parameters:  # new parameter tensors: the captured graphs read the old ones
                self.clear()
                self._parameters = parameters
            if len(self._captured) >= self.limit:
                return eager(x, **arguments)
            captured = self._captured[key] = _capture(layer, eager, x, arguments)
        y, l_aux = captured.step(x)
        self._await_backward(y)
        y.l_aux = layer.l_aux = l_aux
        return y

    def _await_backward(self, y: torch.Tensor) -> None:
        """Until the replay's backward runs (or its output is gone), no graph replays again. Its
        gradients leave the graph's memory as copies: torch's AccumulateGrad would otherwise keep
        the graph's output buffer as .grad, which the next replay overwrites (an accumulation over
        micro-batches would double a gradient). Only this replay's end clears the wait: an earlier output
        freed later (``y = layer(x)`` drops the last y after the call) must not end a later replay's."""
        replay = self._pending = object()

        def done() -> None:
            if self._pending is replay:
                self._pending = None

        def fresh(grad_inputs: tuple, grad_outputs: tuple) -> tuple:
            done()
            return _copies(grad_inputs)

        if y.grad_fn is not None:
            y.grad_fn.register_hook(fresh)
        weakref.finalize(y, done)


def _copies(tensors: tuple) -> tuple:
    """Fresh copies of `tensors` (None stays None) in one multi-tensor copy: on a GPU one launch for
    every gradient of the replay, where a clone each was one launch per tensor (with the input's copy,
    the 8 host cudaMemcpyAsync calls of a replay on the H200, 2026-11-30)."""
    present = [t for t in tensors if t is not None]
    copies = [torch.empty_like(t) for t in present]
    if present:
        torch._foreach_copy_(copies, present)
    made = iter(copies)
    return tuple(None if t is None else next(made) for t in tensors)


def _signature(layer: Any, x: torch.Tensor, arguments: dict[str, Any]) -> tuple[int, int, int, int]:
    """(call hash, tokens' shape hash, T, parameters hash): what decides, on this rank, which graph serves
    the call. The call: its arguments, the tokens' model dim, dtype and requires_grad, training mode and
    autocast (its state and dtype); the parameters: which tensors they are, and where."""
    named = sorted((name, value if name != "sample_ids" else value is not None) for name, value in arguments.items())
    device = x.device.type
    autocast = torch.is_autocast_enabled(device) and str(torch.get_autocast_dtype(device))
    call = (x.dim(), int(x.shape[-1]) if x.dim() else -1, str(x.dtype), x.requires_grad, layer.training, autocast,
            named)
    tokens = x.numel() // max(int(x.shape[-1]), 1) if x.dim() else 0
    parameters = tuple((id(p), p.data_ptr()) for p in layer.parameters())
    return _hash(call), _hash(tuple(x.shape)), tokens, _hash(parameters)


def autograd_records(module: torch.nn.Module, x: torch.Tensor) -> bool:
    """Whether autograd records a call of `module` on `x` (a training call)."""
    return torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in module.parameters()))


OWN_CAPTURE = "MoELayer(cuda_graphs=...) cannot capture this call"
CALLERS_CAPTURE = "MoELayer cannot run inside the CUDA graph being captured"


def _refused(why: str) -> str:
    return f"{OWN_CAPTURE}: {why}"


def _nccl_alone(comm: Any) -> str:
    """Why a communicator with NCCL as its only channel at W > 1 cannot be captured ("" where it can)."""
    if comm.size > 1 and comm.transport == "nccl" and comm.mpi_comm is None and comm.control_group is None:
        return (f"its communicator ({comm.size} ranks) has NCCL as its only channel, so checking a call across "
                "ranks would wait for the stream: use a2a.Comm.from_torch over a group with gloo (or "
                "control_group=), or a2a.Comm.from_mpi(device='cuda')")
    return ""


def captured_by_caller(comm: Any, x: torch.Tensor) -> bool:
    """Whether the layer is called inside a CUDA graph that its caller captures (a whole step, say)."""
    return (comm.device == "cuda" or x.is_cuda) and torch.cuda.is_current_stream_capturing()


def check_capturable(layer: Any, arguments: dict[str, Any], refused: str = OWN_CAPTURE) -> None:
    """Raises ValueError naming why the call of `arguments` cannot be captured, if it cannot
    (`refused`: the message's start, which says whose capture it is)."""
    comm = layer.comm

    def refusal(why: str) -> str:
        return f"{refused}: {why}"

    if comm.device != "cuda":
        raise ValueError(refusal(f"the layer's communicator is a {comm.device} one (move the layer to its GPU: "
                                  "layer.cuda(), or construct it on a2a.Comm.from_mpi(device='cuda'))"))
    if comm.transport == "mpi" and comm.size > 1:
        raise ValueError(refusal("the staged MPI transport waits for the stream before every exchange; "
                                  "use transport='nccl'"))
    alone = _nccl_alone(comm)
    if alone:
        raise ValueError(refusal(alone))
    waitless = _dropless_without_a_wait(layer.flow)
    if (layer.flow.name != "expert" and not waitless) or layer.flows or layer.adaptive is not None:
        raise ValueError(refusal(f"flow {layer.flow.name!r}" + (f" with the dictionary (flows={layer.flows})"
                                  if layer.flows or layer.adaptive is not None else "")
                                  + " times its steps, reads counts back or changes its plan between calls; "
                                  "the expert flow at a fixed (r, d) is captured, and Dropless(wait=False)"))
    if arguments.get("flow") not in (None, "expert") or arguments.get("sample_ids") is not None:
        raise ValueError(refusal("flow= and sample_ids= pick flows that read counts back"))
    if layer.routing_trace is not None:
        raise ValueError(refusal("layer.routing_trace reads each call's counts back (set it to None)"))
    if torch.is_autocast_enabled("cuda") and torch.is_autocast_cache_enabled():
        raise ValueError(refusal("autocast caches its casts across calls; use torch.autocast(..., "
                                  "cache_enabled=False)"))
    gate_index = arguments.get("gate_index", 0)
    factor = arguments.get("capacity_factor")
    if factor is None and 0 <= gate_index < len(layer.gates):
        factor = layer.gates[gate_index].capacity_factor
    if factor is not None and not waitless and not set_by_tokens(factor, layer.dropless_capacity):
        raise ValueError(refusal(f"capacity_factor={factor} sizes the capacity from the experts' counts, read "
                                  "back on the host" + (": construct the layer with dropless_capacity='worst_case'"
                                                        if factor == 0 else "")))


def _dropless_without_a_wait(flow: Any) -> bool:
    """The dropless flow that reads nothing back (Dropless(wait=False), one rank): capturable at f = 0."""
    return flow.name == "dropless" and not flow.settings.wait


# Under torch.compile the layer runs as it does eagerly, one graph break around it: its collectives and
# native kernels are no torch ops that dynamo can trace. Traced through, the layer recompiled at every call
# until dynamo's limit (38 graphs in 12 steps, 1.9x the eager step), and the dropless flow failed on dynamic
# shapes (tests/unit/test_runtime_compile.py).
@torch.compiler.disable
def call_in_graphs(layer: Any, eager: Callable[..., torch.Tensor], x: torch.Tensor,
                   arguments: dict[str, Any]) -> torch.Tensor:
    """The layer's call: inside the caller's CUDA graph being captured (the layer's own graphs step
    aside), else through the layer's own graphs (cuda_graphs=N), else `eager(x, **arguments)`."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{type(layer).__name__}: the tokens must be a torch.Tensor, got {type(x).__name__}")
    if captured_by_caller(layer.comm, x):
        return in_callers_graph(layer, eager, x, arguments)
    if layer.graphs is not None:
        return layer.graphs.run(layer, eager, x, arguments)  # eager unless training
    return eager(x, **arguments)


def in_callers_graph(layer: Any, eager: Callable[..., torch.Tensor], x: torch.Tensor,
                     arguments: dict[str, Any]) -> torch.Tensor:
    """`eager(x, **arguments)` inside a CUDA graph that the layer's caller captures (a whole training
    step, say): refused as ``cuda_graphs=`` refuses what cannot be captured, before anything is
    launched, and with buffers that stay the graph's (BufferPool.for_capture) until
    ``layer.drop_captured_buffers()``: every replay writes them. At W > 1 the ranks decide alike, from
    one all-gather over the layer's host twin (no stream work): a rank that refuses, or whose call
    differs, makes every rank raise before any launch, where the others would capture and wait."""
    comm = layer.comm
    if comm.size == 1 or _nccl_alone(comm):  # NCCL alone: refused alike on every rank, it has no host channel
        check_capturable(layer, arguments, CALLERS_CAPTURE)
    else:
        _agree_to_capture(layer, x, arguments)
    with layer._pool.for_capture():
        return eager(x, **arguments)


def _agree_to_capture(layer: Any, x: torch.Tensor, arguments: dict[str, Any]) -> None:
    """Collective (the layer's host twin): check_capturable on every rank, this rank's refusal raised,
    or the refusing ranks named; MismatchError naming the ranks whose call differs from rank 0's."""
    call, refusal = 0, None
    try:  # whatever it raises, this rank reaches the all-gather below: the others wait in it
        check_capturable(layer, arguments, CALLERS_CAPTURE)
        call = _signature(layer, x, arguments)[0]
    except Exception as error:  # noqa: BLE001 -- raised after the all-gather
        refusal = error
    row = np.array([call, int(refusal is not None)], dtype=np.int64)
    table = all_gather_values(row, layer.flow.context.kept.comm).reshape(layer.comm.size, -1)
    if refusal is not None:
        raise refusal
    refusing = np.flatnonzero(table[:, 1]).tolist()
    if refusing:
        raise ValueError(f"{CALLERS_CAPTURE}: rank(s) {refusing} of {layer.comm.size} refuse this call (each "
                         "raises why)")
    differing = np.flatnonzero(table[:, 0] != table[0, 0]).tolist()
    if differing:
        raise a2a.MismatchError(f"{CALLERS_CAPTURE}: rank(s) {differing} call the layer differently from rank 0 "
                                "(its arguments, the tokens' model dim, dtype or requires_grad, training mode or "
                                "autocast); every rank must call it alike")


def _capture(layer: Any, eager: Callable[..., torch.Tensor], x: torch.Tensor, arguments: dict[str, Any]) -> _Captured:
    """Collective: the call's forward and backward captured (after make_graphed_callables' eager runs);
    run() checked that it can be."""
    sample = x.detach().clone().requires_grad_(x.requires_grad)
    step = _Step(layer, eager, arguments)
    with layer._pool.isolated() as buffers:
        graphed = torch.cuda.make_graphed_callables(step, (sample,), num_warmup_iters=WARMUP_RUNS,
                                                    allow_unused_input=True)
    # A check the capture posted (a communicator that predicts its checks) completes now, on every rank:
    # the replays run no host code to complete it at a next call.
    complete_posted_checks(layer)
    return _Captured(graphed, buffers)


def complete_posted_checks(layer: Any) -> None:
    """Collective: the checks that the layer's communicators posted rather than waited for (those that
    predict their checks) complete now, raising on every rank where a call was not the same everywhere."""
    context = layer.flow.context
    for comm in {id(c): c for c in (context.comm, context.exchange_comm)}.values():
        if comm.predicts_check:
            comm.check()
