"""Deterministic inputs and the reference comparison for the runtime tests,
and the one place that decides their device.

``A2A_TEST_DEVICE`` (read by the tests only, never by the library; tests/
run_mpi.py's gpu-* configurations set it): ``cuda`` runs the layers, their
tokens and upstream gradients on CUDA device 0 over a staged CUDA
communicator (``transport="mpi"``: the ranks share the one GPU, which NCCL
refuses); ``cpu`` or unset, on the host over a host communicator. Either way
the same code runs; every reference is computed in float64 on the CPU, from
the layer's gathered weights moved there and every rank's tokens.
"""

from __future__ import annotations

import os

import torch

import a2a
import moe_runtime

MODEL_DIM, HIDDEN = 8, 16
CPU = torch.device("cpu")


def _test_device() -> torch.device:
    name = os.environ.get("A2A_TEST_DEVICE") or "cpu"
    if name not in ("cpu", "cuda"):
        raise ValueError(f"A2A_TEST_DEVICE must be 'cpu' or 'cuda', got {name!r}")
    return torch.device(name, 0) if name == "cuda" else CPU


DEVICE = _test_device()


def suite_comm(world, **options) -> a2a.Comm:
    """The communicator of the tests on DEVICE (topology from A2A_LOCAL_SIZE
    as always); `options` go to a2a.Comm.from_mpi (timeout_s=)."""
    if DEVICE.type == "cuda":
        return a2a.Comm.from_mpi(world, device="cuda", transport="mpi", cuda_device=DEVICE.index, **options)
    return a2a.Comm.from_mpi(world, **options)


def on_device(x, dtype: torch.dtype | None = None):
    """A layer or tensor moved to DEVICE (and `dtype`, when given)."""
    return x.to(device=DEVICE, dtype=dtype)


def experts_cases(world: int) -> list[int]:
    """E for a world size: the issue's (W, E) pairs, (4, 8/4/2/1) and (8, 2)."""
    return {4: [8, 4, 2, 1], 8: [2]}.get(world, [world, 2 * world])


def experts_spec(num_experts: int, world: int, **extra) -> dict:
    per_device = num_experts // world if num_experts >= world else -(world // num_experts)
    return {"type": "ffn", "num_experts_per_device": per_device, "hidden_size_per_expert": HIDDEN, **extra}


NOTHING_DROPS = 1000.0  # a capacity factor no routing here can fill


def make_layer(comm, num_experts, dtype=torch.float64, **options):
    """A layer of `num_experts` over the world, top-2 (k=), capacity factor 1
    (capacity_factor=), fixed seeds; other options go to MoELayer."""
    factor = options.pop("capacity_factor", 1.0)
    layer = moe_runtime.MoELayer(
        {"type": "top", "k": options.pop("k", 2), "capacity_factor": factor}, MODEL_DIM,
        experts_spec(num_experts, comm.size), comm=comm, seeds=(21, 22), **options,
    )
    return on_device(layer, dtype)


def whole_expert_cases(comm):
    """The issue's E with whole experts on every rank (E >= W), else W and 2W."""
    return [e for e in experts_cases(comm.size) if e >= comm.size] or [comm.size, 2 * comm.size]


def random_rows(rows: int, seed: int, *, columns: int = MODEL_DIM, dtype: torch.dtype = torch.float64,
                device: torch.device = DEVICE) -> torch.Tensor:
    """(rows, columns) normal values from a host generator seeded `seed`, in
    float64 (the same values whatever the device), then `dtype` on `device`."""
    generator = torch.Generator().manual_seed(seed)
    drawn = torch.randn(rows, columns, generator=generator, dtype=torch.float64)
    return drawn.to(device=device, dtype=dtype)


def tokens_of(rank: int, dtype: torch.dtype, device: torch.device = DEVICE) -> torch.Tensor:
    """Rank i's tokens: 5 + 2i of them (odd, different per rank)."""
    return random_rows(5 + 2 * rank, 100 + rank, dtype=dtype, device=device)


def upstream_of(rank: int, dtype: torch.dtype, device: torch.device = DEVICE) -> torch.Tensor:
    """Rank i's gradient of the layer's output."""
    return random_rows(5 + 2 * rank, 200 + rank, dtype=dtype, device=device)


def host_leaf(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` (a layer's weight) as a reference's input: a float64 leaf on the CPU that requires grad."""
    return tensor.detach().to(CPU, torch.float64).requires_grad_(True)


def two_level(comm: a2a.Comm) -> bool:
    return comm.num_nodes > 1 and comm.local_size > 1


def run_layer(layer, comm, dtype, **call):
    """One forward + backward of rank's tokens; (y, x.grad, gate grad summed
    over ranks, whole expert gradients summed over ranks, l_aux)."""
    x = tokens_of(comm.rank, dtype).requires_grad_(True)
    layer.zero_grad(set_to_none=True)
    y = layer(x, **call)
    ((y * upstream_of(comm.rank, dtype)).sum() + y.l_aux).backward()
    moe_runtime.sync_shared_gradients(layer, comm)  # the mean: times W is the sum
    gate_grad = layer.gates[0].wg.weight.grad * comm.size
    scale = comm.size if layer.expert_gradient == "mean" else 1
    expert_grads = {name: g * scale for name, g in layer.gather_experts(grad=True).items()}
    return y.detach(), x.grad, gate_grad, expert_grads, y.l_aux.detach()


def reference(layer, comm, dtype, *, capacity_factor, top_k=None, batch_prioritized_routing=False,
              is_postscore=True, activation=torch.relu, expert_inputs=None):
    """The reference's (y, x grad, gate grad, expert grads, l_aux) for this
    rank; `expert_inputs` as for moe_runtime.moe_reference."""
    experts = {name: host_leaf(t) for name, t in layer.gather_experts().items()}
    gate_weight = host_leaf(layer.gates[0].wg.weight)
    xs = [tokens_of(i, dtype, CPU).double().requires_grad_(True) for i in range(comm.size)]
    ys, l_auxes, capacity = moe_runtime.moe_reference(
        xs, gate_weight, experts, top_k=top_k or layer.gates[0].top_k, capacity_factor=capacity_factor,
        batch_prioritized_routing=batch_prioritized_routing, is_postscore=is_postscore, activation=activation,
        expert_inputs=expert_inputs,
    )
    loss = sum((y * upstream_of(i, dtype, CPU).double()).sum() + l for i, (y, l) in enumerate(zip(ys, l_auxes)))
    loss.backward()
    rank = comm.rank
    grads = {name: t.grad for name, t in experts.items()}
    return ys[rank].detach(), xs[rank].grad, gate_weight.grad, grads, l_auxes[rank].detach(), capacity


def assert_matches(got, want, tolerance: float, what: str) -> None:
    y, x_grad, gate_grad, expert_grads, l_aux = got
    pairs = [("y", y, want[0]), ("x.grad", x_grad, want[1]), ("gate grad", gate_grad, want[2]),
             ("l_aux", l_aux, want[4])]
    pairs += [(f"grad {name}", expert_grads[name], want[3][name]) for name in want[3]]
    for name, a, b in pairs:
        a, b = a.to(CPU, torch.float64), b.to(CPU, torch.float64)  # the layer's device, the reference's host
        error = float((a - b).abs().max()) if a.numel() else 0.0
        scale = max(1.0, float(b.abs().max())) if b.numel() else 1.0
        assert error <= tolerance * scale, f"{what}: {name} differs from the reference by {error:.3g}"


def whole_expert_runs(comm, flow, dtype, tolerance, k):
    """For each whole-expert E and algorithm (2dh too on two levels): a layer
    of `flow` run once and checked against the float64 reference that
    drops nothing; yields (layer, what) for the caller's checks of its plan."""
    algos = ["linear", "2dh"] if two_level(comm) else ["linear"]
    for num_experts in whole_expert_cases(comm):
        layer = make_layer(comm, num_experts, dtype, k=k, flow=flow)
        want = reference(layer, comm, dtype, capacity_factor=NOTHING_DROPS)
        for algo in algos:
            what = f"{flow} E={num_experts} k={k} {algo} {dtype}"
            assert_matches(run_layer(layer, comm, dtype, algo=algo), want, tolerance, what)
            yield layer, what


def train_step(layer, x, optimizer):
    """One SGD step on the loss sum(y^2) + l_aux; returns y, detached."""
    optimizer.zero_grad()
    y = layer(x)
    (y.square().sum() + layer.l_aux).backward()
    optimizer.step()
    return y.detach()
