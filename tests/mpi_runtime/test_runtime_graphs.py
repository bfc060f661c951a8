"""MoELayer(cuda_graphs=N) across ranks, its bookkeeping with captures that
run the step eagerly (the GPU's captures and replays:
tests/gpu/test_layer_graphs_gpu.py): every rank decides alike from the
table of every rank's call (ranks of different token counts share one
capture per table), and a rank whose call differs makes every rank raise
the eager agreement's MismatchError instead of replaying. Inside the
caller's capture (stood in for on the CPU) the ranks agree too: a rank that
refuses, or whose call differs, makes every rank raise before any launch."""

from __future__ import annotations

import pytest
import torch
from runtime_util import MODEL_DIM, experts_spec, on_device, random_rows

import a2a
import moe_runtime
from moe_runtime.common import graphs


@pytest.fixture
def captures(monkeypatch):
    made = []

    def capture(step, sample_args, **options):
        made.append(tuple(sample_args[0].shape))
        return step  # "replays" run the step eagerly

    monkeypatch.setattr(graphs, "check_capturable", lambda layer, arguments: None)
    monkeypatch.setattr(torch.cuda, "make_graphed_callables", capture)
    return made


def test_every_rank_decides_from_the_table_of_every_ranks_call(comm, captures):
    experts = experts_spec(comm.size, comm.size)
    layer = on_device(moe_runtime.MoELayer({"type": "top", "k": 2}, MODEL_DIM, experts, comm=comm, seeds=(1, 2),
                                           cuda_graphs=2), torch.float32)
    eager = on_device(moe_runtime.MoELayer({"type": "top", "k": 2}, MODEL_DIM, experts, comm=comm, seeds=(1, 2)),
                      torch.float32)
    mine = 5 + 2 * comm.rank
    # Rank 0's token count changes at the third call: a new table on every rank, so every rank captures.
    for call, tokens in enumerate((mine, mine, 3 if comm.rank == 0 else mine, mine)):
        x = random_rows(tokens, 40 + call, dtype=torch.float32).requires_grad_()
        y = layer(x)
        assert torch.equal(y, eager(x)), f"call {call}"
    assert captures == [(mine, MODEL_DIM), (3 if comm.rank == 0 else mine, MODEL_DIM)]
    assert len(layer.graphs) == 2
    if comm.size == 1:
        return
    x = random_rows(mine, 7, dtype=torch.float32).requires_grad_()
    with pytest.raises(a2a.MismatchError, match="top_k"):  # the eager call's agreement names the field
        layer(x, top_k=1 if comm.rank == comm.size - 1 else 2)
    assert len(layer.graphs) == 2


def test_in_the_callers_capture_every_rank_decides_alike(comm, monkeypatch):
    experts = experts_spec(comm.size, comm.size)
    layer = on_device(moe_runtime.MoELayer({"type": "top", "k": 2}, MODEL_DIM, experts, comm=comm, seeds=(1, 2)),
                      torch.float32)
    eager = on_device(moe_runtime.MoELayer({"type": "top", "k": 2}, MODEL_DIM, experts, comm=comm, seeds=(1, 2)),
                      torch.float32)
    x = random_rows(6, 3, dtype=torch.float32).requires_grad_()
    last = comm.rank == comm.size - 1
    monkeypatch.setattr(graphs, "captured_by_caller", lambda comm, x: True)

    def refuse_on_the_last_rank(layer, arguments, refused):
        if last:  # not a ValueError: whatever it raises, the rank meets the others in the agreement first
            raise RuntimeError(f"{refused}: this rank's own reason")

    monkeypatch.setattr(graphs, "check_capturable", refuse_on_the_last_rank)
    own_or_named = "this rank's own reason" if last else rf"rank\(s\) \[{comm.size - 1}\] of {comm.size} refuse"
    with pytest.raises(RuntimeError if last else ValueError, match=own_or_named if comm.size > 1 else "own reason"):
        layer(x)
    monkeypatch.setattr(graphs, "check_capturable", lambda layer, arguments, refused: None)
    if comm.size > 1:
        with pytest.raises(a2a.MismatchError, match=rf"rank\(s\) \[{comm.size - 1}\] call the layer differently"):
            layer(x, top_k=1 if last else 2)
    assert torch.equal(layer(x), eager(x))  # every rank alike: the call runs (here eagerly)
    layer.drop_captured_buffers()
