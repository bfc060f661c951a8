#!/usr/bin/env python3
"""Tutel's examples/helloworld.py, trimmed (small defaults, a larger learning
rate and l_aux in the loss so that a few steps show the loss fall; no --eval,
--megablocks_size or tflops line), with its imports changed: a training loop
of one MoE layer, the experts marked by scan_expert_func (skip_allreduce), the
shared parameters' gradients all-reduced by the program (net.simple_all_reduce).

    from tutel import system                   # Tutel
    from tutel import moe as tutel_moe
    from tutel import net

    from moe_runtime.moe import system         # here
    from moe_runtime import moe as tutel_moe
    from moe_runtime.moe import net

Run it as a Tutel program is run:

    python -m a2a.launch --np 2 -- python examples/tutel/helloworld.py            # CPU: gloo over MPI
    python examples/tutel/helloworld.py --device cuda                              # one GPU
    torchrun --nproc_per_node 8 examples/tutel/helloworld.py --device cuda         # NCCL

system.init_data_model_parallel starts torch.distributed with gloo (CPU) or
NCCL (CUDA) under mpirun or torchrun; the layer's collectives, and net's,
then run on the MPI sub-communicator of the gloo group, or on NCCL. It
prints Tutel's lines (STEP-i: loss = ...).
"""

import argparse
import os

import torch
import torch.nn.functional as F

from moe_runtime import moe as tutel_moe
from moe_runtime.moe import net, system

parser = argparse.ArgumentParser()
parser.add_argument("--batch_size", type=int, default=4)
parser.add_argument("--num_tokens", type=int, default=64)
parser.add_argument("--model_dim", type=int, default=64)
parser.add_argument("--hidden_size", type=int, default=128)
parser.add_argument("--num_local_experts", type=int, default=2)
parser.add_argument("--dtype", type=str, default="float32")
parser.add_argument("--fp32_gate", default=False, action="store_true")
parser.add_argument("--top", type=int, default=2)
parser.add_argument("--l_aux_wt", type=float, default=0.01)
parser.add_argument("--a2a_ffn_overlap_degree", type=int, default=1)
parser.add_argument("--num_steps", type=int, default=20)
parser.add_argument("--lr", type=float, default=0.005)
parser.add_argument("--parallel_type", type=str, default="adaptive:1")
parser.add_argument("--capacity_factor", type=float, default=1.0)
parser.add_argument("--use_2dh", default=False, action="store_true")
parser.add_argument("--checkpoint_path", type=str, default="")
parser.add_argument("--device", type=str, default="cuda" if torch.cuda.is_available() else "cpu")
args = parser.parse_args()


parallel_env = system.init_data_model_parallel(backend="nccl" if args.device == "cuda" else "gloo")
dist_rank, dist_world_size, dist_print = parallel_env.global_rank, parallel_env.global_size, parallel_env.dist_print
device = parallel_env.local_device

torch.set_default_dtype(getattr(torch, args.dtype))


class ExampleModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self._moe_layer = tutel_moe.moe_layer(
            gate_type={"type": "top", "k": args.top, "fp32_gate": args.fp32_gate, "capacity_factor": args.capacity_factor},
            experts={"type": "ffn", "num_experts_per_device": args.num_local_experts,
                     "hidden_size_per_expert": args.hidden_size, "activation_fn": lambda x: F.relu(x)},
            model_dim=args.model_dim,
            scan_expert_func=lambda name, param: setattr(param, "skip_allreduce", True),
            seeds=(1, dist_rank + 1, 1),
            a2a_ffn_overlap_degree=args.a2a_ffn_overlap_degree,
            parallel_type=args.parallel_type,
            use_2dh=args.use_2dh,
        )
        local_count = sum(p.numel() for _, p in self._moe_layer.get_parameter_iterator(param_type="local_experts"))
        shared_count = sum(p.numel() for _, p in self._moe_layer.get_parameter_iterator(param_type="gate"))
        dist_print(f"[Statistics] param count for MoE local_experts = {local_count}, "
                   f"param count for MoE gate = {shared_count}.")

    def forward(self, input):
        result = self._moe_layer(input)
        return F.log_softmax(torch.sum(result, dim=2), dim=1)


model = ExampleModel().to(device)
dist_print(model)

if args.checkpoint_path:
    path = system.apply_rank_size_from_pattern(args.checkpoint_path, rank=dist_rank, size=dist_world_size)
    if os.path.exists(path):
        model.load_state_dict(torch.load(path))
    else:
        dist_print(f"Checkpoint not loaded: file `{path}` is not found. Will train the model from start.")

optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)

torch.manual_seed(0)
x = torch.randn([args.batch_size, args.num_tokens, args.model_dim], dtype=torch.float32, device="cpu")
x = x.to(dtype=torch.get_default_dtype(), device=device)
y = torch.zeros(args.batch_size, dtype=torch.long, device=device)

dist_print(f"[Benchmark] world_size = {dist_world_size}, dtype = {args.dtype}, model_dim = {args.model_dim}, "
           f"hidden_size = {args.hidden_size}, samples = {args.batch_size * args.num_tokens}, "
           f"num_local_experts = {args.num_local_experts}, topK = {args.top}, "
           f"a2a_ffn_overlap_degree = {args.a2a_ffn_overlap_degree}, parallel_type = `{args.parallel_type}`, "
           f"device = `{device}`")

params_for_all_reduce = [p for p in model.parameters() if not hasattr(p, "skip_allreduce") and p.requires_grad]

for i in range(args.num_steps):
    t_start = system.record_time()
    optimizer.zero_grad()
    output = model(x)
    loss = F.nll_loss(output, y)
    if args.l_aux_wt:
        loss += args.l_aux_wt * model._moe_layer.l_aux
    loss.backward()
    if dist_world_size > 1:
        for p in params_for_all_reduce:
            p.grad /= dist_world_size
            p.grad = net.simple_all_reduce(p.grad)
    optimizer.step()
    t_stop = system.record_time()
    dist_print(f"STEP-{i}: loss = {float(loss.data):.5f}, step_time = {t_stop - t_start:.6f} sec.")

if args.checkpoint_path:
    torch.save(model.state_dict(), path)
