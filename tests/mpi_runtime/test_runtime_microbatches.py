"""The layer under the schedules that training frameworks run around it, for
every flow, on every rank:

- micro-batches: several forwards before their backwards, the backwards in
  the reverse order (pipeline schedules). The layer's pooled buffers and each
  flow's saved state must belong to a call, not to the layer: each output
  and each call's gradients (torch.autograd.grad, held while the other
  backwards run) equal the same calls run one forward and backward at a time;
- activation checkpointing (torch.utils.checkpoint, reentrant or not): the
  forward runs again inside the backward (moe_runtime.common.recompute).
  Equal to the plain steps.

Equal means bitwise on the CPU: the same ops on the same rows."""

from __future__ import annotations

import pytest
import torch
import torch.utils.checkpoint
from runtime_util import DEVICE, MODEL_DIM, on_device, random_rows

import moe_runtime

HIDDEN = 24
TOP = {"type": "top", "k": 2, "capacity_factor": 1.0}


def spec(num_experts_per_device: int) -> dict:
    return {"type": "ffn", "num_experts_per_device": num_experts_per_device, "hidden_size_per_expert": HIDDEN}


def layouts(world: int) -> dict[str, tuple]:
    """name -> (experts, options)."""
    sharers = next(s for s in range(2, world + 1) if world % s == 0) if world > 1 else 1
    return {
        "expert": (spec(2), {}),
        "expert-r0": (spec(2), {"parallel_type": "adaptive:0"}),
        "expert-d2": (spec(2), {"a2a_ffn_overlap_degree": 2}),
        "expert-shared": (spec(-sharers), {}),
        "dropless": (spec(2), {"flow": "dropless"}),
        # Capacities that shrink at the first call below them: they move at every step.
        "dynamic": (spec(2), {"flow": moe_runtime.DynamicCapacity(margin=1.0, granularity=1, shrink_patience=1,
                                                                  shrink_band=0.99, momentum=0.5)}),
        "flex": (spec(1), {"flow": moe_runtime.FlexConfig(slots_per_rank=2)}),
        "data_centric": (spec(1), {"flow": "data_centric"}),
        "model_centric": (spec(1), {"flow": "model_centric"}),
    }


def build(comm, layout: str) -> moe_runtime.MoELayer:
    experts, options = layouts(comm.size)[layout]
    layer = moe_runtime.MoELayer(TOP, MODEL_DIM, experts, comm=comm, seeds=(5, 6), **options)
    return on_device(layer, torch.float64)


def batch(comm, index: int) -> torch.Tensor:
    """Micro-batch `index` of this rank: 7 + 2 rank + index tokens (odd, different per rank and batch)."""
    return random_rows(7 + 2 * comm.rank + index, 1000 * index + comm.rank).requires_grad_(True)


def loss_of(y: torch.Tensor) -> torch.Tensor:
    return y.square().sum() + y.l_aux


def gradients(layer) -> list[torch.Tensor]:
    return [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in layer.parameters()]


def assert_equal(got, want, what: str) -> None:
    exact = DEVICE.type == "cpu"
    torch.testing.assert_close(got, want, rtol=0 if exact else 1e-12, atol=0 if exact else 1e-12, msg=what)


def gradients_of(y: torch.Tensor, x: torch.Tensor, layer) -> list[torch.Tensor]:
    """This call's own gradients (tokens, then every parameter; zeros where none reaches it), kept as
    returned while other calls' backwards run: autograd.grad accumulates nothing."""
    parameters = list(layer.parameters())
    got = torch.autograd.grad(loss_of(y), [x, *parameters], allow_unused=True)
    return [torch.zeros_like(p) if g is None else g for p, g in zip([x, *parameters], got, strict=True)]


@pytest.mark.parametrize("layout", list(layouts(4)))
def test_micro_batches_forward_first_then_backward_in_reverse_equal_one_at_a_time(comm, layout):
    pipelined, one_at_a_time = build(comm, layout), build(comm, layout)
    xs = [batch(comm, i) for i in range(3)]
    ys = [pipelined(x) for x in xs]
    got = {i: gradients_of(ys[i], xs[i], pipelined) for i in reversed(range(len(xs)))}
    names = ["tokens"] + [name for name, _ in pipelined.named_parameters()]
    for i, x in enumerate(xs):  # the same forwards in the same order (the dynamic flow's history)
        twin = x.detach().clone().requires_grad_(True)
        y = one_at_a_time(twin)
        assert_equal(ys[i], y, f"{layout}: micro-batch {i}'s output")
        for name, g, want in zip(names, got[i], gradients_of(y, twin, one_at_a_time), strict=True):
            assert_equal(g, want, f"{layout}: micro-batch {i}'s gradient of {name}")


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("layout", list(layouts(4)))
def test_activation_checkpointing_equals_the_plain_steps(comm, layout, reentrant):
    """Three steps: each recomputation runs its forward's decisions (the dynamic
    flow's capacities) and counts as no call (its policy, FlexMoE's history)."""
    checkpointed, plain = build(comm, layout), build(comm, layout)
    for step in range(3):
        x = batch(comm, 4 - 2 * step)  # fewer tokens each step: the dynamic flow's capacities shrink
        twin = x.detach().clone().requires_grad_(True)
        checkpointed.zero_grad(set_to_none=True)
        plain.zero_grad(set_to_none=True)
        y = torch.utils.checkpoint.checkpoint(checkpointed, x, use_reentrant=reentrant)
        (y.square().sum()).backward()  # l_aux is the forward's attribute, which the recomputation does not return
        want = plain(twin)
        want.square().sum().backward()
        what = f"{layout}, step {step}"
        assert_equal(y, want, f"{what}: output")
        assert_equal(x.grad, twin.grad, f"{what}: token gradient")
        for (name, _), got, expected in zip(checkpointed.named_parameters(), gradients(checkpointed),
                                            gradients(plain), strict=True):
            assert_equal(got, expected, f"{what}: the gradient of {name}")
    if layout == "dynamic":
        got, expected = checkpointed.capacity_tracker, plain.capacity_tracker
        assert got.capacities.tolist() == expected.capacities.tolist() and got.changes == expected.changes
    if layout == "flex":
        assert len(checkpointed.flex.history) == len(plain.flex.history) == 3


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_the_dictionary_under_checkpointing_with_micro_batches_in_flight(comm, reentrant):
    """1F1B (two micro-batches in flight, backwards oldest first) while the dictionary tunes: every
    rank recomputes each micro-batch at its own trial (the kept trials of one capacity are told apart
    by their tokens' marks, agreed across ranks), and the gradients are a plain layer's to rounding."""
    import itertools

    from moe_runtime.tuning.dictionary import AdaptiveDictionary

    def made():
        clock = itertools.count()  # a clock of calls: the same trials on every rank
        layer = moe_runtime.MoELayer(TOP, MODEL_DIM, spec(2), comm=comm, seeds=(5, 6),
                                     adaptive=AdaptiveDictionary(warmup=0, repeats=1), timer=lambda: float(next(clock)))
        return on_device(layer, torch.float64)

    checkpointed, plain = made(), made()
    order = [("F", 0), ("F", 1)] + [s for i in range(2, 6) for s in (("F", i), ("B", i - 2))] + [("B", 4), ("B", 5)]
    outputs, trials = {}, set()
    for kind, i in order:
        x = random_rows(16, 1000 * i + comm.rank).requires_grad_(True)  # one capacity: one dictionary key
        if kind == "F":
            outputs[i] = (x, torch.utils.checkpoint.checkpoint(checkpointed, x, use_reentrant=reentrant))
            trials.add((checkpointed.last_plan.r, checkpointed.last_plan.d))
            continue
        mine, y = outputs.pop(i)
        checkpointed.zero_grad(set_to_none=True)
        y.square().sum().backward()
        twin = x.detach().clone().requires_grad_(True)
        plain.zero_grad(set_to_none=True)
        plain(twin).square().sum().backward()
        torch.testing.assert_close(mine.grad, twin.grad, rtol=1e-10, atol=1e-12, msg=f"micro-batch {i}")
        for (name, _), got, want in zip(checkpointed.named_parameters(), gradients(checkpointed), gradients(plain),
                                        strict=True):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, msg=f"micro-batch {i}: {name}")
    assert len(trials) > 1, "the trials never changed: nothing was tested"
