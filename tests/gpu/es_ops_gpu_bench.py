"""GFLOP/s of the CUDA expert-specific operators against cuBLAS (torch.matmul
and torch.bmm) doing the same FLOPs, on one GPU.

    .venv/bin/python tests/gpu/es_ops_gpu_bench.py [--tokens 8192 --top-k 2 --experts 8
        --model-dim 1024 --hidden 4096 --dtype float16 bfloat16 float32 --json out.json]

Rows (Tutel's expert FFN, fc1_w / fc2_w (E, H, M)):
  esmm fc1    x (T, M) by token -> h (T*k, H) by choice, w "nk"      2 R M H FLOPs
  esmm fc2    h (T*k, H) by choice -> y (T, M) by token, w "kn"      2 R M H
  estmm fc2   grad of fc2_w: a = h (T*k, H), b = grad_y (T, M)       2 R M H
  ess fc2     grad of fc2_b: grad_y (T, M) summed per expert         (GB/s of the rows read)
with R the routed choices. Baselines: "matmul" is one dense (R, K) @ (K, N)
GEMM, the best cuBLAS can do with these FLOPs (no routing at all); "bmm" is
the padded per-expert batch (E, C, K) @ (E, K, N) with C = max demand, as a
dispatch + GEMM MoE runs it. Every GFLOP/s counts the useful FLOPs (2 R K N);
"vs" columns are baseline time / our time, measured in this run.
Not a test: prints figures only (pytest does not collect this file).
"""

from __future__ import annotations

import argparse
import json

import torch

import a2a

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


def time_ms(fn, warmup: int, iters: int) -> float:
    """Mean milliseconds of fn() on the current stream (CUDA events)."""
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def routing(T: int, k: int, E: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.rand(T, E, generator=g, device="cuda").topk(k, dim=1).indices.contiguous()


def bench(args, dtype_name: str) -> list[dict]:
    dtype = DTYPES[dtype_name]
    T, k, E, M, H = args.tokens, args.top_k, args.experts, args.model_dim, args.hidden
    indices = routing(T, k, E, args.seed)
    index = a2a.es_index(indices, E, tile=args.tile)
    counts = index.counts.cpu()
    R, C = int(counts.sum()), int(counts.max())

    def data(*shape):
        return torch.randn(*shape, device="cuda").to(dtype)

    x, h, grad_y = data(T, M), data(T * k, H), data(T, M)
    fc1_w, fc2_w = data(E, H, M), data(E, H, M)
    fc1_b, fc2_b = data(E, H), data(E, M)
    gates = torch.rand(T, k, device="cuda")
    dense = {(K, N): (data(R, K), data(K, N)) for K, N in ((M, H), (H, M))}
    padded = {(K, N): (data(E, C, K), data(E, K, N)) for K, N in ((M, H), (H, M))}

    flops = 2.0 * R * M * H
    ops = {
        "esmm fc1": (
            lambda: a2a.esmm(x, fc1_w, index, bias=fc1_b, x_rows="token", y_rows="choice", w_layout="nk"),
            (M, H),
        ),
        "esmm fc2": (
            lambda: a2a.esmm(h, fc2_w, index, bias=fc2_b, gates=gates, x_rows="choice", y_rows="token",
                             w_layout="kn"),
            (H, M),
        ),
        "estmm fc2": (lambda: a2a.estmm(h, grad_y, index, gates=gates, a_rows="choice", b_rows="token"), (H, M)),
    }
    rows = []
    for name, (fn, shape) in ops.items():
        ours = time_ms(fn, args.warmup, args.iters)
        a, b = dense[shape]
        matmul = time_ms(lambda a=a, b=b: torch.matmul(a, b), args.warmup, args.iters)
        pa, pb = padded[shape]
        bmm = time_ms(lambda pa=pa, pb=pb: torch.bmm(pa, pb), args.warmup, args.iters)
        rows.append({
            "op": name, "dtype": dtype_name, "ms": ours, "gflops": flops / ours / 1e6,
            "matmul_gflops": flops / matmul / 1e6, "bmm_gflops": flops / bmm / 1e6,
            "vs_matmul": matmul / ours, "vs_bmm": bmm / ours,
        })
    ess_ms = time_ms(lambda: a2a.ess(grad_y, index, gates=gates, rows="token"), args.warmup, args.iters)
    ess_bytes = R * M * grad_y.element_size()
    # Baseline of the same reads: a torch segment sum of the gathered rows.
    flat = indices.reshape(-1)
    rows_of = torch.arange(T * k, device="cuda") // k

    def torch_ess():
        out = torch.zeros(E, M, device="cuda", dtype=torch.float32)
        return out.index_add_(0, flat, grad_y[rows_of].float() * gates.reshape(-1, 1))

    torch_ms = time_ms(torch_ess, args.warmup, args.iters)
    rows.append({"op": "ess fc2", "dtype": dtype_name, "ms": ess_ms, "gbps": ess_bytes / ess_ms / 1e6,
                 "torch_index_add_gbps": ess_bytes / torch_ms / 1e6, "vs_index_add": torch_ms / ess_ms})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--model-dim", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--tile", type=int, default=64)
    parser.add_argument("--dtype", nargs="+", default=["float16", "bfloat16", "float32"], choices=DTYPES)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    if not torch.cuda.is_available() or not a2a.config()["cuda"]:
        raise SystemExit("es_ops_gpu_bench: needs a CUDA device and a CUDA build of a2a")

    print(f"# {torch.cuda.get_device_name()}  T={args.tokens} k={args.top_k} E={args.experts} "
          f"M={args.model_dim} H={args.hidden} tile={args.tile}")
    print(f"# {'op':<10} {'dtype':<9} {'ms':>8} {'GFLOP/s':>10} {'cuBLAS mm':>10} {'cuBLAS bmm':>10} "
          f"{'vs mm':>6} {'vs bmm':>6}")
    results = []
    for dtype_name in args.dtype:
        for row in bench(args, dtype_name):
            results.append(row)
            if "gflops" in row:
                print(f"  {row['op']:<10} {row['dtype']:<9} {row['ms']:8.3f} {row['gflops']:10.0f} "
                      f"{row['matmul_gflops']:10.0f} {row['bmm_gflops']:10.0f} {row['vs_matmul']:6.2f} "
                      f"{row['vs_bmm']:6.2f}")
            else:
                print(f"  {row['op']:<10} {row['dtype']:<9} {row['ms']:8.3f} {row['gbps']:8.0f} GB/s "
                      f"(torch index_add_ {row['torch_index_add_gbps']:.0f} GB/s, x{row['vs_index_add']:.2f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "args": vars(args), "rows": results}, f, indent=1)


if __name__ == "__main__":
    main()
