"""Tutel's tutel.system and tutel.net (moe_runtime.moe.system, .net) under
mpirun: init_data_model_parallel starts gloo from mpirun's variables and
makes the data and model groups; every collective, over the world and over a
model group, equals a single-process reference built from every rank's
(deterministic) inputs, its gradients too (autograd through the reference,
or Tutel's own backward rule where Tutel's is not the adjoint); the sharded
optimizer steps as SGD on the summed or averaged gradients. Under mpirun the
module starts torch.distributed and destroys it at its end; under torchrun
(the torchrun-2x2 configuration: gloo, no MPI) it takes the launcher's."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import a2a
from moe_runtime.moe import groups, net, system


def data(rank: int, shape: tuple[int, ...], seed: int = 0, dtype=torch.float64) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * seed + rank)
    return torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype)


@pytest.fixture(scope="module")
def env():
    """Tutel's environment of 2 model groups: torch.distributed started here under mpirun (and destroyed
    at the end), the launcher's under torchrun."""
    if net.get_world_size() % 2:
        pytest.skip("needs an even number of ranks")
    started = not dist.is_initialized()
    made = system.init_data_model_parallel(group_count=2, backend="gloo")
    yield made
    if started:
        dist.destroy_process_group()
    groups._MADE.clear()
    system._SESSION.clear()


def members(group) -> list[int]:
    """The world ranks of `group` (None: the world), in group order."""
    return list(range(dist.get_world_size())) if group is None else dist.get_process_group_ranks(group)


def test_init_data_model_parallel_makes_tutels_groups(env, monkeypatch):
    size, rank = env.global_size, env.global_rank
    half = size // 2
    assert (env.global_size, env.global_rank, env.group_count, env.model_size) == (size, rank, 2, half)
    assert (env.model_rank, env.data_rank) == (rank % half, rank // half)
    assert members(env.model_group) == list(range(rank // half * half, rank // half * half + half))
    assert members(env.data_group) == list(range(rank % half, size, half))
    assert env.is_distributed and env.local_device == torch.device("cpu") and not env.is_cuda
    assert system.get_local_session() is env and net.create_groups_from_world(2) is env
    assert net.get_world_size(env.model_group) == half and net.get_world_rank(env.model_group) == rank % half
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # past the check that NCCL has a GPU
    with pytest.raises(ValueError, match="started with backend 'gloo', not 'nccl'"):
        net.create_groups_from_world(2, include_init="nccl")
    with pytest.raises(ValueError, match=f"cannot split the world of {size} ranks into {size + 1} groups"):
        net.create_groups_from_world(size + 1)
    net.barrier()
    net.barrier(env.model_group)


GROUPS = ["world", "model"]


def group_of(env, which: str):
    return None if which == "world" else env.model_group


@pytest.mark.parametrize("which", GROUPS)
def test_the_collectives_without_backward(env, which):
    group = group_of(env, which)
    ranks = members(group)
    me, size = ranks.index(env.global_rank), len(ranks)
    xs = [data(r, (2 * size, 3)) for r in ranks]
    mine = xs[me]
    torch.testing.assert_close(net.simple_all_reduce(mine, group), sum(xs), rtol=0, atol=1e-12)
    torch.testing.assert_close(net.simple_all_reduce(mine, group, op=dist.ReduceOp.MAX),
                               torch.stack(xs).amax(0), rtol=0, atol=0)
    copy = mine.clone()
    assert net.simple_all_reduce(copy, group, op=dist.ReduceOp.MIN, inplace=True) is copy
    assert torch.equal(copy, torch.stack(xs).amin(0))
    expected = torch.cat([x.chunk(size)[me] for x in xs])
    assert torch.equal(net.simple_all_to_all(mine, group), expected)
    output, wait = net.simple_all_to_all(mine, group, background=True)
    wait()
    assert torch.equal(output, expected)
    assert torch.equal(net.simple_split(mine, group), mine.chunk(size)[me])
    torch.testing.assert_close(net.simple_reduce_scatter(mine, group), sum(xs).chunk(size)[me], rtol=0, atol=1e-12)
    assert torch.equal(net.simple_all_gather(mine, group), torch.cat(xs))
    assert torch.equal(net.simple_all_gather(torch.tensor(float(me)), group), torch.arange(size, dtype=torch.float32))
    with pytest.raises(ValueError, match=r"simple_split: dim 0 of a \(3,\) tensor does not split into"):
        net.simple_split(torch.zeros(3), group)
    with pytest.raises(ValueError, match="op .* is not supported"):
        net.simple_all_reduce(mine, group, op=dist.ReduceOp.PRODUCT)


def reference_all_to_all(xs: list[torch.Tensor], input_dim: int, output_dim: int) -> list[torch.Tensor]:
    """Every rank's output: slice `me` of dim output_dim of every rank's input, concatenated along input_dim."""
    size = len(xs)
    return [torch.cat([x.chunk(size, dim=output_dim)[me] for x in xs], dim=input_dim) for me in range(size)]


def check_with_backward(op, reference, xs: list[torch.Tensor], me: int, what: str) -> None:
    """op(mine) and its gradient against reference(all inputs) and autograd through it, for
    the loss sum over ranks of <w_rank, y_rank> with w deterministic per rank."""
    leaves = [x.clone().requires_grad_(True) for x in xs]
    wanted = reference(leaves)
    weights = [data(r, tuple(y.shape), seed=7) for r, y in enumerate(wanted)]
    sum((w * y).sum() for w, y in zip(weights, wanted, strict=True)).backward()
    mine = xs[me].clone().requires_grad_(True)
    got = op(mine)
    torch.testing.assert_close(got, wanted[me].detach(), rtol=0, atol=1e-12, msg=f"{what}: output")
    (weights[me] * got).sum().backward()
    torch.testing.assert_close(mine.grad, leaves[me].grad, rtol=0, atol=1e-12, msg=f"{what}: gradient")


@pytest.mark.parametrize("which", GROUPS)
@pytest.mark.parametrize("dims", [(1, 0), (0, 1), (2, 1), (1, 2), (0, 2), (-1, 0)])
def test_all_to_all_and_its_backward(env, which, dims):
    group = group_of(env, which)
    ranks = members(group)
    me, size = ranks.index(env.global_rank), len(ranks)
    xs = [data(r, (2 * size, 3 * size, 2 * size), seed=1) for r in ranks]
    input_dim, output_dim = dims
    check_with_backward(lambda x: net.all_to_all(x, input_dim, output_dim, group=group),
                        lambda ls: reference_all_to_all(ls, input_dim % 3, output_dim), xs, me, f"all_to_all{dims}")
    check_with_backward(lambda x: net.all_to_all(x, input_dim, output_dim, group=group, background=True)(),
                        lambda ls: reference_all_to_all(ls, input_dim % 3, output_dim), xs, me, "background")
    assert net.all_to_all(xs[me], 1, 1, group=group) is xs[me]  # equal dims: the input, as in Tutel


def test_all_to_all_2dh_equals_the_linear_one(env):
    """use_2dh over the world (2 emulated nodes of 2 ranks in the tutel-2x2 configuration)."""
    ranks = members(None)
    me = ranks.index(env.global_rank)
    xs = [data(r, (8, 4 * len(ranks)), seed=2) for r in ranks]
    check_with_backward(lambda x: net.all_to_all(x, 0, 1, use_2dh=True),
                        lambda ls: reference_all_to_all(ls, 0, 1), xs, me, "2dh")
    with pytest.raises(ValueError, match="background=True with use_2dh=True"):
        net.all_to_all(xs[me], 0, 1, background=True, use_2dh=True)


@pytest.mark.parametrize("which", GROUPS)
def test_the_collectives_with_backward(env, which):
    group = group_of(env, which)
    ranks = members(group)
    me, size = ranks.index(env.global_rank), len(ranks)
    xs = [data(r, (2 * size, 3, 2 * size), seed=3) for r in ranks]
    check_with_backward(lambda x: net.all_to_all_single(x, group), lambda ls: reference_all_to_all(ls, 0, 0), xs, me,
                        "all_to_all_single")
    for dim in (0, 2):
        check_with_backward(lambda x, d=dim: net.all_gather(x, d, fused=True, group=group),
                            lambda ls, d=dim: [torch.cat(ls, dim=d)] * size, xs, me, f"all_gather({dim}, fused)")
        check_with_backward(lambda x, d=dim: net.reduce_scatter(x, d, group=group),
                            lambda ls, d=dim: list(sum(ls).chunk(size, dim=d)), xs, me, f"reduce_scatter({dim})")

    # Tutel's backward rules that are not the adjoint: the plain all_gather's keeps this rank's slice of
    # its own gradient, spatial_split's gathers, allreduce_forward's passes the gradient, allreduce_backward's
    # reduces it.
    w = data(ranks[me], (2 * size, 3, 2 * size * size), seed=4)
    mine = xs[me].clone().requires_grad_(True)
    (w * net.all_gather(mine, 2, group=group)).sum().backward()
    assert torch.equal(mine.grad, w.chunk(size, dim=2)[me])
    mine = xs[me].clone().requires_grad_(True)
    split = net.spatial_split(mine, 2, group=group)
    assert torch.equal(split, xs[me].chunk(size, dim=2)[me])
    gradient = data(ranks[me], tuple(split.shape), seed=5)
    split.backward(gradient)
    assert torch.equal(mine.grad, torch.cat([data(r, tuple(split.shape), seed=5) for r in ranks], dim=2))
    mine = xs[me].clone().requires_grad_(True)
    reduced = net.allreduce_forward(mine, group=group)
    torch.testing.assert_close(reduced, sum(xs), rtol=0, atol=1e-12)
    reduced.backward(xs[me])
    assert torch.equal(mine.grad, xs[me])
    mine = xs[me].clone().requires_grad_(True)
    same = net.allreduce_backward(mine, op=dist.ReduceOp.MAX, group=group)
    assert torch.equal(same, xs[me])
    same.backward(xs[me])
    assert torch.equal(mine.grad, torch.stack(xs).amax(0))


@pytest.mark.parametrize("which", GROUPS)
def test_zero_scatter_then_zero_gather_gives_the_tensor_back(env, which):
    group = group_of(env, which)
    size = len(members(group))
    x = data(0, (3, 5), seed=6)  # 15 elements: padded to a multiple of the group's size where needed
    piece, shape = net.zero_scatter(x, net.simple_split, group=group)
    assert shape == x.shape and piece.numel() == -(-15 // size)
    assert torch.equal(net.zero_gather(piece, full_shape=list(shape), group=group), x)
    whole = net.zero_gather(piece, group=group)  # default: dim 0 times the group's size
    assert whole.shape == (piece.shape[0] * size,)


@pytest.mark.parametrize("which", GROUPS)
def test_the_uneven_batched_exchanges(env, which):
    group = group_of(env, which)
    ranks = members(group)
    me, size = ranks.index(env.global_rank), len(ranks)

    def sent(source: int, target: int, dtype) -> torch.Tensor:  # source + target + 1 values naming both
        return (torch.arange(source + target + 1) + 100 * source + 10 * target).to(dtype)

    datas = [torch.cat([sent(me, t, dtype) for t in range(size)]) for dtype in (torch.float64, torch.int64)]
    outputs, received = net.batch_all_to_all_v(datas, [me + t + 1 for t in range(size)], group=group)
    assert received.tolist() == [s + me + 1 for s in range(size)]
    for output, dtype in zip(outputs, (torch.float64, torch.int64), strict=True):
        assert torch.equal(output, torch.cat([sent(s, me, dtype) for s in range(size)]))
    gathered, sizes = net.batch_all_gather_v([torch.full((me + 1, 1), float(me)), torch.arange(me + 1)], group=group)
    assert sizes.tolist() == [s + 1 for s in range(size)]
    assert torch.equal(gathered[0], torch.cat([torch.full((s + 1,), float(s)) for s in range(size)]))
    assert torch.equal(gathered[1], torch.cat([torch.arange(s + 1) for s in range(size)]))
    with pytest.raises(ValueError, match=r"shape \(1,\).*dim 0 \(1\) is not divisible by the world size"):
        net.batch_all_to_all_v(datas, [1], group=group)  # a2a's error, on every rank
    with pytest.raises((ValueError, a2a.A2AError)):
        net.batch_all_gather_v([torch.zeros(2), torch.zeros(3)], group=group)


@pytest.mark.parametrize("which", GROUPS)
def test_a_bad_input_on_one_rank_raises_on_every_rank(env, which):
    """The last rank of the group passes what does not fit: every rank raises (a2a's errors name it), none
    waits for the others to time out."""
    group = group_of(env, which)
    ranks = members(group)
    me, size = ranks.index(env.global_rank), len(ranks)
    bad = me == size - 1
    with pytest.raises((ValueError, a2a.A2AError)):
        net.simple_all_to_all(torch.zeros(2 * size + bad, 3), group)
    with pytest.raises((ValueError, a2a.A2AError)):
        net.batch_all_to_all_v([torch.zeros(size + bad)], [1] * size, group=group)
    with pytest.raises((ValueError, a2a.A2AError)):
        net.batch_all_gather_v([torch.zeros(2), torch.zeros(2 + bad)], group=group)
    net.barrier(group)  # every rank is still in step
    assert torch.equal(net.simple_all_gather(torch.tensor([me]), group), torch.arange(size))


def model_of(rank: int) -> torch.nn.Module:
    """A shared Linear(3, 5) (the same everywhere; 5 biases: padded slices) and an expert weight per rank."""
    model = torch.nn.Linear(3, 5).double()
    with torch.no_grad():
        model.weight.copy_(data(0, (5, 3), seed=8))
        model.bias.copy_(data(0, (5,), seed=9))
    model.expert = torch.nn.Parameter(data(rank, (5,), seed=10))
    model.expert._tutel_expert = True
    return model


@pytest.mark.parametrize("average_shared", [False, True])
@pytest.mark.parametrize("which", GROUPS)
def test_tutel_distributed_optimizer_steps_sgd_on_the_groups_gradients(env, which, average_shared):
    group = group_of(env, which)
    ranks = members(group)
    rank, lr = env.global_rank, 0.1
    model = model_of(rank)
    optimizer = net.TutelDistributedOptimizer(model.parameters(), group=group, average_shared=average_shared)
    optimizer.warp_local(torch.optim.SGD, lr=lr)
    with torch.no_grad():  # a checkpoint loaded after the optimizer was made: the steps start from it
        model.bias.fill_(0.5)
    for _ in range(2):  # zero_grad and a second step: the slices stay tied to the parameters
        optimizer.zero_grad()
        before = [p.detach().clone() for p in (model.weight, model.bias, model.expert)]
        loss = ((model(data(rank, (4, 3), seed=11)) * model.expert) ** 2).sum()
        loss.backward()
        local = [p.grad.clone() for p in (model.weight, model.bias, model.expert)]
        everyone = [net.simple_all_gather(torch.cat([g.reshape(-1) for g in local[:2]]), group).view(len(ranks), -1)]
        shared = everyone[0].mean(0) if average_shared else everyone[0].sum(0)
        optimizer.step()
        torch.testing.assert_close(torch.cat([model.weight.detach().reshape(-1), model.bias.detach()]),
                                   torch.cat([before[0].reshape(-1), before[1]]) - lr * shared, rtol=0, atol=1e-12)
        torch.testing.assert_close(model.expert.detach(), before[2] - lr * local[2], rtol=0, atol=1e-12)


@pytest.mark.parametrize("which", GROUPS)
def test_the_sharded_optimizer_with_gradients_on_some_ranks_only(env, which):
    """A parameter only the odd ranks use (a gradient there, none on the others) steps by the odd ranks'
    sum; one no rank uses keeps its values and no gradient; no rank waits for another."""
    group = group_of(env, which)
    ranks = members(group)
    me = ranks.index(env.global_rank)
    used, unused = torch.nn.Parameter(torch.ones(3, dtype=torch.float64)), torch.nn.Parameter(torch.ones(2))
    optimizer = net.TutelDistributedOptimizer([used, unused], group=group).warp_local(torch.optim.SGD, lr=0.1)
    if me % 2:
        (2 * used.sum()).backward()
    optimizer.step()
    odd = len(ranks) // 2
    torch.testing.assert_close(used.detach(), torch.full((3,), 1 - 0.1 * 2 * odd, dtype=torch.float64), rtol=0,
                               atol=1e-12)
    assert torch.equal(unused.detach(), torch.ones(2)) and optimizer.virt_params[1].grad is None
