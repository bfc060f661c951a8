"""The ``fp8`` form of the collectives sweep (``--algo fp8``): the tokens of
the ``flex`` form, (E, C, M) -> (E/W, W*C, M), quantized to an FP8 pair
(``a2a.quantize_fp8``, e4m3, one float32 scale per 128 channels; outside
the timed region) and exchanged as one: the time the same tokens take as
FP8, beside ``flex``'s in the datatype itself. The row's size and bandwidth
count the tokens in that datatype, so the two rows' times compare directly.

``#wrong``: every code and scale received, against the pair the receiver
quantizes from what each source sent (bytes, not values: the quantizer is
the same on both sides).
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

from .collectives_data import Arrays, DType, flex_shape

__all__ = ["FP8_DATATYPES", "fp8_case"]

FP8_DATATYPES = ("half", "float", "double", "bfloat16")


def _bytes(x: Any) -> np.ndarray:
    """Host bytes of codes or scales (torch float8 / float32, or NumPy)."""
    if hasattr(x, "detach"):
        import torch

        x = x.detach().cpu()
        return (x.view(torch.uint8) if x.dtype != torch.float32 else x.contiguous().view(torch.uint8)).numpy()
    return np.ascontiguousarray(x).view(np.uint8)


def fp8_case(count: int, dtype: DType, comm: Any, args: argparse.Namespace) -> tuple[Any, Any, Any, int, tuple]:
    """(run, poison, wrong, elements per peer, send shape) of one size."""
    import a2a

    arrays = Arrays(dtype, args.device)
    world, rank = comm.size, comm.rank
    experts, capacity, hidden = flex_shape(count, world, args.experts_per_rank, args.hidden)
    epr = args.experts_per_rank
    block = epr * capacity * hidden
    tokens = arrays.empty((world, epr, capacity, hidden))
    arrays.fill_blocks(tokens, [(rank, dst, block) for dst in range(world)])
    pair = a2a.quantize_fp8(tokens.reshape(experts, capacity, hidden))
    out = a2a.quantize_fp8(arrays.empty((epr, world * capacity, hidden)))  # the received pair's buffer
    out_bytes = a2a.pack_fp8(*out)

    def run() -> None:
        a2a.all_to_all_flex(pair, comm=comm, split_axis=0, concat_axis=1, algo=args.inner_algo, out=out)

    def poison() -> None:
        out_bytes[...] = 0x55

    def wrong() -> int:
        codes, scales = _bytes(out[0]), _bytes(out[1])
        codes = codes.reshape(epr, world, capacity, -1)
        scales = scales.reshape(epr, world, capacity, -1)
        bad = 0
        for src in range(world):
            sent = arrays.empty((epr, capacity, hidden))
            arrays.fill_blocks(sent, [(src, rank, block)])
            want_codes, want_scales = (_bytes(part) for part in a2a.quantize_fp8(sent))
            bad += int(np.count_nonzero(codes[:, src] != want_codes.reshape(epr, capacity, -1)))
            bad += int(np.count_nonzero(scales[:, src] != want_scales.reshape(epr, capacity, -1)))
        return bad

    return run, poison, wrong, block, (experts, capacity, hidden)
