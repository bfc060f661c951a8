"""Bad input and disagreeing ranks under mpirun: every rank raises (nobody
hangs), the rank with the bad input gets InvalidArgumentError with the details,
the others RemoteError naming it; disagreement is MismatchError on every rank.
After each error the communicator keeps working.

Every test runs all its collectives (the failing call, then a correct one)
before asserting, so a failed check on one rank cannot desynchronize the others.
"""

from __future__ import annotations

import numpy as np
import pytest
import reference as ref
from a2a_mpi_util import check_bad_rank, check_mismatch, outcome, regular

import a2a


def still_works(comm):
    """Runs a correct collective now; returns the check to run at the end."""
    shape = (comm.size * 3, 2)
    x = ref.a2a_input("after-error", comm.rank, comm.size, shape, "float32")
    expected = ref.a2a_expected("after-error", comm.rank, comm.size, shape, "float32")
    result, error = outcome(lambda: a2a.all_to_all(x, comm=comm))

    def check():
        assert error is None, f"the comm does not work after the error: {error!r}"
        ref.assert_bitwise_equal(result, expected, "a collective after the error")

    return check


def bad_rank(comm):
    return comm.size - 1


# ---------------------------------------------------------------------------
# One rank with bad input. Each case: (op, needs >= 2 ranks, call(comm, bad),
# fragments the bad rank's message must contain). `bad` says whether this rank
# is the one that passes the bad argument.


def good_x(comm, rows_per_peer=2, dtype="float32"):
    return ref.a2a_input("good", comm.rank, comm.size, (comm.size * rows_per_peer, 3), dtype)


def case_dim0(comm, bad):
    w = comm.size
    x = np.zeros((w * 2 + 1, 3), np.float32) if bad else good_x(comm)
    return a2a.all_to_all(x, comm=comm)


def case_noncontiguous(comm, bad):
    x = np.zeros((comm.size * 2, 6), np.float32)[:, ::2] if bad else good_x(comm)
    return a2a.all_to_all(x, comm=comm)


def case_object(comm, bad):
    x = np.zeros((comm.size * 2, 3), object) if bad else good_x(comm)  # no number: its bytes cannot move
    return a2a.all_to_all(x, comm=comm)


def case_bool_sum(comm, bad):
    x = np.zeros((comm.size * 2, 3), np.bool_) if bad else good_x(comm)  # moved as bytes, but not added
    return a2a.all_reduce(x, comm=comm)


def case_unknown_algo(comm, bad):
    return a2a.all_to_all(good_x(comm), comm=comm, algo="ring" if bad else "linear")


def case_out_shape(comm, bad):
    x = good_x(comm)
    out = np.empty((x.shape[0], 4) if bad else x.shape, np.float32)
    return a2a.all_to_all(x, comm=comm, out=out)


def case_out_dtype(comm, bad):
    x = good_x(comm)
    out = np.empty(x.shape, np.float64 if bad else np.float32)
    return a2a.all_to_all(x, comm=comm, out=out)


def case_out_framework(comm, bad):
    import torch

    x = good_x(comm)
    out = torch.empty(x.shape) if bad else np.empty_like(x)
    return a2a.all_to_all(x, comm=comm, out=out)


def case_zero_d(comm, bad):
    x = np.float32(3.0).reshape(()) if bad else good_x(comm)
    return a2a.all_to_all(x, comm=comm)


def case_flex_not_divisible(comm, bad):
    shape = (3, comm.size * 2 + 1) if bad else (3, comm.size * 2)
    return a2a.all_to_all_flex(np.zeros(shape, np.int32), comm=comm, split_axis=1, concat_axis=0)


def case_flex_axis(comm, bad):
    x = np.zeros((comm.size, 2, 3), np.float16)
    return a2a.all_to_all_flex(x, comm=comm, split_axis=0, concat_axis=3 if bad else 2)


def case_flex_negative_axis(comm, bad):
    x = np.zeros((comm.size, 2, 3), np.float16)
    return a2a.all_to_all_flex(x, comm=comm, split_axis=-4 if bad else -3, concat_axis=1)


def v_args(comm):
    counts = ref.v_counts("varied", comm.size)
    return ref.v_input("v-bad", comm.rank, counts, (3,), "float64"), [int(c) for c in counts[comm.rank]]


def case_v_sum(comm, bad):
    x, counts = v_args(comm)
    if bad:
        counts[0] += 1
    return a2a.all_to_all_v(x, counts, comm=comm)


def case_v_negative(comm, bad):
    x, counts = v_args(comm)
    if bad:
        counts[0] = -1
    return a2a.all_to_all_v(x, counts, comm=comm)


def case_v_length(comm, bad):
    x, counts = v_args(comm)
    if bad:
        counts = counts + [0]
    return a2a.all_to_all_v(x, counts, comm=comm)


def case_v_unsupported(comm, bad):
    x, counts = v_args(comm)
    if bad:
        x = x.astype(object)
    return a2a.all_to_all_v(x, counts, comm=comm)


BAD_INPUT = {
    # name: (op, min ranks, case, fragments(comm) for the bad rank's message)
    "dim0-not-divisible": (
        "all_to_all",
        2,
        case_dim0,
        lambda c: [f"({c.size * 2 + 1}, 3)", "float32", f"dim 0 ({c.size * 2 + 1})", f"world size {c.size}"],
    ),
    "non-contiguous": ("all_to_all", 1, case_noncontiguous, lambda c: [f"({c.size * 2}, 3)", "not C-contiguous"]),
    "object": ("all_to_all", 1, case_object, lambda c: ["object", f"({c.size * 2}, 3)", "unsupported dtype"]),
    "bool-sum": ("all_reduce", 1, case_bool_sum, lambda c: ["bool", "unsupported dtype"]),
    "unknown-algo": ("all_to_all", 1, case_unknown_algo, lambda c: ["unknown algo 'ring'"]),
    "out-shape": ("all_to_all", 1, case_out_shape, lambda c: [f"({c.size * 2}, 4)", f"expected shape ({c.size * 2}, 3)"]),
    "out-dtype": ("all_to_all", 1, case_out_dtype, lambda c: ["dtype float64", "dtype float32"]),
    "out-framework": ("all_to_all", 1, case_out_framework, lambda c: ["out is a torch array", "numpy"]),
    "zero-d": ("all_to_all", 1, case_zero_d, lambda c: ["()"]),
    "flex-not-divisible": (
        "all_to_all_flex",
        2,
        case_flex_not_divisible,
        lambda c: [f"(3, {c.size * 2 + 1})", "int32", f"dimension 1 ({c.size * 2 + 1})", f"world size {c.size}"],
    ),
    "flex-axis": ("all_to_all_flex", 1, case_flex_axis, lambda c: ["concat_axis=3", "out of range", "float16"]),
    "flex-negative-axis": ("all_to_all_flex", 1, case_flex_negative_axis, lambda c: ["split_axis=-4", "out of range"]),
    "v-sum": ("all_to_all_v", 1, case_v_sum, lambda c: ["send_counts sum to", "rows", "float64"]),
    "v-negative": ("all_to_all_v", 1, case_v_negative, lambda c: ["negative", "-1"]),
    "v-length": ("all_to_all_v", 1, case_v_length, lambda c: [f"must be {c.size} integers"]),
    "v-unsupported": ("all_to_all_v", 1, case_v_unsupported, lambda c: ["object", "unsupported"]),
}


@pytest.mark.parametrize("framework", ["numpy", "torch"])
@pytest.mark.parametrize("algo", ["linear", "2dh"])
def test_v_out_of_other_rows_fails_alone(comm, framework, algo):
    """all_to_all_v learns the rows it receives in the exchange, so an out= of
    other rows fails on its rank alone, after the exchange: that rank raises
    InvalidArgumentError and drops the rows, the others complete with the
    right rows, and the comm works on."""
    if framework == "torch":
        pytest.importorskip("torch")
    if algo == "2dh" and not regular(comm):
        pytest.skip("2dh needs nodes of equal size")
    bad = bad_rank(comm)
    x, counts = v_args(comm)
    expected, _ = ref.v_expected("v-bad", comm.rank, ref.v_counts("varied", comm.size), (3,), "float64")
    out = np.empty((expected.shape[0] + 1, 3)) if comm.rank == bad else np.empty_like(expected)
    if framework == "torch":
        x, out = ref.to_framework(x, "float64", "torch"), ref.to_framework(out, "float64", "torch")
    result, error = outcome(lambda: a2a.all_to_all_v(x, counts, comm=comm, algo=algo, out=out))
    after = still_works(comm)
    if comm.rank == bad:
        assert isinstance(error, a2a.InvalidArgumentError), repr(error)
        assert "out has shape" in str(error) and "dropped" in str(error), str(error)
    else:
        assert error is None, repr(error)
        ref.assert_bitwise_equal(result[0], expected, "all_to_all_v beside a rank with a bad out=")
    after()


def mismatch_then_still_works(comm, call, *fragments):
    """Both collectives first, then the checks."""
    error = outcome(call)[1]
    after = still_works(comm)
    check_mismatch(error, *fragments)
    after()


def bad_rank_then_still_works(comm, bad, op, call, *fragments):
    error = outcome(call)[1]
    after = still_works(comm)
    message = check_bad_rank(comm, bad, op, error, *fragments)
    after()
    return message


@pytest.mark.parametrize("name", list(BAD_INPUT))
def test_one_rank_with_bad_input(comm, name):
    op, min_ranks, case, fragments = BAD_INPUT[name]
    if comm.size < min_ranks:
        pytest.skip(f"needs {min_ranks} ranks")
    if name == "out-framework":
        pytest.importorskip("torch")
    bad = bad_rank(comm)
    bad_rank_then_still_works(comm, bad, op, lambda: case(comm, comm.rank == bad), *fragments(comm))


@pytest.mark.parametrize("name", ["object", "non-contiguous", "v-negative", "flex-axis"])
def test_every_rank_with_bad_input(comm, name):
    op, _, case, fragments = BAD_INPUT[name]
    error = outcome(lambda: case(comm, True))[1]
    after = still_works(comm)
    assert isinstance(error, a2a.InvalidArgumentError), repr(error)
    message = str(error)
    for fragment in (op, f"rank {comm.rank} of {comm.size}", *fragments(comm)):
        assert fragment in message, f"{fragment!r} not in {message!r}"
    after()


def test_several_bad_ranks_are_all_named(comm):
    if comm.size < 3:
        pytest.skip("needs 3 ranks")
    bad = {0, comm.size - 1}
    is_bad = comm.rank in bad
    x = np.zeros((comm.size * 2, 3), object) if is_bad else good_x(comm)
    error = outcome(lambda: a2a.all_to_all(x, comm=comm))[1]
    after = still_works(comm)
    message = str(error)
    if is_bad:
        assert isinstance(error, a2a.InvalidArgumentError) and "object" in message, repr(error)
    else:
        assert isinstance(error, a2a.RemoteError), repr(error)
        assert f"rank(s) 0, {comm.size - 1} rejected" in message, message
    after()


# ---------------------------------------------------------------------------
# Ranks that disagree.


@pytest.fixture
def two(comm):
    if comm.size < 2:
        pytest.skip("needs at least 2 ranks")


def others_value(comm, first, rest):
    return first if comm.rank == 0 else rest


def test_dtype_mismatch(comm, two):
    dtype = others_value(comm, "float32", "float64")
    x = np.zeros((comm.size * 2, 3), dtype)
    mismatch_then_still_works(
        comm,
        lambda: a2a.all_to_all(x, comm=comm),
        "all_to_all",
        f"on rank {comm.rank}",
        "'dtype' differs across ranks",
        "rank 0: float32",
        "rank 1: float64",
        f"dtype={dtype}",
        "count per peer=6",
    )


def test_same_itemsize_dtype_mismatch(comm, two, torch):
    x = torch.zeros(comm.size * 4, dtype=others_value(comm, torch.bfloat16, torch.float16))
    mismatch_then_still_works(
        comm, lambda: a2a.all_to_all(x, comm=comm), "'dtype' differs", "rank 0: bfloat16", "rank 1: float16"
    )


def test_int_dtype_mismatch(comm, two):
    x = np.zeros(comm.size * 4, others_value(comm, np.int32, np.float32))
    mismatch_then_still_works(
        comm, lambda: a2a.all_to_all(x, comm=comm), "'dtype' differs", "rank 0: int32", "rank 1: float32"
    )


def test_count_mismatch(comm, two):
    x = np.zeros(comm.size * others_value(comm, 3, 2), np.float32)
    mismatch_then_still_works(
        comm,
        lambda: a2a.all_to_all(x, comm=comm),
        "all_to_all",
        "'count per peer' differs",
        "rank 0: 3",
        "rank 1: 2",
        f"rank {comm.size - 1}: 2",
    )


def test_count_mismatch_from_trailing_dims(comm, two):
    x = np.zeros((comm.size, others_value(comm, 4, 5)), np.int8)
    mismatch_then_still_works(
        comm, lambda: a2a.all_to_all(x, comm=comm), "'count per peer' differs", "rank 0: 4", "rank 1: 5"
    )


def test_algo_mismatch(comm, two):
    if not regular(comm):
        pytest.skip("2dh is rejected outright on this topology")
    x = good_x(comm)
    algo = others_value(comm, "linear", "2dh")
    mismatch_then_still_works(
        comm, lambda: a2a.all_to_all(x, comm=comm, algo=algo), "'algo' differs", "rank 0: linear", "rank 1: 2dh"
    )


def test_different_collectives(comm, two):
    x = good_x(comm)
    if comm.rank == 0:
        call = lambda: a2a.all_to_all(x, comm=comm)
    else:
        call = lambda: a2a.all_to_all_flex(x, comm=comm, split_axis=0, concat_axis=1)
    mismatch_then_still_works(
        comm, call, "ranks called different collectives", "rank 0: all_to_all,", "rank 1: all_to_all_flex"
    )


def test_all_to_all_against_all_to_all_v(comm, two):
    x = good_x(comm)
    if comm.rank == 0:
        call = lambda: a2a.all_to_all_v(x, [2] * comm.size, comm=comm)
    else:
        call = lambda: a2a.all_to_all(x, comm=comm)
    mismatch_then_still_works(
        comm, call, "ranks called different collectives", "rank 0: all_to_all_v", "rank 1: all_to_all"
    )


def test_flex_shape_mismatch(comm, two):
    x = np.zeros((comm.size * 2, others_value(comm, 3, 4)), np.float32)
    mismatch_then_still_works(
        comm,
        lambda: a2a.all_to_all_flex(x, comm=comm, split_axis=0, concat_axis=1),
        "all_to_all_flex",
        "'shape[1]' differs",
        "rank 0: 3",
        "rank 1: 4",
    )


def test_flex_same_size_different_shape(comm, two):
    """Same element count, different layout: flex needs equal shapes."""
    x = np.zeros(others_value(comm, (comm.size * 2, 6), (comm.size * 4, 3)), np.float32)
    mismatch_then_still_works(
        comm, lambda: a2a.all_to_all_flex(x, comm=comm, split_axis=0, concat_axis=0), "'shape[0]' differs"
    )


def test_flex_axis_mismatch(comm, two):
    x = np.zeros((comm.size * 2, comm.size), np.float32)
    concat = others_value(comm, 1, 0)
    mismatch_then_still_works(
        comm,
        lambda: a2a.all_to_all_flex(x, comm=comm, split_axis=0, concat_axis=concat),
        "'concat_axis' differs",
        "rank 0: 1",
        "rank 1: 0",
    )


def test_flex_ndim_mismatch(comm, two):
    x = np.zeros(others_value(comm, (comm.size * 2, 3), (comm.size * 2, 3, 1)), np.float32)
    mismatch_then_still_works(
        comm,
        lambda: a2a.all_to_all_flex(x, comm=comm, split_axis=0, concat_axis=0),
        "'ndim' differs",
        "rank 0: 2",
        "rank 1: 3",
    )


def test_flex_negative_axes_that_agree_are_fine(comm, two):
    """split_axis=-2 on some ranks and 0 on others name the same axis."""
    shape = (comm.size * 2, 3)
    x = ref.flex_input("neg-agree", comm.rank, comm.size, shape, 0, "float32")
    split = others_value(comm, -2, 0)
    y = a2a.all_to_all_flex(x, comm=comm, split_axis=split, concat_axis=-1)
    ref.assert_bitwise_equal(y, ref.flex_expected("neg-agree", comm.rank, comm.size, shape, 0, 1, "float32"))


def test_v_dtype_mismatch(comm, two):
    x = np.zeros((comm.size, 2), others_value(comm, np.float32, np.int32))
    mismatch_then_still_works(
        comm,
        lambda: a2a.all_to_all_v(x, [1] * comm.size, comm=comm),
        "all_to_all_v",
        "'dtype' differs",
        "rank 0: float32",
        "rank 1: int32",
    )


def test_v_row_width_mismatch(comm, two):
    x = np.zeros((comm.size, others_value(comm, 3, 4)), np.float32)
    mismatch_then_still_works(
        comm,
        lambda: a2a.all_to_all_v(x, [1] * comm.size, comm=comm),
        "all_to_all_v",
        "'row elements' differs",
        "rank 0: 3",
        "rank 1: 4",
    )


def test_v_algo_mismatch(comm, two):
    if not regular(comm):
        pytest.skip("2dh is rejected outright on this topology")
    x = np.zeros((comm.size, 2), np.float32)
    algo = others_value(comm, "2dh", "linear")
    mismatch_then_still_works(
        comm,
        lambda: a2a.all_to_all_v(x, [1] * comm.size, comm=comm, algo=algo),
        "'algo' differs",
        "rank 0: 2dh",
        "rank 1: linear",
    )


def test_v_everything_to_rank0(comm, two):
    """Counts are exchanged inside: receivers need not know them in advance."""
    counts = ref.v_counts("only_to_rank0", comm.size)
    x = ref.v_input("v-rank0", comm.rank, counts, (), "int64")
    y, recv_counts = a2a.all_to_all_v(x, counts[comm.rank], comm=comm)
    expected, expected_counts = ref.v_expected("v-rank0", comm.rank, counts, (), "int64")
    ref.assert_bitwise_equal(y, expected)
    assert recv_counts.tolist() == expected_counts.tolist()


def test_flex_too_many_dims_on_one_rank(world, two):
    """A layout only the core rejects (more than 16 dims) on one rank must still
    reach every rank: the others raise RemoteError instead of waiting for it.
    A dedicated comm with a short timeout keeps a failure here from spoiling
    the module's comm."""
    c = a2a.Comm.from_mpi(world, timeout_s=5)
    bad = c.size - 1
    shape = (c.size, *([1] * 16)) if c.rank == bad else (c.size, 2)
    x = np.zeros(shape, np.float32)
    error = outcome(lambda: a2a.all_to_all_flex(x, comm=c, split_axis=0, concat_axis=0))[1]
    check_bad_rank(c, bad, "all_to_all_flex", error, "ndim", "17")


@pytest.mark.parametrize("rows_per_peer", [4, 20_000], ids=["small", "large"])
@pytest.mark.parametrize("op", ["all_to_all", "all_to_all_flex", "all_to_all_v", "plan_v.run"])
def test_rejected_call_writes_only_agreed_data(comm, two, op, rows_per_peer):
    """A rejected call whose check travelled with the data says so ("the
    output may hold what the other ranks sent"): then each block of the good
    ranks' out= holds either what it held before or exactly its sender's rows,
    and the rejecting rank's block is untouched. A check by round says "no
    data was exchanged", and out= is untouched."""
    bad = bad_rank(comm)
    n = rows_per_peer
    shape = (comm.size * n, 3)
    x = ref.a2a_input("untouched", comm.rank, comm.size, shape, "float32")
    expected = ref.a2a_expected("untouched", comm.rank, comm.size, shape, "float32")
    plan = a2a.plan_v([n] * comm.size, like=x, comm=comm) if op == "plan_v.run" else None
    if comm.rank == bad:
        x = x.astype(object)
    out = np.full(shape, -7.0, np.float32)
    calls = {
        "all_to_all": lambda: a2a.all_to_all(x, comm=comm, out=out),
        "all_to_all_flex": lambda: a2a.all_to_all_flex(x, comm=comm, split_axis=0, concat_axis=0, out=out),
        "all_to_all_v": lambda: a2a.all_to_all_v(x, [n] * comm.size, comm=comm, out=out),
        "plan_v.run": lambda: plan.run(x, out=out),
    }
    name = "all_to_all_v" if op == "plan_v.run" else op
    message = bad_rank_then_still_works(comm, bad, name, calls[op], "object")
    if comm.rank == bad:
        return
    data_moved = "the output may hold what the other ranks sent" in message
    assert data_moved or "no data was exchanged" in message, message
    bits, expected_bits = out.view(np.uint32), expected.view(np.uint32)  # the rows are random bits, NaNs included
    for src in range(comm.size):
        rows = slice(src * n, (src + 1) * n)
        got = out[rows]
        untouched = bool(np.all(got == -7.0))
        sent = np.array_equal(bits[rows], expected_bits[rows])
        assert untouched or (data_moved and src != bad and sent), (
            f"rank {comm.rank}: the block from rank {src} of out= after '{message}' is neither untouched nor "
            f"rank {src}'s rows (first rows: {got[:2].tolist()})"
        )


# ---------------------------------------------------------------------------
# The in-band check (docs/algorithms.md, "The argument check"): on MPI
# communicators the linear collectives' first exchange carries the check in
# the MPI tag, and the data lands straight in recv; a message of another
# label or size is received into a buffer of its own. Mixes of sizes and of
# different collectives must all end in the same errors as the separate
# check, on every rank, with the comm usable afterwards.


@pytest.mark.parametrize(
    "counts", [(3, 50_000), (50_000, 3), (40_000, 50_000), (3, 4_000), (4_000, 3)],
    ids=["small-large", "large-small", "large-large", "small-rendezvous", "rendezvous-small"],
)
def test_count_mismatch_of_any_sizes(comm, two, counts):
    """Messages longer than the receive expects never meet its buffer: 4000
    floats against 3 (a rendezvous message, past Open MPI's eager limit)
    corrupted the heap when a labelled receive took any tag."""
    first, rest = counts
    x = np.zeros(comm.size * others_value(comm, first, rest), np.float32)
    mismatch_then_still_works(
        comm, lambda: a2a.all_to_all(x, comm=comm), "'count per peer' differs", f"rank 0: {first}", f"rank 1: {rest}"
    )


def test_in_band_collective_against_a_separate_check(comm, two):
    """all_to_all (check in band) on rank 0, all_reduce (a round of its own)
    on the others: the two kinds of round still pair up."""
    x = good_x(comm)
    if comm.rank == 0:
        call = lambda: a2a.all_to_all(x, comm=comm)
    else:
        call = lambda: a2a.all_reduce(x, comm=comm)
    mismatch_then_still_works(comm, call, "ranks called different collectives", "rank 0: all_to_all,", "rank 1: all_reduce")


def test_different_v_plans(comm, two):
    """Each rank runs a plan of its own: the plans' ids differ."""
    x = np.zeros(comm.size, np.float32)
    counts = [1] * comm.size
    first = a2a.plan_v(counts, like=x, comm=comm)
    second = a2a.plan_v(counts, like=x, comm=comm)
    plan = others_value(comm, first, second)
    mismatch_then_still_works(comm, lambda: plan.run(x), "all_to_all_v", "'plan' differs")


def test_a_v_plan_on_one_rank_and_counts_on_the_others(comm, two):
    """One op in two forms: the fields differ in kind, not only in value, and the message says so on every rank
    (compared by position, rank 0's plan id was shown as the others' row elements)."""
    x = np.zeros((comm.size, 2), np.float32)
    plan = a2a.plan_v([1] * comm.size, like=x, comm=comm)
    call = others_value(comm, lambda: plan.run(x), lambda: a2a.all_to_all_v(x, [1] * comm.size, comm=comm))
    other = "1, 2" if comm.size == 3 else ", ".join(map(str, range(1, comm.size)))
    mismatch_then_still_works(comm, call, "all_to_all_v", "with different kinds of arguments",
                              f"rank(s) {other if comm.rank == 0 else 0} passed another kind")



def test_ragged_counts_on_one_rank_reach_every_rank(comm, two):
    """The NumPy fast path of all_to_all_v must not raise locally on counts it
    cannot read: the general path reports them to every rank."""
    bad = bad_rank(comm)
    x = np.zeros(comm.size, np.float32)
    counts = [1, [2, 3]] + [1] * (comm.size - 2) if comm.rank == bad else [1] * comm.size
    bad_rank_then_still_works(comm, bad, "all_to_all_v", lambda: a2a.all_to_all_v(x, counts, comm=comm), "ValueError")
