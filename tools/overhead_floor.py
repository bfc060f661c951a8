#!/usr/bin/env python3
"""The floor under a one-rank MoE training step issued from Python: the
layer's math with nothing around it, beside the layer and Tutel's, in turns.

Issue 35 asks for a fixed step time (T = 16, M = H = 64, E = 2, k = 2, f = 1,
one rank, CPU) of at most 0.5x Tutel's. This measures how low any eager step
of that math can go: one autograd node over the weights of a MoELayer that
runs exactly the ops the math needs, forward and backward (the gate's
linear, a2a's fused gate (softmax, top-k, normalized gates, GShard's loss),
route, encode, two bmm and relu, decode; their adjoints, written out), and no
Python beyond issuing them. Its
loss and gradients are checked against the layer's before anything is timed,
so the floor computes what the layer computes.

    python tools/overhead_floor.py [--tokens 16] [--model-dim 64] [--experts 2] [--steps 50] [--repetitions 7]

Rows: the layer, the floor, and Tutel's moe_layer where installed (make
peers); per step the torch ops dispatched, native calls (a2a._C,
tutel_custom_kernel) and the median time (moe_runtime.bench.overhead's
columns). docs/benchmarks.md quotes it.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--model-dim", type=int, default=64, help="M = H (default 64)")
    parser.add_argument("--experts", type=int, default=2)
    parser.add_argument("--steps", type=int, default=50, help="steps per timed sample (default 50)")
    parser.add_argument("--repetitions", type=int, default=7)
    return parser.parse_args()


def floor_step(layer: Any, x: Any, capacity: int):
    """(step, check): the layer's math as one autograd node over the layer's
    own weights (relu experts without biases, normalized top-k gates, GShard's
    loss); check() compares its loss and gradients with the layer's."""
    import torch

    import a2a
    from a2a._moe_kernels import gate_grad  # the kernel a2a.torch.fast_decode's backward runs for the gates

    wg, fc1, fc2 = layer.gates[0].wg.weight, layer.experts.batched_fc1_w, layer.experts.batched_fc2_w
    num_experts, top_k = layer.num_global_experts, layer.gates[0].top_k

    class Step(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, wg, fc1, fc2):
            scores, indices, gates, share, l_aux = a2a.top_k_gate(torch.mm(x, wg.t()), top_k, normalize=True)
            routing = a2a.route(indices, num_experts, capacity=capacity, wait=False)
            rows = a2a.fast_encode(x, routing)
            hidden = torch.bmm(rows, fc1.transpose(1, 2))
            activated = torch.relu(hidden)
            outputs = torch.bmm(activated, fc2)
            y = a2a.fast_decode(outputs, routing, gates)
            ctx.routing = routing
            ctx.save_for_backward(x, wg, fc1, fc2, scores, indices, gates, share, rows, activated, outputs)
            return y, l_aux

        @staticmethod
        @torch.autograd.function.once_differentiable
        def backward(ctx, grad_y, grad_l_aux):
            x, wg, fc1, fc2, scores, indices, gates, share, rows, activated, outputs = ctx.saved_tensors
            routing, grad_y = ctx.routing, grad_y.contiguous()
            grad_outputs = a2a.fast_encode(grad_y, routing, gates)  # decode's data adjoint
            grad_gates = gate_grad(grad_y, outputs.view(-1, outputs.shape[-1]), routing, "float32", "floor")
            grad_hidden = torch.bmm(grad_outputs, fc2.transpose(1, 2)).mul_(activated > 0)
            grad_fc2 = torch.bmm(activated.transpose(1, 2), grad_outputs)
            grad_fc1 = torch.bmm(grad_hidden.transpose(1, 2), rows)
            grad_x = a2a.fast_decode(torch.bmm(grad_hidden, fc1), routing)  # encode's adjoint
            grad_logits = a2a.top_k_gate_backward(scores, indices, share, grad_gates, grad_l_aux, normalize=True)
            grad_x.addmm_(grad_logits, wg)
            return grad_x, grad_logits.t().mm(x), grad_fc1, grad_fc2

    def forward():
        y, l_aux = Step.apply(x, wg, fc1, fc2)
        return y.sum() + l_aux

    def gradients(loss_of) -> list[Any]:
        for tensor in (x, wg, fc1, fc2):
            tensor.grad = None
        loss = loss_of()
        loss.backward()
        return [loss.detach()] + [tensor.grad.clone() for tensor in (x, wg, fc1, fc2)]

    def check(layer_loss) -> None:
        names = ("loss", "x.grad", "wg.grad", "fc1.grad", "fc2.grad")
        for name, ours, floor in zip(names, gradients(layer_loss), gradients(forward), strict=True):
            if not torch.allclose(ours, floor, rtol=1e-5, atol=1e-6):
                raise SystemExit(f"the floor's {name} differs from the layer's by {(ours - floor).abs().max():.3g}: "
                                 f"it would not time the same math")

    return forward, check


def measure(args: argparse.Namespace) -> list[str]:
    import torch
    from mpi4py import MPI

    import a2a
    from moe_runtime import MoELayer
    from moe_runtime.bench import overhead
    from moe_runtime.bench.peers import installed_version, start_group, tutel_peer

    torch.set_num_threads(1)
    torch.manual_seed(args.tokens)
    options = argparse.Namespace(capacity_factor=1.0, model_dim=args.model_dim, experts=args.experts)
    layer = MoELayer(overhead._gate(options), args.model_dim, overhead._experts(options),
                     comm=a2a.Comm.from_mpi(MPI.COMM_SELF), seeds=(1, 2))
    x = torch.randn(args.tokens, args.model_dim, requires_grad=True)
    layer_loss = overhead._sum_and_l_aux(layer, x)
    layer_loss()
    plan = layer.last_plan
    if plan.buffer_capacity != plan.capacity:
        raise SystemExit(f"the layer pads its buffer ({plan.buffer_capacity} rows for capacity {plan.capacity}); the floor "
                         f"takes one without padding")
    floor_loss, check = floor_step(layer, x, plan.capacity)
    check(layer_loss)
    rows = [overhead.Layer("moe_runtime", installed_version("a2a"), overhead._step(layer_loss, layer.parameters(), x),
                           ours=True),
            overhead.Layer("floor", "one node", overhead._step(floor_loss, layer.parameters(), x))]
    end = start_group("cpu")
    try:
        peer = tutel_peer(layer, 1.0)
        if peer.forward is None:
            rows.append(overhead.Layer(peer.name, missing=peer.missing))
        else:
            rows.append(overhead.Layer(peer.name, peer.version,
                                       overhead._step(lambda: peer.loss(x), peer.module.parameters(), x)))
        running = [row for row in rows if row.step is not None]
        for row in running:
            for _ in range(5):
                row.step()
        costs = [overhead.count(row.step, row.ours) for row in running]
        seconds = overhead.timed([row.step for row in running], args, lambda: None)
    finally:
        end()
    header = (f"# one training step at T = {args.tokens}, M = H = {args.model_dim}, {args.experts} experts, top-2, "
              f"f = 1, float32, one rank, torch {torch.__version__}, 1 thread; median of {args.repetitions} x "
              f"{args.steps} steps, in turns; the floor checked against the layer (loss and gradients)")
    lines = [header, f"{'layer':<14} {'version':<10} {'ops':>5} {'native':>6} {'us':>9} {'us/ours':>8}"]
    for row, cost, time in zip(running, costs, seconds, strict=True):
        lines.append(f"{row.name:<14} {row.version:<10} {cost['ops']:>5} {cost['native']:>6} {time * 1e6:>9.0f} "
                     f"{time / seconds[0]:>8.2f}")
    lines += [f"{row.name:<14} {row.missing}" for row in rows if row.step is None]
    return lines


def main() -> int:
    for line in measure(parse()):
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
