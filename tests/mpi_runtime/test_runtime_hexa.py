"""Hexa-MoE's layers, MoELayer(flow="data_centric" | "model_centric"):
against the float64 reference (which drops nothing) and against the
expert-parallel flows, with uneven hidden splits and uneven token counts;
the pipeline-shared cache (one buffer, weights gathered again for the
backward, prefetch); the heterogeneous split's all-gather; the errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from runtime_util import (
    DEVICE,
    HIDDEN,
    MODEL_DIM,
    NOTHING_DROPS,
    assert_matches,
    experts_cases,
    experts_spec,
    host_leaf,
    make_layer,
    on_device,
    reference,
    run_layer,
    tokens_of,
    upstream_of,
)

import a2a
import moe_runtime
from moe_runtime.common.host_values import all_gather_values
from moe_runtime.hexa.cache import PipelineSharedCache, full_elements

HEXA_FLOWS = ["data_centric", "model_centric"]
TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5}


def uneven_split(world: int) -> list[int]:
    """A hidden split of HIDDEN by latencies 1, 2, 3, 1, 2, 3, ... (Equation 2)."""
    return moe_runtime.split_by_latency(HIDDEN, [1.0 + rank % 3 for rank in range(world)])


def hexa_settings(flow, hidden_split=None, shared_cache=None, kernels="auto"):
    """The flow= of a Hexa-MoE layer: a data-centric one gets its own cache unless given one."""
    if flow == "data_centric":
        return moe_runtime.DataCentric(hidden_split, shared_cache or PipelineSharedCache(), kernels)
    return moe_runtime.ModelCentric(hidden_split, kernels)


def hexa_layer(comm, num_experts, flow, dtype=torch.float64, *, hidden_split=None, shared_cache=None,
               kernels="auto", **options):
    return make_layer(comm, num_experts, dtype, flow=hexa_settings(flow, hidden_split, shared_cache, kernels),
                      **options)


# "es": a2a's expert-specific operators; "grouped": rows grouped by expert (torch's grouped GEMM in float32 on
# the CPU, the loop over the experts in float64 and where the widths are not multiples of 16 bytes).
@pytest.mark.parametrize("kernels", ["es", "grouped"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("flow", HEXA_FLOWS)
def test_equals_the_reference(comm, flow, k, dtype, kernels):
    for num_experts in experts_cases(comm.size):
        layer = hexa_layer(comm, num_experts, flow, dtype, k=k, kernels=kernels)
        want = reference(layer, comm, dtype, capacity_factor=NOTHING_DROPS)
        what = f"{flow} E={num_experts} k={k} {dtype} {kernels}"
        assert_matches(run_layer(layer, comm, dtype), want, TOLERANCE[dtype], what)
        plan = layer.last_plan
        assert plan.parallel == flow and plan.dropped == 0, what
        assert plan.r == (0 if flow == "data_centric" else comm.size), what


@pytest.mark.parametrize("flow", HEXA_FLOWS)
def test_uneven_hidden_splits(comm, flow):
    world = comm.size
    splits = [uneven_split(world), [HIDDEN - (world - 1), *([1] * (world - 1))]]
    for split in splits:
        assert sum(split) == HIDDEN and min(split) >= 1
        for num_experts in experts_cases(world)[:2]:
            layer = hexa_layer(comm, num_experts, flow, hidden_split=split)
            assert layer.experts.batched_fc1_w.shape == (num_experts, split[comm.rank], MODEL_DIM)
            want = reference(layer, comm, torch.float64, capacity_factor=NOTHING_DROPS)
            assert_matches(run_layer(layer, comm, torch.float64), want, 1e-12, f"{flow} split={split}")


@pytest.mark.parametrize("kernels", ["es", "grouped"])
@pytest.mark.parametrize("case", ["by-latency", "a-rank-without-tokens"])
@pytest.mark.parametrize("flow", HEXA_FLOWS)
def test_a_global_batch_split_by_latency(comm, flow, case, kernels):
    """Equation 1: every rank takes its rows of one global batch by the
    ranks' latencies (uneven T per rank), with an uneven hidden split; or
    W - 1 rows over W equal ranks, which leaves the last rank none."""
    world = comm.size
    if case == "by-latency":
        latencies, rows = [1.0 + 0.5 * (rank % 4) for rank in range(world)], 7 * world + 3
    else:
        latencies, rows = [1.0] * world, world - 1
    generator = torch.Generator().manual_seed(5)
    batch = torch.randn(rows, MODEL_DIM, generator=generator, dtype=torch.float64)
    upstream = torch.randn(batch.shape, generator=generator, dtype=torch.float64)
    pieces = [moe_runtime.local_batch(batch, latencies, rank) for rank in range(world)]
    assert len({p.shape[0] for p in pieces}) > 1 or world == 1
    layer = hexa_layer(comm, experts_cases(world)[0], flow, hidden_split=uneven_split(world), kernels=kernels)

    x = on_device(pieces[comm.rank].clone()).requires_grad_(True)
    y = layer(x)
    ((y * on_device(moe_runtime.local_batch(upstream, latencies, comm.rank))).sum() + y.l_aux).backward()
    moe_runtime.sync_shared_gradients(layer, comm)
    got_experts = {name: g * world for name, g in layer.gather_experts(grad=True).items()}

    experts = {name: host_leaf(t) for name, t in layer.gather_experts().items()}
    gate_weight = host_leaf(layer.gates[0].wg.weight)
    xs = [p.clone().requires_grad_(True) for p in pieces]
    ys, l_auxes, _ = moe_runtime.moe_reference(xs, gate_weight, experts, top_k=2, capacity_factor=NOTHING_DROPS)
    ups = [moe_runtime.local_batch(upstream, latencies, rank) for rank in range(world)]
    sum((yy * u).sum() + l for yy, u, l in zip(ys, ups, l_auxes)).backward()
    got = (y.detach(), x.grad, layer.gates[0].wg.weight.grad * world, got_experts, y.l_aux.detach())
    want = (ys[comm.rank].detach(), xs[comm.rank].grad, gate_weight.grad, {n: t.grad for n, t in experts.items()},
            l_auxes[comm.rank].detach())
    assert_matches(got, want, 1e-12, f"{flow} batch split {case}")


@pytest.mark.parametrize("flow", HEXA_FLOWS)
def test_equals_the_expert_parallel_flows(comm, flow):
    """The same experts dictionary and seeds make the same model: the
    Hexa-MoE layer computes what the capacity flow (r = 1, nothing dropped)
    and the dropless flow compute."""
    num_experts = max(experts_cases(comm.size))
    hexa = hexa_layer(comm, num_experts, flow)
    got = run_layer(hexa, comm, torch.float64)
    padded = make_layer(comm, num_experts, capacity_factor=NOTHING_DROPS)
    assert_matches(got, (*run_layer(padded, comm, torch.float64), None), 1e-12, f"{flow} against r=1")
    if num_experts >= comm.size:
        dropless = make_layer(comm, num_experts, flow="dropless")
        assert_matches(got, (*run_layer(dropless, comm, torch.float64), None), 1e-12, f"{flow} against dropless")


@pytest.mark.parametrize("flow", HEXA_FLOWS)
def test_another_activation_summed_gradients_and_no_biases(comm, flow):
    num_experts = experts_cases(comm.size)[0]
    gelu = torch.nn.functional.gelu
    for extra, options in [({"activation_fn": gelu}, {"expert_gradient": "sum"}),
                           ({"has_fc1_bias": False, "has_fc2_bias": False}, {})]:
        layer = moe_runtime.MoELayer(
            {"type": "top", "k": 2}, MODEL_DIM, experts_spec(num_experts, comm.size, **extra), comm=comm,
            seeds=(3, 4), flow=hexa_settings(flow), **options,
        )
        layer = on_device(layer, torch.float64)
        want = reference(layer, comm, torch.float64, capacity_factor=NOTHING_DROPS,
                         activation=extra.get("activation_fn", torch.relu))
        assert set(want[3]) == set(layer.gather_experts())
        assert_matches(run_layer(layer, comm, torch.float64), want, 1e-12, f"{flow} {extra} {options}")


def stacked(layers, comm, steps=1, prefetch=False, lr=0.0):
    """x -> layers[0] -> layers[1] -> ...: losses, x.grad and every layer's
    whole expert gradients (summed over ranks) of the last step; with lr > 0
    an SGD step after each."""
    optimizers = [torch.optim.SGD(layer.parameters(), lr=lr) for layer in layers] if lr else []
    losses = []
    for _ in range(steps):
        x = tokens_of(comm.rank, torch.float64).requires_grad_(True)
        for layer in layers:
            layer.zero_grad(set_to_none=True)
        y, l_aux = x, 0.0
        for i, layer in enumerate(layers):
            if prefetch and i > 0:
                layer.prefetch()
            y = layer(torch.tanh(y))  # the "attention" the prefetch overlaps
            l_aux = l_aux + y.l_aux
        loss = (y * upstream_of(comm.rank, torch.float64)).sum() + l_aux
        loss.backward()
        for layer in layers:
            moe_runtime.sync_shared_gradients(layer, comm)
        for optimizer in optimizers:
            optimizer.step()
        losses.append(float(loss.detach()))
    grads = [{name: g * comm.size for name, g in layer.gather_experts(grad=True).items()} for layer in layers]
    return losses, y.detach(), x.grad, grads


def expert_twins(comm, hiddens, num_experts, parallel_type="adaptive:1"):
    layers = []
    for i, hidden in enumerate(hiddens):
        spec = {**experts_spec(num_experts, comm.size), "hidden_size_per_expert": hidden}
        layers.append(on_device(moe_runtime.MoELayer({"type": "top", "k": 2, "capacity_factor": NOTHING_DROPS},
                                                     MODEL_DIM, spec, comm=comm, seeds=(30 + i, 40 + i),
                                                     parallel_type=parallel_type), torch.float64))
    return layers


class GraphBytes:
    """The tensors a forward's autograd graph keeps for the backward
    (saved_tensors_hooks): their distinct storages' bytes."""

    def __init__(self):
        self.tensors: list[torch.Tensor] = []
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._keep, lambda tensor: tensor)

    def _keep(self, tensor):
        self.tensors.append(tensor)
        return tensor

    def __enter__(self):
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)

    @property
    def nbytes(self) -> int:
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in self.tensors}
        return sum(storages.values())


def data_centric_stack(comm, hiddens, num_experts, cache):
    layers = []
    for i, hidden in enumerate(hiddens):
        spec = {**experts_spec(num_experts, comm.size), "hidden_size_per_expert": hidden}
        layers.append(on_device(moe_runtime.MoELayer({"type": "top", "k": 2}, MODEL_DIM, spec, comm=comm,
                                                     seeds=(30 + i, 40 + i),
                                                     flow=moe_runtime.DataCentric(shared_cache=cache)), torch.float64))
    return layers


def full_bytes(layer) -> int:
    return full_elements(layer.experts) * layer.experts.batched_fc1_w.element_size()


@pytest.mark.parametrize("prefetch", [False, True], ids=["gathered", "prefetched"])
def test_data_centric_layers_share_one_cache(comm, prefetch):
    """Three data-centric layers of different H in a stack share one cache
    buffer, as large as the largest layer; their backward gathers again
    (but for the last layer, whose weights the cache still holds); the
    graph keeps no gathered weights; the stack equals the expert-parallel
    layers with the same seeds."""
    num_experts = experts_cases(comm.size)[0]
    hiddens = [2 * comm.size, 4 * comm.size, 3 * comm.size]
    cache = PipelineSharedCache()
    layers = data_centric_stack(comm, hiddens, num_experts, cache)
    largest = max(full_bytes(layer) for layer in layers)

    with GraphBytes() as graph:
        _, y, x_grad, grads = stacked(layers, comm, prefetch=prefetch)
    assert cache.nbytes == largest  # the only full copy, one layer's worth
    buffer = cache.buffer(torch.float64, DEVICE)
    assert buffer is not None and buffer.numel() * 8 == largest
    # 3 forward gathers (two of them prefetched, then found in the cache), then the
    # backward: the last layer reuses the cache, the two others gather again.
    assert (cache.gathers, cache.reuses) == ((5, 3) if prefetch else (5, 1))
    full_shapes = {(num_experts, hidden, MODEL_DIM) for hidden in hiddens}
    kept = [t for t in graph.tensors
            if tuple(t.shape) in full_shapes or t.untyped_storage().data_ptr() == buffer.data_ptr()]
    assert not kept, [tuple(t.shape) for t in kept]  # no gathered weights kept for the backward

    # Tutel's r = 0 (the same gather of every expert, but kept for the backward) on the same stack:
    # its graph holds every layer's full weights (and the padded buffers); this one holds neither.
    twins = expert_twins(comm, hiddens, num_experts, parallel_type="data")
    with GraphBytes() as kept_by_r0:
        _, y_want, x_grad_want, grads_want = stacked(twins, comm)
    assert kept_by_r0.nbytes - graph.nbytes >= sum(full_bytes(layer) for layer in layers)
    assert torch.allclose(y, y_want, atol=1e-12, rtol=0)
    assert torch.allclose(x_grad, x_grad_want, atol=1e-12, rtol=0)
    for got, want in zip(grads, grads_want):
        for name in want:
            assert torch.allclose(got[name], want[name], atol=1e-12, rtol=0), name


def test_data_centric_training_regathers_after_each_step(comm):
    """SGD steps change the shards: every forward gathers the new weights
    (the cache's versions), and training follows the expert-parallel layers."""
    num_experts = experts_cases(comm.size)[0]
    hiddens = [HIDDEN, HIDDEN // 2 if HIDDEN // 2 >= comm.size else HIDDEN]
    cache = PipelineSharedCache()
    losses, *_ = stacked(data_centric_stack(comm, hiddens, num_experts, cache), comm, steps=4, lr=0.05)
    want, *_ = stacked(expert_twins(comm, hiddens, num_experts), comm, steps=4, lr=0.05)
    assert losses == pytest.approx(want, rel=1e-10, abs=1e-12)
    assert losses[-1] != losses[0]
    assert cache.gathers == 4 * 3 and cache.reuses == 4  # the last layer's backward reuses, every step


def test_prefetch_of_a_layer_whose_weights_change_gathers_again(comm):
    num_experts = experts_cases(comm.size)[0]
    cache = PipelineSharedCache()
    layer = hexa_layer(comm, num_experts, "data_centric", shared_cache=cache)
    x = tokens_of(comm.rank, torch.float64)
    with torch.no_grad():
        before = layer(x)
        layer.prefetch()
        cache.wait()
        layer.experts.batched_fc2_w.mul_(2.0)  # after the prefetch: its copy is stale
        after = layer(x)
    assert (cache.gathers, cache.reuses) == (3, 0)
    fresh = hexa_layer(comm, num_experts, "data_centric")
    with torch.no_grad():
        fresh.experts.batched_fc2_w.mul_(2.0)
        assert torch.allclose(after, fresh(x), atol=1e-12, rtol=0)
    assert not torch.allclose(before, after)
    with torch.no_grad():
        layer.prefetch()
        layer(x)
    assert (cache.gathers, cache.reuses) == (4, 1)


def test_the_process_cache_is_shared_by_default(comm):
    from moe_runtime.hexa.cache import SHARED_CACHE

    SHARED_CACHE.clear()
    num_experts = max(experts_cases(comm.size))
    layers = [on_device(moe_runtime.MoELayer({"type": "top", "k": 2}, MODEL_DIM,
                                             {**experts_spec(num_experts, comm.size), "hidden_size_per_expert": hidden},
                                             comm=comm, seeds=(1, 2), flow=moe_runtime.DataCentric()),
                        torch.float64)
              for hidden in (HIDDEN, 4 * HIDDEN)]
    assert all(layer.shared_cache is SHARED_CACHE for layer in layers)
    with torch.no_grad():
        for layer in layers:
            layer(tokens_of(comm.rank, torch.float64))
    assert SHARED_CACHE.nbytes == max(full_bytes(layer) for layer in layers)
    SHARED_CACHE.clear()
    assert SHARED_CACHE.nbytes == 0


def test_rank_latencies_are_the_same_list_on_every_rank(comm):
    latencies = moe_runtime.rank_latencies(comm, 1.0 + comm.rank)
    assert latencies == [1.0 + rank for rank in range(comm.size)]
    measured = moe_runtime.rank_latencies(comm, moe_runtime.measure_latency(DEVICE, size=64, repeats=2, warmup=1))
    table = all_gather_values(np.array(measured), comm).reshape(comm.size, comm.size)
    assert (table == table[0]).all()
    split = moe_runtime.split_by_latency(HIDDEN, measured)
    assert sum(split) == HIDDEN
    if comm.size > 1:
        with pytest.raises(ValueError, match="rank 1: -1.0"):
            moe_runtime.rank_latencies(comm, -1.0 if comm.rank == 1 else 1.0)


@pytest.mark.parametrize("flow", HEXA_FLOWS)
def test_errors(comm, flow):
    num_experts = experts_cases(comm.size)[0]
    world = comm.size
    bad_splits = [([HIDDEN], "one integer per rank") if world > 1 else ([HIDDEN + 1], "sums to"),
                  ([HIDDEN - world + 1, *([1] * (world - 1))][:-1] + [2], "sums to"),
                  ([HIDDEN, *([0] * (world - 1))], "at least one hidden unit") if world > 1 else ([0], "at least")]
    bad_splits.append(([float(part) for part in uneven_split(world)], "one integer per rank"))
    for split, match in bad_splits:
        with pytest.raises(ValueError, match=match):
            hexa_layer(comm, num_experts, flow, hidden_split=split)
    if world > 1:
        # Valid on each rank, different between ranks: every rank raises.
        split = [HIDDEN - world + 1, *([1] * (world - 1))] if comm.rank == 0 else uneven_split(world)
        with pytest.raises(a2a.MismatchError, match="different hidden splits"):
            hexa_layer(comm, num_experts, flow, hidden_split=split)
        # Invalid on one rank only: the others raise too.
        with pytest.raises(ValueError, match="hidden"):
            hexa_layer(comm, num_experts, flow, hidden_split=None if comm.rank else [1] * world)
    # The deprecated keywords' refusals (dispatcher= with parallel=, hidden_split= or shared_cache= without
    # it, parallel="tensor"): tests/unit/test_runtime_settings.py
    for options, match in [({"a2a_ffn_overlap_degree": 2}, "overlap"),
                           ({"is_postscore": False}, "is_postscore"), ({"parallel_type": "data"}, "parallel_type"),
                           ({"batch_prioritized_routing": True}, "batch_prioritized_routing")]:
        with pytest.raises(ValueError, match=match):
            make_layer(comm, num_experts, flow=hexa_settings(flow), **options)
    with pytest.raises(ValueError, match="flow must be one of"):
        make_layer(comm, num_experts, flow="tensor")
    with pytest.raises(TypeError, match="shared_cache must be"):
        make_layer(comm, num_experts, flow=moe_runtime.DataCentric(shared_cache={}))
    if world > 1:  # H < W: some rank would hold no hidden unit
        with pytest.raises(ValueError, match="at least one hidden unit"):
            moe_runtime.MoELayer({"type": "top", "k": 2}, MODEL_DIM,
                                 {"type": "ffn", "num_experts_per_device": 1, "hidden_size_per_expert": world - 1},
                                 comm=comm, flow=hexa_settings(flow))

    layer = hexa_layer(comm, num_experts, flow)
    assert f"flow={flow!r}" in repr(layer) and "hidden_split=" in repr(layer)
    x = tokens_of(comm.rank, torch.float64)
    for argument, value in [("adaptive_r", 1), ("a2a_ffn_overlap_degree", 1), ("algo", "linear"),
                            ("capacity_factor", 1.0)]:
        with pytest.raises(ValueError, match=rf"this rank passed \['{argument}'\]"):
            layer(x, **{argument: value})
    if world > 1:
        with pytest.raises(ValueError, match=r"rank\(s\) \[1\] passed some"):
            layer(x, **({"adaptive_r": 1} if comm.rank == 1 else {}))
        with pytest.raises(a2a.MismatchError, match="top_k"):
            layer(x, top_k=1 + comm.rank % 2)
    assert layer(x).shape == x.shape  # still works
    with pytest.raises(ValueError, match="no placement to choose"):
        layer.place(np.arange(num_experts).reshape(world, -1) if num_experts % world == 0 else [[0]])
    if flow == "model_centric":
        with pytest.raises(ValueError, match="prefetch gathers the experts of flow='data_centric'"):
            layer.prefetch()
