"""The dictionary inside the layer, under mpirun: with a fake clock (a cost
table per configuration plus per-rank noise) every rank makes the same
choices, the search finds the table's optimum within the trial bound, the
JSON file restores it, and drift re-tunes."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from runtime_util import MODEL_DIM, experts_spec, on_device, random_rows

import moe_runtime
from moe_runtime.common.host_values import all_gather_values, all_reduce_values


class FakeClock:
    """The layer reads the clock at the start of a step and when its backward
    ends: every second reading advances by the cost of the plan that ran,
    plus this rank's noise."""

    def __init__(self, layer_ref: list, cost, rank: int):
        self.layer_ref, self.cost, self.now, self.started = layer_ref, cost, 0.0, False
        self.noise = random.Random(rank)

    def __call__(self) -> float:
        if self.started:
            plan = self.layer_ref[0].last_plan
            self.now += self.cost(plan.r, plan.d, plan.algo) * (1.0 + 0.05 * self.noise.random())
        self.started = not self.started
        return self.now


def cost_table(r: int, d: int, algo: str) -> float:
    """A unimodal cost in r with its optimum at r = 1, d = 2, linear."""
    return 1.0 + abs(r - 1) * 0.3 + abs(math.log2(d) - 1) * 0.2 + (0.1 if algo == "2dh" else 0.0) + (r == 0) * 2.0


def brute_force(layer) -> moe_runtime.Config:
    algos = ["linear", "2dh"] if layer.comm.num_nodes > 1 and layer.comm.local_size > 1 else ["linear"]
    configs = [moe_runtime.Config(0, 1, "linear")]
    configs += [moe_runtime.Config(r, d, a) for r in layer.valid_rs if r for d in (1, 2, 4, 8) for a in algos]
    return min(configs, key=lambda c: cost_table(c.r, c.d, c.algo))


def make(comm, dictionary, clock_cost):
    ref: list = []
    layer = moe_runtime.MoELayer({"type": "top", "k": 2, "capacity_factor": 1.0}, MODEL_DIM,
                                 experts_spec(max(comm.size // 4, 1), comm.size), comm=comm, seeds=(3, 4),
                                 adaptive=dictionary, timer=FakeClock(ref, clock_cost, comm.rank))
    ref.append(on_device(layer, torch.float64))
    return layer


def train(layer, comm, steps: int) -> list[tuple]:
    x = random_rows(12, comm.rank)
    plans = []
    for _ in range(steps):
        y = layer(x)
        (y.sum() + y.l_aux).backward()
        plans.append((layer.last_plan.r, layer.last_plan.d, layer.last_plan.algo))
    return plans


def same_on_every_rank(comm, plans) -> bool:
    codes = np.array([r * 1000 + d * 10 + ("linear", "2dh").index(a) for r, d, a in plans], dtype=np.int64)
    table = all_gather_values(codes, comm).reshape(comm.size, -1)
    return bool((table == table[0]).all())


def test_the_search_finds_the_optimum_on_every_rank(comm, tmp_path_factory):
    path = str(tmp_path_factory.getbasetemp() / f"dictionary-{comm.size}.json") if comm.rank == 0 else None
    # Every rank must name the same file: rank 0's path, broadcast.
    name = np.frombuffer((path or "").ljust(512).encode(), dtype=np.uint8).copy()
    name = all_gather_values(name, comm)[:512].tobytes().decode().strip()
    dictionary = moe_runtime.AdaptiveDictionary(warmup=1, repeats=3, path=name)
    layer = make(comm, dictionary, cost_table)
    plans = train(layer, comm, 160)
    assert same_on_every_rank(comm, plans)
    capacity = layer.last_plan.capacity
    assert not dictionary.tuning(capacity)
    best = brute_force(layer)
    assert (layer.last_plan.r, layer.last_plan.d, layer.last_plan.algo) == (best.r, best.d, best.algo)
    s = max(layer.valid_rs)
    algos = 2 if layer.comm.num_nodes > 1 and layer.comm.local_size > 1 else 1
    bound = ((math.log(s, 1.5) if s > 1 else 0) + 2) * 4 * algos
    assert dictionary.trials(capacity) <= bound
    # The file restores the choice without a single trial.
    comm_barrier(comm)
    restored = moe_runtime.AdaptiveDictionary(warmup=1, repeats=3, path=name)
    layer2 = make(comm, restored, cost_table)
    plans = train(layer2, comm, 2)
    assert plans == [(best.r, best.d, best.algo)] * 2
    assert not restored.tuning(capacity)


def comm_barrier(comm) -> None:
    all_reduce_values(np.zeros(1), comm)


def test_drift_retunes(comm):
    slow = {"factor": 1.0}
    dictionary = moe_runtime.AdaptiveDictionary(warmup=0, repeats=2, drift=0.25)
    layer = make(comm, dictionary, lambda r, d, a: cost_table(r, d, a) * slow["factor"])
    train(layer, comm, 120)
    capacity = layer.last_plan.capacity
    assert not dictionary.tuning(capacity)
    slow["factor"] = 3.0
    train(layer, comm, 4)
    assert dictionary.tuning(capacity)


@pytest.mark.parametrize("bad", ["unknown"])
def test_bad_parallel_type(comm, bad):
    with pytest.raises(ValueError, match="parallel_type"):
        moe_runtime.MoELayer({"type": "top"}, MODEL_DIM, experts_spec(comm.size, comm.size), comm=comm,
                             parallel_type=bad)


def test_the_scale_model_prior_leaves_out_the_same_trials_on_every_rank(comm):
    """With moe_runtime.ExchangePrior, every rank leaves out the same trials
    (the prior sees only shared numbers), none of them runs, and the search
    still ends on every rank with the same choice."""
    prior = moe_runtime.ExchangePrior("local")
    dictionary = moe_runtime.AdaptiveDictionary(warmup=0, repeats=1, prior=prior, prior_factor=1.2)
    layer = make(comm, dictionary, cost_table)
    plans = train(layer, comm, 60)
    capacity = layer.last_plan.capacity
    assert not dictionary.tuning(capacity)
    assert same_on_every_rank(comm, plans)
    skipped = np.array([dictionary.skipped(capacity)], dtype=np.int64)
    assert (all_gather_values(skipped, comm) == skipped[0]).all()
    if comm.num_nodes > 1 and comm.local_size > 1:
        assert skipped[0] > 0  # 2dh's second pass over the bytes is predicted > 1.2x on this host
    signature = layer.tuning.signature
    ran = {moe_runtime.Config(*plan) for plan in plans}
    for config in ran - {moe_runtime.Config(0, 1, "linear")}:
        best = min(prior(signature, capacity, moe_runtime.Config(config.r, d, a)) for d in (1, 2, 4, 8)
                   for a in ("linear", "2dh") if a == "linear" or comm.num_nodes > 1 and comm.local_size > 1)
        assert prior(signature, capacity, config) <= 1.2 * best
