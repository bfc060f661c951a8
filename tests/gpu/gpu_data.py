"""The data of the GPU tests of the MoE kernels and the expert-specific
operators (test_moe_gpu.py, test_es_ops_gpu.py): seeded generators, routings,
tensors and gates made on the CPU, and the dtypes with their roundoff."""

from __future__ import annotations

import torch

DEVICE = "cuda"
DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
# Unit roundoff of each dtype as a storage type.
STORE_EPS = {
    torch.float32: 2.0**-24,
    torch.float64: 2.0**-53,
    torch.float16: 2.0**-11,
    torch.bfloat16: 2.0**-8,
}


def generator(*key: int) -> torch.Generator:
    seed = 0
    for part in key:
        seed = (seed * 1_000_003 + int(part)) % (2**61 - 1)
    return torch.Generator().manual_seed(seed)


def make_indices(T, k, E, *, dtype=torch.int64, unrouted=0.1, skew=0.0, seed=0):
    """(T, k) expert choices on the CPU: k distinct experts per token (k <= E;
    random choices with repeats otherwise), low experts favoured by `skew` so
    that some overflow, and a fraction `unrouted` of negative (-1..-3) entries."""
    g = generator(T, k, E, seed)
    if k <= E:
        scores = torch.rand(T, E, generator=g) - skew * torch.arange(E) / max(E, 1)
        indices = scores.topk(k, dim=1).indices
    else:
        indices = torch.randint(0, E, (T, k), generator=g)
    negative = torch.rand(T, k, generator=g) < unrouted
    indices = torch.where(negative, -torch.randint(1, 4, (T, k), generator=g), indices)
    return indices.to(dtype).contiguous()


def make_data(shape, dtype, *key):
    return torch.randn(*shape, generator=generator(*shape, *key)).to(dtype)


def make_gates(mode, T, k, dtype, *key):
    if mode == "none":
        return None
    gate_dtype = torch.float32 if mode == "float32" else dtype
    return (0.05 + 0.95 * torch.rand(T, k, generator=generator(T, k, 7, *key))).to(gate_dtype)


def on_device(x):
    return None if x is None else x.to(DEVICE)
