"""JAX arrays across ranks: a2a's all-to-alls on JAX CPU arrays against
jax.lax.all_to_all's semantics. The reference runs every rank's input in
one process, with the ranks as a vmapped named axis (jax.vmap(...,
axis_name=...) batches lax.all_to_all), and each rank compares its own row.
Single-process cases: tests/unit/test_jax_arrays.py."""

from __future__ import annotations

import os

import numpy as np
import pytest
from a2a_mpi_util import regular

import a2a

# tests/run_mpi.py runs these in their own configurations (A2A_TEST_JAX=1): elsewhere no rank imports JAX.
RUN = os.environ.get("A2A_TEST_JAX") == "1"
pytestmark = [pytest.mark.mpi, pytest.mark.skipif(not RUN, reason="run by tests/run_mpi.py in the jax-* configurations")]
if RUN:
    jax = pytest.importorskip("jax")
    jnp = jax.numpy


def inputs(comm, shape, seed):
    """Every rank's input (the same on every rank: each computes the reference alone)."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal((comm.size, *shape)).astype(np.float32)


def lax_all_to_all(stacked, split_axis, concat_axis):
    """jax.lax.all_to_all(x, axis, split_axis, concat_axis, tiled=True) on each rank's x, all at once."""
    exchange = lambda x: jax.lax.all_to_all(x, "ranks", split_axis, concat_axis, tiled=True)
    return np.asarray(jax.vmap(exchange, axis_name="ranks")(jnp.asarray(stacked)))


@pytest.mark.parametrize("rows, split_axis, concat_axis, algo", [
    ((2, 3, 5), 0, 1, "linear"),  # MoE dispatch: (E, C, M) -> (E / W, W * C, M)
    ((3, 2, 5), 1, 0, "linear"),  # and combine
    ((2, 4, 3), 0, 2, "2dh"),
    ((3, 1, 2), 1, 1, "linear"),
])
def test_all_to_all_flex_is_lax_all_to_all(comm, rows, split_axis, concat_axis, algo):
    if algo == "2dh" and not regular(comm):
        pytest.skip("2dh needs nodes of equal size")
    shape = tuple(n * comm.size if axis == split_axis else n for axis, n in enumerate(rows))
    stacked = inputs(comm, shape, seed=len(shape) + split_axis * 3 + concat_axis)
    got = a2a.all_to_all_flex(jnp.asarray(stacked[comm.rank]), comm=comm, split_axis=split_axis,
                              concat_axis=concat_axis, algo=algo)
    assert isinstance(got, jax.Array)
    np.testing.assert_array_equal(np.asarray(got), lax_all_to_all(stacked, split_axis, concat_axis)[comm.rank])


@pytest.mark.parametrize("algo", ["linear", "2dh"])
def test_all_to_all_is_lax_all_to_all_along_rows(comm, algo):
    if algo == "2dh" and not regular(comm):
        pytest.skip("2dh needs nodes of equal size")
    stacked = inputs(comm, (3 * comm.size, 4), seed=11)
    got = a2a.all_to_all(jnp.asarray(stacked[comm.rank]), comm=comm, algo=algo)
    assert isinstance(got, jax.Array)
    np.testing.assert_array_equal(np.asarray(got), lax_all_to_all(stacked, 0, 0)[comm.rank])


def test_a_jax_out_is_refused_on_every_rank(comm):
    x = jnp.asarray(inputs(comm, (comm.size, 2), seed=3)[comm.rank])
    out = jnp.zeros_like(x) if comm.rank == comm.size - 1 else np.empty(x.shape, np.float32)
    if comm.rank == comm.size - 1:
        with pytest.raises(a2a.InvalidArgumentError, match="JAX arrays are immutable"):
            a2a.all_to_all(x, comm=comm, out=out)
    else:  # the others learn of it in the same call
        with pytest.raises(a2a.RemoteError, match=rf"rank\(s\) {comm.size - 1} rejected their input"):
            a2a.all_to_all(x, comm=comm, out=out)
