"""``python -m moe_runtime.bench --overhead``: what one training step costs
the host, for this layer and the layers users would pick instead, in one run.

    python -m moe_runtime.bench --overhead                  # 1 rank: T = 16 and 4096, M = H = 64, E = 2, k = 2, f = 1
    python -m moe_runtime.bench --overhead --np 4           # ours on 4 ranks (the peers run on one)
    python -m moe_runtime.bench --overhead --tokens 16 --steps 20 --repetitions 3   # seconds
    python -m moe_runtime.bench --overhead --capacity-factor 0 --dropless-capacity worst_case   # dropless
    python -m moe_runtime.bench --overhead --capacity-factor 0 --flow dropless --experts 8       # ragged rows
    python -m moe_runtime.bench --overhead --capacity-factor 0 --flow dropless --no-wait        # nothing read back

At tiny sizes the work is negligible and a step's time is host overhead, the
part a GPU cannot hide: every torch op is at least one launch there, and
every read of a device value a stall. Per training step (forward and
backward, after warm-up), for each layer:

- ``ops``: torch ops dispatched (a TorchDispatchMode count; views included:
  they are host work, not launches);
- ``native``: calls into a compiled library outside torch's dispatcher
  (a2a._C for ours, tutel_custom_kernel for Tutel): launches too;
- ``reads``: tensor values read on the host (``item()``, ``int()``, ``tolist()``)
  and ops whose output size depends on values (``nonzero``, ``masked_select``,
  ...): each a stream sync on a GPU; for ours also a2a's own ``host_waits``;
- ``rounds``: control-path rounds, the check's own among them (a2a's counters; ours only);
- ``allocs``: a2a's allocations (ours only);
- ``us``: the median step time (each layer timed in turns, as the others).

Peers, each where it is installed (``make peers``; otherwise its row says
so): Tutel's ``moe_layer`` and Megatron-Core's ``MoELayer`` (the
``allgather`` token dispatcher: its ``alltoall`` one creates CUDA streams;
its router moves its weight to CUDA, so a router with the same linear stays
on the CPU): moe_runtime.bench.peers builds them over the weights of our
layer. Every layer has the same sizes, top-2, the capacity factor of
``--capacity-factor`` (default 1; 0: dropless, Megatron-Core's without a
capacity) and no biases; the peers run on a one-process gloo group.
``--dropless-capacity`` is our layer's ``dropless_capacity`` (at f = 0:
"largest", read back, or "worst_case", T); ``--flow`` its flow (default
"expert"; "dropless": ragged rows, the grouped GEMMs where torch runs them;
``--no-wait`` with it: ``Dropless(wait=False)``, one rank, nothing read back).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

DEFAULTS = {"tokens": "16,4096", "model_dim": 64, "experts": 2, "steps": 50, "repetitions": 7, "capacity_factor": 1.0}
# torch ops whose output's size depends on tensor values: the host waits for them on a GPU.
SIZED_BY_VALUES = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2", "unique_consecutive",
                   "repeat_interleave", "bincount", "histc", "argwhere"}
NATIVE_MODULES = ("a2a._C", "tutel_custom_kernel")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m moe_runtime.bench --overhead", description=__doc__.split("\n\n")[0])
    p.add_argument("--np", type=int, default=1, help="ranks for our layer (default 1; the peers run on rank 0 alone)")
    p.add_argument("--tokens", default=DEFAULTS["tokens"], help=f"tokens per rank, a list (default {DEFAULTS['tokens']})")
    p.add_argument("--model-dim", type=int, default=DEFAULTS["model_dim"], help="M = H (default 64)")
    p.add_argument("--experts", type=int, default=DEFAULTS["experts"], help="experts per rank (default 2)")
    p.add_argument("--steps", type=int, default=DEFAULTS["steps"], help="steps per timed sample (default 50)")
    p.add_argument("--repetitions", type=int, default=DEFAULTS["repetitions"], help="timed samples (default 7)")
    p.add_argument("--capacity-factor", type=float, default=DEFAULTS["capacity_factor"],
                   help="every layer's capacity factor (default 1; 0: dropless)")
    p.add_argument("--dropless-capacity", default="largest", choices=("largest", "worst_case"),
                   help="our layer's capacity at factor 0 (default largest: read back)")
    p.add_argument("--flow", default="expert", choices=("expert", "dropless"),
                   help="our layer's flow (default expert; dropless: ragged rows, needs --capacity-factor 0)")
    p.add_argument("--no-wait", action="store_true",
                   help="with --flow dropless on one rank: Dropless(wait=False), the step reads nothing back")
    args = p.parse_args(argv)
    try:
        args.tokens = [int(t) for t in str(args.tokens).split(",")]
    except ValueError:
        p.error(f"--tokens must be a comma-separated list of integers, got {args.tokens!r}")
    if min(args.tokens) < 1 or args.np < 1 or args.steps < 1 or args.repetitions < 1:
        p.error("--tokens, --np, --steps and --repetitions must be >= 1")
    if args.capacity_factor < 0:
        p.error(f"--capacity-factor must be >= 0, got {args.capacity_factor:g}")
    if args.flow == "dropless" and args.capacity_factor != 0:
        p.error("--flow dropless drops nothing: its peers run dropless too, so pass --capacity-factor 0")
    if args.no_wait and (args.flow != "dropless" or args.np != 1):
        p.error("--no-wait is the dropless flow's on one rank: pass --flow dropless and no --np")
    return args


@dataclasses.dataclass
class Layer:
    """One layer under test: its training step, or why it cannot run here."""

    name: str
    version: str = ""
    step: Callable[[], None] | None = None
    missing: str = ""  # why it is not measured
    ours: bool = False


def _step(forward: Callable[[], Any], parameters: Any, x: Any) -> Callable[[], None]:
    """forward() -> loss, then its backward; gradients are reset to None (no op) before each step."""
    params = list(parameters)

    def step() -> None:
        for p in params:
            p.grad = None
        x.grad = None
        forward().backward()

    return step


def _sum_and_l_aux(layer: Any, x: Any) -> Callable[[], Any]:
    """The loss of a layer with Tutel's surface (its output carries l_aux)."""

    def forward():
        y = layer(x)
        return y.sum() + y.l_aux

    return forward


def _gate(args: argparse.Namespace) -> dict[str, Any]:
    return {"type": "top", "k": 2, "capacity_factor": args.capacity_factor}


def _experts(args: argparse.Namespace) -> dict[str, Any]:
    return {"type": "ffn", "count_per_node": args.experts, "hidden_size_per_expert": args.model_dim,
            "has_fc1_bias": False, "has_fc2_bias": False}


def ours(comm: Any, tokens: int, args: argparse.Namespace) -> Layer:
    import torch

    from moe_runtime import Dropless, MoELayer

    from .peers import installed_version

    flow = Dropless(wait=False) if args.no_wait else args.flow
    layer = MoELayer(_gate(args), args.model_dim, _experts(args), comm=comm, seeds=(1, 2),
                     dropless_capacity=args.dropless_capacity, flow=flow)
    x = torch.randn(tokens, args.model_dim, requires_grad=True)
    step = _step(_sum_and_l_aux(layer, x), layer.parameters(), x)
    return Layer("moe_runtime", installed_version("a2a"), step, ours=True)


def peers(tokens: int, args: argparse.Namespace) -> list[Layer]:
    """Tutel's and Megatron-Core's layers over the weights of our layer on one
    rank (moe_runtime.bench.peers), where installed; on rank 0 alone."""
    import torch
    from mpi4py import MPI

    import a2a
    from moe_runtime import MoELayer

    from .peers import peer_builders

    source = MoELayer(_gate(args), args.model_dim, _experts(args), comm=a2a.Comm.from_mpi(MPI.COMM_SELF),
                      seeds=(1, 2))
    x = torch.randn(tokens, args.model_dim, requires_grad=True)
    layers = []
    for _, build in peer_builders(source, args.capacity_factor):  # on the CPU: Megatron-Core's allgather dispatcher
        peer = build()
        if peer.forward is None:
            layers.append(Layer(peer.name, missing=peer.missing))
            continue
        layers.append(Layer(peer.name, peer.version, _step(lambda peer=peer: peer.loss(x), peer.module.parameters(), x)))
    return layers


def count(step: Callable[[], None], ours_layer: bool) -> dict[str, int]:
    """The costs of one step (see the module docstring)."""
    import torch

    import a2a

    from .dispatched import DispatchedOps

    native = collections.Counter()

    def profile(frame, event, function) -> None:
        if event != "c_call":
            return
        module = getattr(function, "__module__", None) or ""
        if module.startswith(NATIVE_MODULES):
            native["calls"] += 1
        elif getattr(function, "__name__", "") == "tolist" and isinstance(getattr(function, "__self__", None),
                                                                            torch.Tensor):
            native["tolist"] += 1  # a read that reaches no dispatched op on the CPU

    ops = DispatchedOps()
    with a2a.counting() as cost, ops:
        sys.setprofile(profile)
        try:
            step()
        finally:
            sys.setprofile(None)
    c = cost.counters
    reads = sum(n for name, n in ops.ops.items() if name in SIZED_BY_VALUES) + native["tolist"]
    return {
        "ops": sum(ops.ops.values()),
        # ours: a2a's own count of its native calls (the profile sees the bound methods of a Communicator too)
        "native": c.calls if ours_layer else native["calls"],
        "reads": reads + (c.host_waits if ours_layer else 0),
        "rounds": c.control_rounds if ours_layer else -1,  # the check's own rounds are control rounds too
        "allocs": c.allocations if ours_layer else -1,
    }


def timed(steps: list[Callable[[], None]], args: argparse.Namespace, barrier: Callable[[], None]) -> list[float]:
    """Median seconds per step of each, sampled in turns."""
    samples: list[list[float]] = [[] for _ in steps]
    for _ in range(args.repetitions):
        for i, step in enumerate(steps):
            barrier()
            start = time.perf_counter()
            for _ in range(args.steps):
                step()
            samples[i].append((time.perf_counter() - start) / args.steps)
    return [statistics.median(s) for s in samples]


def measure(args: argparse.Namespace) -> list[str]:
    """The table's lines on rank 0 (none on the others)."""
    import torch

    import a2a

    torch.set_num_threads(1)
    comm = a2a.Comm.from_mpi()
    lead = comm.rank == 0
    from .peers import start_group

    end = start_group("cpu") if lead else (lambda: None)
    try:
        lines = _measure(args, comm, lead)
    finally:
        end()
    return lines if lead else []


def _measure(args: argparse.Namespace, comm: Any, lead: bool) -> list[str]:
    import torch
    from mpi4py import MPI

    from .rank import slowest

    world = MPI.COMM_WORLD
    turns = "all in turns" if comm.size == 1 else "ours (the slowest rank), then the peers in turns"
    sized = args.capacity_factor == 0 and args.flow == "expert"  # dropless_capacity is the expert flow's
    factor = f"f = {args.capacity_factor:g}" + (f" ({args.dropless_capacity})" if sized else "")
    factor += "" if args.flow == "expert" else f", our flow {args.flow}" + (" without a wait" if args.no_wait else "")
    header = (f"# one training step (forward + backward) per layer: M = H = {args.model_dim}, {args.experts} experts "
              f"per rank, top-2, {factor}, float32, torch {torch.__version__}, 1 thread; ours on {comm.size} rank(s), "
              f"the peers on 1; median of {args.repetitions} x {args.steps} steps, {turns}")
    columns = (f"{'T':>6} {'layer':<14} {'version':<12} {'ops':>5} {'native':>6} {'reads':>5} {'rounds':>6} "
               f"{'allocs':>6} {'us':>9} {'us/ours':>8}")
    lines = [header, columns]
    for tokens in args.tokens:
        torch.manual_seed(tokens)
        layers = [ours(comm, tokens, args)]
        if lead:
            layers += peers(tokens, args)
        running = [layer for layer in layers if layer.step is not None]
        for layer in running:
            for _ in range(5):  # buffers, scratch and first choices are made once
                layer.step()
        costs = {layer.name: count(layer.step, layer.ours) for layer in running}
        # One rank: every layer in turns. More: ours on every rank (the slowest), then the peers on rank 0 alone.
        together = running if comm.size == 1 else [layer for layer in running if not layer.ours]
        seconds = {}
        if comm.size > 1:
            [mine] = timed([layers[0].step], args, world.Barrier)
            seconds[layers[0].name] = slowest(mine, comm)
        steps = timed([layer.step for layer in together], args, lambda: None)
        seconds.update(zip([layer.name for layer in together], steps, strict=True))
        for layer in layers:
            if layer.step is None:
                lines.append(f"{tokens:>6} {layer.name:<14} {layer.missing}")
                continue
            c, us = costs[layer.name], seconds[layer.name] * 1e6
            shown = {key: ("-" if value < 0 else str(value)) for key, value in c.items()}
            lines.append(f"{tokens:>6} {layer.name:<14} {layer.version:<12} {shown['ops']:>5} {shown['native']:>6} "
                         f"{shown['reads']:>5} {shown['rounds']:>6} {shown['allocs']:>6} {us:>9.0f} "
                         f"{us / (seconds[layers[0].name] * 1e6):>8.2f}")
    return lines


def main(argv: list[str]) -> int:
    """Relaunched under mpirun for --np > 1; rank 0 prints."""
    from a2a import launch
    from a2a.bench import common

    args = parse_args(argv)
    if args.np > 1 and not launch.under_mpirun():
        return common.relaunch("moe_runtime.bench.overhead", argv, args.np, None, default_np=args.np,
                               default_local_size=1)
    lines = measure(args)
    if lines:
        print("# " + common.command_line(argv, "moe_runtime.bench.overhead"))
        for line in lines:
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
