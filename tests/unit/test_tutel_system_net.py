"""Tutel's tutel.system and tutel.net (moe_runtime.moe.system, .net) in one
process: every name Tutel's modules have, the one-rank results, the files
and names, and the errors. tests/mpi_tutel/test_tutel_net.py runs the
collectives, groups and optimizer on 4 ranks against references."""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest
import torch

from moe_runtime.moe import groups, net, system

# tutel.net's and tutel.system's public names (Tutel at 82af7aa).
TUTEL_NET = ["get_world_size", "get_world_rank", "create_groups_from_world", "create_standalone_group", "barrier",
             "simple_all_reduce", "simple_all_to_all", "simple_split", "simple_reduce_scatter", "simple_all_gather",
             "all_to_all", "all_to_all_single", "all_gather", "zero_gather", "zero_scatter", "spatial_split",
             "reduce_scatter", "allreduce_forward", "allreduce_backward", "batch_all_to_all_v",
             "batch_all_gather_v", "TutelDistributedOptimizer"]
TUTEL_SYSTEM = ["init_affinity_at_program_beginning", "init_data_model_parallel", "LocalCache", "cache",
                "get_local_session", "record_time", "save", "load", "apply_rank_size_from_pattern"]
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK",
                      "MPI_LOCALNRANKS", "PMI_RANK")


@pytest.fixture
def fresh(monkeypatch):
    """No launcher, no environment made yet (restored after the test)."""
    for name in LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(groups, "_MADE", {})
    monkeypatch.setattr(system, "_SESSION", [])


def test_every_name_of_tutels_modules_is_here():
    assert [name for name in TUTEL_NET if not hasattr(net, name)] == []
    assert [name for name in TUTEL_SYSTEM if not hasattr(system, name)] == []


def test_one_process_is_not_distributed(fresh):
    with pytest.raises(RuntimeError, match="call system.init_data_model_parallel"):
        system.get_local_session()
    env = system.init_data_model_parallel(backend="gloo")
    assert (env.global_size, env.global_rank, env.model_size, env.data_rank, env.model_rank) == (1, 0, 1, 0, 0)
    assert env.model_group is env.data_group is env.global_group is None and not env.is_distributed
    assert env.local_device == torch.device("cpu") and not env.is_cuda
    assert system.get_local_session() is env and net.create_groups_from_world(1) is env
    assert system.record_time() > 0 and system.record_time(is_cuda=False) > 0
    assert net.create_standalone_group() is None


@pytest.mark.parametrize("arguments, error, match", [
    ({"group_count": 0}, ValueError, "group_count must be a nonzero integer"),
    ({"group_count": 2}, ValueError, "cannot split the world of 1 ranks into 2 groups"),
    ({"group_count": 1, "include_init": "mpi"}, ValueError, "unsupported backend 'mpi'"),
    ({"group_count": 1, "parent_group": object()}, ValueError, "parent_group is not supported"),
])
def test_bad_groups_are_refused(fresh, arguments, error, match):
    with pytest.raises(error, match=match):
        net.create_groups_from_world(**arguments)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here")
def test_nccl_without_a_gpu_says_so(fresh):
    with pytest.raises(RuntimeError, match="backend 'nccl' needs a CUDA device"):
        system.init_data_model_parallel(backend="nccl")


def test_groups_made_before_a_backend_are_made_again_with_it(fresh):
    assert net.create_groups_from_world(1).local_device is None
    env = system.init_data_model_parallel(backend="gloo")
    assert env.local_device == torch.device("cpu")


def test_one_backend_per_job(fresh, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # past the check that NCCL has a GPU
    net.create_groups_from_world(1, include_init="gloo")
    with pytest.raises(ValueError, match="started with backend 'gloo', not 'nccl'"):
        net.create_groups_from_world(1, include_init="nccl")


def test_files_and_names(tmp_path, caplog):
    pattern = str(tmp_path / "run-{size}" / "ckpt-{rank}.pt")
    assert system.apply_rank_size_from_pattern(pattern, rank=3, size=8) == str(tmp_path / "run-8" / "ckpt-3.pt")
    assert os.path.isdir(tmp_path / "run-8")
    with caplog.at_level(logging.WARNING):
        assert system.apply_rank_size_from_pattern("shared.pt", rank=1, size=2, create_dir=False) == "shared.pt"
    assert "has no {rank}" in caplog.text
    path = str(tmp_path / "t.npy")
    x = torch.arange(6, dtype=torch.float64).view(2, 3)
    system.save(x.requires_grad_(True), path)
    assert torch.equal(system.load(path), x.detach()) and np.load(path).shape == (2, 3)


def test_local_cache():
    cache = system.cache()
    cache.reset()
    cache.set("a", 1)
    cache.set("b", 2)
    assert cache.get("a") == 1 and cache.get() == [1, 2] and cache.get("missing") == [1, 2]
    cache.reset()
    assert cache.get() == []


def test_numa_affinity(monkeypatch):
    """NUMA_TYPE=0 leaves the affinity; else local rank r is bound to node (r // NUMA_TYPE) % nodes's CPUs."""
    root = "/sys/devices/system/node"
    if not os.path.isdir(root):
        pytest.skip("no NUMA information here")
    nodes = sorted(int(name[4:]) for name in os.listdir(root) if name.startswith("node") and name[4:].isdigit())
    before = os.sched_getaffinity(0)
    try:
        monkeypatch.setenv("NUMA_TYPE", "0")
        os.sched_setaffinity(0, {min(before)})
        system.init_affinity_at_program_beginning()
        assert os.sched_getaffinity(0) == {min(before)}
        os.sched_setaffinity(0, before)
        monkeypatch.setenv("NUMA_TYPE", "2")
        monkeypatch.setenv("LOCAL_RANK", "3")
        node = nodes[(3 // 2) % len(nodes)]
        cpus = {int(name[3:]) for name in os.listdir(f"{root}/node{node}") if name[3:].isdigit()
                and name.startswith("cpu")}
        if not cpus <= before:
            pytest.skip(f"node {node}'s CPUs {sorted(cpus)} are not all this process's to take")
        os.sched_setaffinity(0, {min(before)})
        system.init_affinity_at_program_beginning()
        assert os.sched_getaffinity(0) == cpus
    finally:
        os.sched_setaffinity(0, before)


def test_one_rank_collectives_are_the_tensors_themselves():
    x = torch.randn(4, 6, requires_grad=True)
    for result in (net.simple_all_reduce(x), net.simple_all_to_all(x), net.simple_split(x),
                   net.simple_reduce_scatter(x), net.simple_all_gather(x), net.all_to_all(x, 1, 0),
                   net.all_to_all_single(x), net.all_gather(x, 1), net.reduce_scatter(x, 1), net.spatial_split(x, 1),
                   net.allreduce_forward(x), net.allreduce_backward(x), net.all_to_all(x, 0, 1, background=True)()):
        assert torch.equal(result, x)
    y = net.all_gather(x, 1, fused=False) * 2 + net.allreduce_forward(x) + net.allreduce_backward(x)
    y.sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 4.0))
    piece, shape = net.zero_scatter(x.detach(), net.simple_split)
    assert shape == x.shape and torch.equal(net.zero_gather(piece, full_shape=list(shape)), x.detach())
    outputs, sizes = net.batch_all_to_all_v([x.detach(), torch.arange(24)], [24])
    assert sizes.tolist() == [24] and torch.equal(outputs[0], x.detach().reshape(-1))
    outputs, sizes = net.batch_all_gather_v([x.detach()])
    assert sizes.tolist() == [24] and torch.equal(outputs[0], x.detach().reshape(-1))
    net.barrier()


def test_bad_arguments_name_the_function_and_the_value():
    x = torch.zeros(4, 6)
    with pytest.raises(ValueError, match="all_to_all: input_dim 3 is not a dim of a 2-d tensor"):
        net.all_to_all(x, 3, 0)
    with pytest.raises(ValueError, match="all_gather: dim -3 is not a dim of a 2-d tensor"):
        net.all_gather(x, -3)
    with pytest.raises(ValueError, match="background=True with use_2dh=True"):
        net.all_to_all(x, 0, 1, background=True, use_2dh=True)
    with pytest.raises(ValueError, match="allreduce_forward: op .* is not supported"):
        net.allreduce_forward(x, op="prod")
    with pytest.raises(TypeError, match="datas must be a non-empty list or tuple of tensors"):
        net.batch_all_to_all_v(x, [24])
    with pytest.raises(ValueError, match=r"datas\[0\] has 24 elements, but partition_sizes is \[20\]"):
        net.batch_all_to_all_v([x], [20])
    with pytest.raises(ValueError, match="fewer than the 30 of full_shape"):
        net.zero_gather(x, full_shape=[5, 6])
    with pytest.raises(RuntimeError, match="call warp_local"):
        net.TutelDistributedOptimizer([torch.nn.Parameter(x)]).step()


def test_the_sharded_optimizer_keeps_parameters_loaded_after_warp_local():
    shared = torch.nn.Parameter(torch.ones(5))
    optimizer = net.TutelDistributedOptimizer([shared]).warp_local(torch.optim.SGD, lr=0.0)
    with torch.no_grad():
        shared.fill_(7.0)  # a checkpoint loaded after the optimizer was made
    shared.sum().backward()
    optimizer.step()
    assert torch.equal(shared.detach(), torch.full((5,), 7.0))


def test_the_sharded_optimizer_on_one_rank_is_its_local_optimizer():
    shared, expert = torch.nn.Parameter(torch.ones(5)), torch.nn.Parameter(torch.ones(3))
    expert._tutel_expert = True
    twin_shared, twin_expert = (torch.nn.Parameter(p.detach().clone()) for p in (shared, expert))
    optimizer = net.TutelDistributedOptimizer([shared, expert]).warp_local(torch.optim.SGD, lr=0.5, momentum=0.9)
    plain = torch.optim.SGD([twin_shared, twin_expert], lr=0.5, momentum=0.9)
    for step in range(3):
        for opt, (s, e) in ((optimizer, (shared, expert)), (plain, (twin_shared, twin_expert))):
            opt.zero_grad()
            ((s * (step + 1)).square().sum() + e.sum() * s.sum()).backward()
            opt.step()
    assert torch.equal(shared, twin_shared) and torch.equal(expert, twin_expert)
