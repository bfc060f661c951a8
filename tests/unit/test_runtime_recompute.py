"""The layer under activation checkpointing (moe_runtime.common.recompute):
torch.utils.checkpoint, reentrant or not, runs each forward again inside the
backward. The recomputation must decide what its forward decided, or its
saved tensors differ from the graph they rebuild, and must not count as a
call, or what learns from calls learns each one twice. Each test runs steps
checkpointed and plain (the same layer, the same data) and holds them equal:
outputs and gradients bitwise, and the state that learns from calls."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
import torch.utils.checkpoint

import moe_runtime
from moe_runtime.common.recompute import KeptDecisions, recomputing
from moe_runtime.tuning.dictionary import AdaptiveDictionary

M, H = 16, 8
TOP = {"type": "top", "k": 2, "capacity_factor": 1.0}
VARIANTS = pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])


def experts(per_rank: int) -> dict:
    return {"type": "ffn", "num_experts_per_device": per_rank, "hidden_size_per_expert": H}


def run(layer, x, mode: str, **call) -> list[torch.Tensor]:
    """One step: output, token gradient, parameter gradients; `mode`: "plain",
    "reentrant" or "non-reentrant"."""
    x = x.detach().clone().requires_grad_(True)
    layer.zero_grad(set_to_none=True)
    if mode == "plain":
        y = layer(x, **call)
    else:
        y = torch.utils.checkpoint.checkpoint(lambda t: layer(t, **call), x, use_reentrant=mode == "reentrant")
    y.square().sum().backward()
    return [y.detach(), x.grad, *(p.grad for p in layer.parameters())]


def assert_equal_steps(got: list[torch.Tensor], want: list[torch.Tensor], what: str) -> None:
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), f"{what}: tensor {i} differs"


def mode_of(reentrant: bool) -> str:
    return "reentrant" if reentrant else "non-reentrant"


def test_kept_decisions_take_the_newest_of_a_key_once_and_forget_the_oldest():
    kept = KeptDecisions(limit=3)
    for key, value in (("a", 1), ("b", 2), ("a", 3)):
        kept.keep(key, value)
    assert kept.take("a") == 3 and kept.take("a") == 1 and kept.take("a") is None
    for value in range(4):
        kept.keep("c", value)
    assert len(kept) == 3 and [kept.take("c") for _ in range(4)] == [3, 2, 1, None]
    assert kept.take("b") is None  # forgotten: the oldest of four beyond the limit


@VARIANTS
def test_recomputing_is_true_only_in_the_recomputation(reentrant):
    seen = []

    def block(t):
        seen.append(recomputing())
        return t.sin()

    x = torch.ones(3, requires_grad=True)
    torch.utils.checkpoint.checkpoint(block, x, use_reentrant=reentrant).sum().backward()
    x.sin().sum().backward()  # a plain backward runs no forward
    with torch.no_grad():
        block(x)
    assert seen == [False, True, False]


def dynamic_batches() -> list[torch.Tensor]:
    """A large first batch, then small ones: the capacities shrink after two
    calls below the band, so without the kept capacities a shrink would land
    on a recomputation."""
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(64 if step == 0 else 16 + step, M, generator=generator, dtype=torch.float64)
            for step in range(8)]


@VARIANTS
def test_dynamic_capacity_recomputes_at_its_forwards_capacities(comm, reentrant):
    settings = moe_runtime.DynamicCapacity(margin=1.0, granularity=1, shrink_patience=2, shrink_band=0.99,
                                           momentum=0.5)
    checkpointed, plain = (moe_runtime.MoELayer(TOP, M, experts(4), comm=comm, seeds=(5, 6), flow=settings).double()
                           for _ in range(2))
    for step, x in enumerate(dynamic_batches()):
        assert_equal_steps(run(checkpointed, x, mode_of(reentrant)), run(plain, x, "plain"), f"step {step}")
        got, want = checkpointed.capacity_tracker, plain.capacity_tracker
        assert got.capacities.tolist() == want.capacities.tolist(), f"step {step}"
        assert np.array_equal(got.average, want.average) and got.changes == want.changes, f"step {step}"
    assert plain.capacity_tracker.changes >= 3  # the capacities did move under the recomputations
    assert len(checkpointed.flow.kept) == 0  # each recomputation took its forward's


def configuration(plan) -> tuple:
    return plan.r, plan.d, plan.algo, plan.capacity


@VARIANTS
def test_the_dictionarys_trial_is_the_forwards_and_reported_once(comm, reentrant):
    """Three layers share a dictionary: the later layers' reports move its
    search between a layer's forward and its recomputation."""
    dictionary = AdaptiveDictionary(warmup=0, repeats=1)
    reports = []
    report = dictionary.report
    dictionary.report = lambda capacity, config, seconds: (reports.append(seconds), report(capacity, config,
                                                                                           seconds))[1]
    clock = itertools.count()
    layers = [moe_runtime.MoELayer(TOP, M, experts(4), comm=comm, seeds=(5, i), adaptive=dictionary,
                                   timer=lambda: float(next(clock))).double() for i in range(3)]
    generator = torch.Generator().manual_seed(1)
    steps = 12
    for step in range(steps):
        y = torch.randn(32, M, generator=generator, dtype=torch.float64, requires_grad=True)
        forwards = []
        for layer in layers:
            y = torch.utils.checkpoint.checkpoint(layer, y, use_reentrant=reentrant)
            forwards.append(configuration(layer.last_plan))
        y.square().sum().backward()
        recomputed = [configuration(layer.last_plan) for layer in layers]
        assert forwards == recomputed, f"step {step}: {forwards} recomputed as {recomputed}"
    assert len(reports) == len(layers) * (steps - 1), "one report per step but the last, per layer"
    # Non-reentrant: a step's clock runs from its forward to the end of its backward, past the other layers'
    # forwards. Reentrant: the forward times nothing, the recomputation and the backward do.
    assert min(reports) >= (1 if reentrant else len(layers) - 1)


def in_flight(order: str) -> list[tuple[str, int]]:
    """("F", i) and ("B", i) of 8 micro-batches: GPipe's (4 forwards, their backwards newest first, twice)
    or 1F1B's (two in flight, backwards oldest first)."""
    if order == "gpipe":
        return [step for start in (0, 4) for step in [("F", start + i) for i in range(4)]
                + [("B", start + i) for i in reversed(range(4))]]
    return [("F", 0), ("F", 1)] + [step for i in range(2, 8) for step in (("F", i), ("B", i - 2))] + \
        [("B", 6), ("B", 7)]


@VARIANTS
@pytest.mark.parametrize("order", ["1f1b", "gpipe"])
def test_micro_batches_in_flight_recompute_their_own_trials(comm, reentrant, order):
    """The dictionary tunes while micro-batches of one capacity are in flight: each recomputation
    runs its own forward's trial (none raises CheckpointError; a reentrant one's plan is its
    forward's), and every gradient equals a plain layer's at that micro-batch (to rounding: the
    two tune apart)."""
    clock = itertools.count()
    checkpointed, plain = (moe_runtime.MoELayer(TOP, M, experts(4), comm=comm, seeds=(5, 6),
                                                adaptive=AdaptiveDictionary(warmup=0, repeats=1),
                                                timer=lambda: float(next(clock))).double() for _ in range(2))
    generator = torch.Generator().manual_seed(5)
    xs = [torch.randn(32, M, generator=generator, dtype=torch.float64) for _ in range(8)]
    outputs, trials = {}, {}
    for kind, i in in_flight(order):
        if kind == "F":
            x = xs[i].clone().requires_grad_(True)
            outputs[i] = (x, torch.utils.checkpoint.checkpoint(checkpointed, x, use_reentrant=reentrant))
            trials[i] = configuration(checkpointed.last_plan)
            continue
        x, y = outputs.pop(i)
        checkpointed.zero_grad(set_to_none=True)
        y.square().sum().backward()
        got = [x.grad, *(p.grad for p in checkpointed.parameters())]
        if reentrant:
            assert configuration(checkpointed.last_plan) == trials[i], f"micro-batch {i} recomputed another trial"
        twin = xs[i].clone().requires_grad_(True)
        plain.zero_grad(set_to_none=True)
        plain(twin).square().sum().backward()
        want = [twin.grad, *(p.grad for p in plain.parameters())]
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12, msg=f"micro-batch {i}")
    assert len(set(trials.values())) > 1, f"the trials never changed: nothing was tested ({trials})"


@VARIANTS
def test_flex_and_the_routing_trace_count_each_call_once(comm, reentrant):
    flex = moe_runtime.FlexConfig(slots_per_rank=4)
    checkpointed, plain = (moe_runtime.MoELayer(TOP, M, experts(2), comm=comm, seeds=(5, 6), flow=flex).double()
                           for _ in range(2))
    generator = torch.Generator().manual_seed(2)
    steps = 5
    for layer in (checkpointed, plain):
        layer.routing_trace = []
    for step in range(steps):
        x = torch.randn(32, M, generator=generator, dtype=torch.float64)
        assert_equal_steps(run(checkpointed, x, mode_of(reentrant)), run(plain, x, "plain"), f"step {step}")
    for layer in (checkpointed, plain):
        history = layer.flex.history
        assert len(layer.routing_trace) == len(history) == steps
        # Every call but the last was measured whole (forward and backward) and observed.
        assert [entry["measured_s"] is not None for entry in history] == [True] * (steps - 1) + [False]
    assert [h["loads"] for h in checkpointed.flex.history] == [h["loads"] for h in plain.flex.history]


@VARIANTS
def test_the_assignment_cache_replays_its_forward_and_learns_once(comm, reentrant):
    caches = [moe_runtime.AssignmentCache(on_threshold=0.5, off_threshold=0.5) for _ in range(2)]
    checkpointed, plain = (moe_runtime.MoELayer(TOP, M, experts(4), comm=comm, seeds=(5, 6),
                                                flow=moe_runtime.Dropless(assignment_cache=cache)).double()
                           for cache in caches)
    generator = torch.Generator().manual_seed(3)
    ids = np.array([4, 1, 3, 2])
    for step in range(4):  # the same samples, moved a little: the cache turns on at the second call
        x = torch.randn(4, 3, M, generator=generator, dtype=torch.float64) * 0.1 + 1
        assert_equal_steps(run(checkpointed, x, mode_of(reentrant), sample_ids=ids),
                           run(plain, x, "plain", sample_ids=ids), f"step {step}")
        assert checkpointed.assignment_stats == plain.assignment_stats, f"step {step}"
        assert caches[0].score == caches[1].score and caches[0].active == caches[1].active, f"step {step}"
    assert plain.assignment_stats.cached


@pytest.mark.parametrize("mode", ["non-reentrant", "reentrant"])
def test_the_aux_loss_trains_the_gate_under_checkpointing(comm, mode):
    """Non-reentrant: y.l_aux as in a plain step. Reentrant: the forward runs
    under no_grad, so the checkpointed function returns l_aux beside y
    (docs/runtime.md, "Activation checkpointing")."""
    layers = [moe_runtime.MoELayer(TOP, M, experts(4), comm=comm, seeds=(5, 6)).double() for _ in range(2)]
    x = torch.randn(32, M, generator=torch.Generator().manual_seed(4), dtype=torch.float64)

    def with_aux(layer, t):
        y = layer(t)
        return y, y.l_aux

    grads = []
    for layer, checkpointed in zip(layers, (False, True), strict=True):
        t = x.clone().requires_grad_(True)
        if not checkpointed:
            y, aux = with_aux(layer, t)
        elif mode == "reentrant":
            y, aux = torch.utils.checkpoint.checkpoint(with_aux, layer, t, use_reentrant=True)
        else:
            y = torch.utils.checkpoint.checkpoint(layer, t, use_reentrant=False)
            aux = y.l_aux
        (y.square().sum() + 10 * aux).backward()
        grads.append([t.grad, *(p.grad for p in layer.parameters())])
    assert_equal_steps(grads[1], grads[0], mode)
