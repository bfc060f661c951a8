"""all_to_all_flex (JAX lax.all_to_all semantics) under mpirun: the NumPy
reference, an all_to_all-based composition, and every code path bitwise
against the others (linear with MPI datatypes, linear packing with copies, 2DH)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import reference as ref
from a2a_mpi_util import regular, run_or_expect_rejection

import a2a

# name -> (shape as a function of the world size, split_axis, concat_axis)
CASES = {
    "moe-dispatch": (lambda w: (w * 2, 3, 5), 0, 1),
    "moe-combine": (lambda w: (2, w * 3, 5), 1, 0),
    "split0-concat0": (lambda w: (w * 3, 4), 0, 0),
    "split1-concat1": (lambda w: (4, w * 3), 1, 1),
    "negative-axes": (lambda w: (3, 2, w * 2), -1, -3),
    "last-to-first-4d": (lambda w: (2, 1, 3, w), 3, 0),
    "1d": (lambda w: (w * 5,), 0, 0),
    "odd-middle": (lambda w: (3, w * 7, 5), 1, 2),
    "first-to-last": (lambda w: (w, 2, 3), 0, -1),
    "zero-leading": (lambda w: (0, w * 2), 1, 0),
    "zero-trailing": (lambda w: (w * 2, 0), 0, 1),
    "one-per-peer": (lambda w: (w,), 0, 0),
}

# (algo, use MPI datatypes): the three code paths.
PATHS = {"linear-datatypes": ("linear", True), "linear-copies": ("linear", False), "2dh": ("2dh", True)}


def normalize(axis, ndim):
    return axis % ndim


def flex_via_all_to_all(x, comm, split, concat):
    """The same exchange composed from reshapes and a dim-0 all_to_all."""
    world = comm.size
    shape = x.shape
    n = shape[split] // world
    grouped = x.reshape(shape[:split] + (world, n) + shape[split + 1 :])
    send = np.ascontiguousarray(np.moveaxis(grouped, split, 0))  # [dst, *block]
    recv = a2a.all_to_all(send, comm=comm)  # [src, *block]
    out_shape = list(shape)
    out_shape[split] = n
    out_shape[concat] *= world
    return np.ascontiguousarray(np.moveaxis(recv, 0, concat)).reshape(out_shape)


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("dtype", ["float32", "float16", "int8", "float64"])
@pytest.mark.parametrize("case", list(CASES))
def test_flex_matches_reference(comm, comm_copies, case, dtype, path):
    make_shape, split, concat = CASES[case]
    algo, datatypes = PATHS[path]
    c = comm if datatypes else comm_copies
    shape = make_shape(comm.size)
    s, k = normalize(split, len(shape)), normalize(concat, len(shape))
    tag = f"flex-{case}-{dtype}"
    inputs = [ref.flex_input(tag, r, comm.size, shape, s, dtype) for r in range(comm.size)]
    expected = ref.ref_all_to_all_flex(inputs, s, k)[comm.rank]
    x = inputs[comm.rank]
    y = run_or_expect_rejection(
        comm, algo, lambda: a2a.all_to_all_flex(x, comm=c, split_axis=split, concat_axis=concat, algo=algo)
    )
    ref.assert_bitwise_equal(expected, ref.flex_expected(tag, comm.rank, comm.size, shape, s, k, dtype), "reference")
    if y is None:
        return
    assert isinstance(y, np.ndarray) and y.dtype == x.dtype
    ref.assert_bitwise_equal(y, expected, f"{case} {path} rank {comm.rank}")


@pytest.mark.parametrize("case", list(CASES))
def test_flex_matches_all_to_all_composition(comm, comm_copies, case):
    make_shape, split, concat = CASES[case]
    shape = make_shape(comm.size)
    s, k = normalize(split, len(shape)), normalize(concat, len(shape))
    x = ref.flex_input(f"compose-{case}", comm.rank, comm.size, shape, s, "int32")
    composed = flex_via_all_to_all(x, comm, s, k)
    results = [a2a.all_to_all_flex(x, comm=c, split_axis=split, concat_axis=concat) for c in (comm, comm_copies)]
    for y in results:
        ref.assert_bitwise_equal(y, composed, "flex vs all_to_all composition")


@pytest.mark.parametrize("case", list(CASES))
def test_all_paths_agree_bitwise(comm, comm_copies, case):
    make_shape, split, concat = CASES[case]
    shape = make_shape(comm.size)
    x = ref.flex_input(f"paths-{case}", comm.rank, comm.size, shape, normalize(split, len(shape)), "uint8")
    results = {
        "datatypes": a2a.all_to_all_flex(x, comm=comm, split_axis=split, concat_axis=concat),
        "copies": a2a.all_to_all_flex(x, comm=comm_copies, split_axis=split, concat_axis=concat),
    }
    if regular(comm):
        results["2dh"] = a2a.all_to_all_flex(x, comm=comm, split_axis=split, concat_axis=concat, algo="2dh")
        results["2dh-copies"] = a2a.all_to_all_flex(
            x, comm=comm_copies, split_axis=split, concat_axis=concat, algo="2dh"
        )
    for name, y in results.items():
        ref.assert_bitwise_equal(y, results["datatypes"], f"{name} vs datatypes")


def test_env_disables_mpi_datatypes(world, comm, monkeypatch):
    """A2A_MPI_DATATYPES=0 selects the copy path; results are identical."""
    monkeypatch.setenv("A2A_MPI_DATATYPES", "0")
    c = a2a.Comm.from_mpi(world)
    shape = (3, world.Get_size() * 4, 5)
    x = ref.flex_input("env-dt", c.rank, c.size, shape, 1, "float32")
    expected = ref.flex_expected("env-dt", c.rank, c.size, shape, 1, 2, "float32")
    copies = a2a.all_to_all_flex(x, comm=c, split_axis=1, concat_axis=2)
    datatypes = a2a.all_to_all_flex(x, comm=comm, split_axis=1, concat_axis=2)
    ref.assert_bitwise_equal(copies, expected, "A2A_MPI_DATATYPES=0")
    ref.assert_bitwise_equal(datatypes, expected, "default")


@pytest.mark.parametrize("algo", ["linear", "2dh"])
def test_moe_dispatch_then_combine_round_trips(comm, algo):
    """(E, C, M) -> (E/W, W*C, M) -> (E, C, M) gives back the input."""
    experts, capacity, model = comm.size * 2, 3, 8
    x = ref.block("moe", comm.rank, comm.rank, (experts, capacity, model), "float32")

    def round_trip():
        dispatched = a2a.all_to_all_flex(x, comm=comm, split_axis=0, concat_axis=1, algo=algo)
        return dispatched, a2a.all_to_all_flex(dispatched, comm=comm, split_axis=1, concat_axis=0, algo=algo)

    result = run_or_expect_rejection(comm, algo, round_trip)
    if result is not None:
        dispatched, back = result
        assert dispatched.shape == (2, comm.size * capacity, model)
        ref.assert_bitwise_equal(back, x, "round trip")


@pytest.mark.parametrize("algo", ["linear", "2dh"])
def test_flex_torch_bfloat16(comm, torch, algo):
    shape = (2, comm.size * 3, 4)
    bits = ref.flex_input("flex-bf16", comm.rank, comm.size, shape, 1, "bfloat16")
    x = ref.to_framework(bits, "bfloat16", "torch")
    y = run_or_expect_rejection(
        comm, algo, lambda: a2a.all_to_all_flex(x, comm=comm, split_axis=1, concat_axis=0, algo=algo)
    )
    if y is None:
        return
    assert isinstance(y, torch.Tensor) and y.dtype == torch.bfloat16
    ref.assert_bitwise_equal(y, ref.flex_expected("flex-bf16", comm.rank, comm.size, shape, 1, 0, "bfloat16"))


def test_flex_out(comm):
    shape = (comm.size * 2, 3)
    x = ref.flex_input("flex-out", comm.rank, comm.size, shape, 0, "int64")
    out = np.zeros((2, comm.size * 3), np.int64)
    assert a2a.all_to_all_flex(x, comm=comm, split_axis=0, concat_axis=1, out=out) is out
    ref.assert_bitwise_equal(out, ref.flex_expected("flex-out", comm.rank, comm.size, shape, 0, 1, "int64"))


@pytest.mark.parametrize("case", ["moe-dispatch", "odd-middle", "last-to-first-4d"])
def test_mixed_datatype_settings_across_ranks(world, case):
    """The wire format does not depend on use_mpi_datatypes: ranks may differ."""
    c = a2a.Comm.from_mpi(world, use_mpi_datatypes=world.Get_rank() % 2 == 0)
    make_shape, split, concat = CASES[case]
    shape = make_shape(c.size)
    s, k = normalize(split, len(shape)), normalize(concat, len(shape))
    x = ref.flex_input(f"mixed-{case}", c.rank, c.size, shape, s, "float32")
    y = a2a.all_to_all_flex(x, comm=c, split_axis=split, concat_axis=concat)
    ref.assert_bitwise_equal(y, ref.flex_expected(f"mixed-{case}", c.rank, c.size, shape, s, k, "float32"))


# Layouts large enough for each path of choose_flex_path (csrc/core/algorithms.cpp):
# pieces need pieces of 64 KiB, datatypes 64 KiB per peer in small blocks.
PATH_CASES = {
    "pieces-dispatch": (lambda w: (2 * w, 16, 4096), 0, 1),  # 2 pieces of 64 KiB per peer
    "pieces-combine": (lambda w: (2, w * 16, 4096), 1, 0),
    "pieces-three-blocks": (lambda w: (3, w, 65536), 1, 0),
    "datatypes-small-blocks": (lambda w: (256, w * 256), 1, 0),  # 256 blocks of 256 bytes per peer
}


@pytest.mark.parametrize("case", list(PATH_CASES))
def test_large_layouts_on_every_path(comm, comm_copies, case):
    make_shape, split, concat = PATH_CASES[case]
    shape = make_shape(comm.size)
    tag = f"flex-path-{case}"
    x = ref.flex_input(tag, comm.rank, comm.size, shape, split, "uint8")
    expected = ref.flex_expected(tag, comm.rank, comm.size, shape, split, concat, "uint8")
    for c in (comm, comm_copies):
        ref.assert_bitwise_equal(a2a.all_to_all_flex(x, comm=c, split_axis=split, concat_axis=concat), expected, case)
    # The path shows in the workspace: packing needs one, the others none
    # (datatypes only where the data goes straight to MPI).
    workspace = comm._native.all_to_all_flex_workspace_size(list(shape), split, concat, 7, 0)
    packs = os.environ.get("A2A_TEST_STAGING", "") in ("staged", "predicted") or comm.transport == "external"
    if case.startswith("pieces") or not packs:  # staged and torchrun's transports take contiguous bytes only
        assert workspace == 0, case
