"""moe_runtime.hexa.split: Equations 1 and 2 of Hexa-MoE, rounded so the
parts sum exactly; the paper's Table 2; the proxy task and the latencies'
all-gather on one rank."""

from __future__ import annotations

import math

import numpy as np
import pytest

from moe_runtime.hexa.split import (
    local_batch,
    measure_latency,
    offsets,
    rank_latencies,
    split_by_latency,
    uniform_split,
)

# Table 2 of the paper: (latencies, proportions) of its three cases.
TABLE_2 = [((4.58, 3.06), (0.40, 0.60)), ((3.20, 3.18), (0.50, 0.50)), ((3.28, 9.42), (0.74, 0.26))]


@pytest.mark.parametrize("latencies, proportions", TABLE_2, ids=["case1", "case2", "case3"])
def test_the_papers_table_2(latencies, proportions):
    # Two decimals, as the table prints them: a total of 100 gives them in percent.
    assert split_by_latency(100, latencies) == [round(100 * p) for p in proportions]
    # And at the sizes a layer splits: every part within one unit of the exact share.
    for total in (96, 1024, 4096):
        parts = split_by_latency(total, latencies)
        assert sum(parts) == total
        speeds = [1 / latency for latency in latencies]
        for part, speed in zip(parts, speeds):
            assert abs(part - total * speed / sum(speeds)) < 1


def test_hand_worked_cases():
    # Shares 1/1 : 1/2 : 1/4 of 14 = 8 : 4 : 2, exact.
    assert split_by_latency(14, [1.0, 2.0, 4.0]) == [8, 4, 2]
    # Shares of 10 = 5.714.., 2.857.., 1.428..: floors 5, 2, 1 and the two
    # units left go to the largest remainders, 0.857 (rank 1) then 0.714 (rank 0).
    assert split_by_latency(10, [1.0, 2.0, 4.0]) == [6, 3, 1]
    # Equal latencies, 10 over 3: 3.33 each; the one left unit goes to rank 0 (ties by rank).
    assert split_by_latency(10, [2.5, 2.5, 2.5]) == [4, 3, 3]
    assert split_by_latency(11, [2.5, 2.5, 2.5]) == [4, 4, 3]
    # Latency 3 : 1 -> speed 1 : 3 of 8 = 2 : 6.
    assert split_by_latency(8, [3.0, 1.0]) == [2, 6]
    assert split_by_latency(0, [1.0, 2.0]) == [0, 0]
    assert split_by_latency(7, [0.5]) == [7]


def test_multiples():
    # In units of 4: 64 = 16 units, shares 16 * (1/3, 2/3) = 5.33, 10.67 -> 5, 11 units.
    assert split_by_latency(64, [2.0, 1.0], multiple=4) == [20, 44]
    for total, latencies, multiple in [(96, (4.58, 3.06), 8), (1024, (3.28, 9.42, 1.0, 7.5), 16),
                                       (48, (1.0, 1.0, 1.0, 1.0, 1.0), 3)]:
        parts = split_by_latency(total, latencies, multiple)
        assert sum(parts) == total
        assert all(part % multiple == 0 for part in parts)
        # Against the plain split of the units: the same parts, scaled.
        assert parts == [multiple * p for p in split_by_latency(total // multiple, latencies)]


def test_parts_may_be_zero():
    assert split_by_latency(2, [1.0, 1.0, 1.0]) == [1, 1, 0]
    assert split_by_latency(5, [1.0, 1000.0]) == [5, 0]  # the slow rank gets nothing


def test_equal_latencies_give_the_uniform_split_and_scale_does_not_matter():
    for total in range(40):
        for ranks in (1, 2, 3, 4, 7):
            parts = uniform_split(total, ranks)
            assert sum(parts) == total and max(parts) - min(parts) <= 1
            assert parts == sorted(parts, reverse=True)
    latencies = [0.3, 0.7, 1.1, 0.2]
    assert split_by_latency(1000, latencies) == split_by_latency(1000, [1e3 * x for x in latencies])


def test_exact_sums_over_random_cases():
    rng = np.random.default_rng(7)
    for _ in range(300):
        ranks = int(rng.integers(1, 9))
        multiple = int(rng.choice([1, 2, 8, 64]))
        total = multiple * int(rng.integers(0, 200))
        latencies = rng.uniform(0.01, 10.0, ranks).tolist()
        parts = split_by_latency(total, latencies, multiple)
        assert len(parts) == ranks and sum(parts) == total
        assert all(p >= 0 and p % multiple == 0 for p in parts)
        units = [p // multiple for p in parts]
        speeds = [1 / x for x in latencies]
        for unit, speed in zip(units, speeds):  # largest remainder: within one unit of the exact share
            assert abs(unit - (total // multiple) * speed / sum(speeds)) < 1
        # A faster rank never gets less than a slower one.
        for i in range(ranks):
            for j in range(ranks):
                if latencies[i] < latencies[j]:
                    assert parts[i] >= parts[j]


@pytest.mark.parametrize("args, match", [
    ((10, [1.0, 0.0]), r"finite and positive \(rank 1: 0.0\)"),
    ((10, [-1.0, 1.0]), r"rank 0: -1.0"),
    ((10, [1.0, math.nan]), "finite and positive"),
    ((10, [1.0, math.inf]), "finite and positive"),
    ((10, []), "one latency per rank"),
    ((10, ["fast"]), "sequence of positive numbers"),
    ((-1, [1.0]), "total must be an integer >= 0"),
    ((2.5, [1.0]), "total must be an integer"),
    ((True, [1.0]), "total must be an integer"),
    ((10, [1.0], 0), "multiple must be an integer >= 1"),
    ((10, [1.0, 1.0], 4), "total 10 is not a multiple of multiple=4"),
])
def test_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        split_by_latency(*args)


def test_offsets_and_local_batch():
    assert offsets([3, 0, 2]) == [0, 3, 3, 5]
    batch = np.arange(20).reshape(10, 2)
    latencies = [1.0, 2.0, 4.0]  # 10 -> 6, 3, 1
    pieces = [local_batch(batch, latencies, rank) for rank in range(3)]
    assert [len(p) for p in pieces] == [6, 3, 1]
    assert np.array_equal(np.concatenate(pieces), batch)
    assert np.shares_memory(pieces[1], batch)  # a view
    with pytest.raises(ValueError, match=r"rank must be in \[0, 3\)"):
        local_batch(batch, latencies, 3)
    with pytest.raises(ValueError, match="not a multiple of multiple=4"):
        local_batch(batch, latencies, 0, multiple=4)


def test_local_batch_of_a_tensor(torch):
    batch = torch.arange(24.0).reshape(12, 2)
    pieces = [local_batch(batch, [4.58, 3.06], rank, multiple=2) for rank in range(2)]
    assert [len(p) for p in pieces] == split_by_latency(12, [4.58, 3.06], 2) == [4, 8]
    assert torch.equal(torch.cat(pieces), batch)


def test_measure_latency(torch):
    small = measure_latency(size=64, repeats=3, warmup=1)
    assert small > 0 and math.isfinite(small)
    # 8x the side is 512x the flops: the larger matmul takes longer (by a margin noise cannot close).
    assert measure_latency(size=512, repeats=2, warmup=1) > small
    assert measure_latency(size=32, repeats=1, warmup=0, dtype=torch.float64) > 0
    with pytest.raises(ValueError, match="repeats must be an integer >= 1"):
        measure_latency(repeats=0)
    with pytest.raises(ValueError, match="size must be an integer >= 1"):
        measure_latency(size=0)


def test_rank_latencies_on_one_rank(comm):
    assert rank_latencies(comm, 3.5) == [3.5]
    assert rank_latencies(comm, np.float32(0.25)) == [0.25]
    with pytest.raises(ValueError, match=r"rank 0: -2.0"):
        rank_latencies(comm, -2.0)
    with pytest.raises(ValueError, match="finite and positive"):
        rank_latencies(comm, "slow")
    with pytest.raises(TypeError, match="a2a.Comm"):
        rank_latencies(object(), 1.0)
