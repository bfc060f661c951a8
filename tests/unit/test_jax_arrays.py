"""JAX arrays on the CPU (a2a/_jax.py): every collective and MoE kernel takes
them through DLPack and returns JAX arrays equal to what NumPy gets; out=
cannot be a JAX array; a JAX array on a GPU is refused with the way around.
Across ranks, against jax.lax.all_to_all: tests/mpi/test_mpi_jax.py."""

from __future__ import annotations

import numpy as np
import pytest

import a2a
from a2a._jax import gpu_array_error

jax = pytest.importorskip("jax")
jnp = jax.numpy


def values(*shape, dtype=np.float32, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def assert_jax_equal(got, want):
    assert isinstance(got, jax.Array), type(got)
    np.testing.assert_array_equal(np.asarray(got), want)


COLLECTIVES = {
    "all_to_all": lambda x, c: a2a.all_to_all(x, comm=c, algo="2dh"),
    "all_to_all_flex": lambda x, c: a2a.all_to_all_flex(x, comm=c, split_axis=0, concat_axis=1),
    "all_gather": lambda x, c: a2a.all_gather(x, comm=c),
    "all_reduce": lambda x, c: a2a.all_reduce(x, comm=c, op="max"),
    "reduce_scatter": lambda x, c: a2a.reduce_scatter(x, comm=c),
    "all_gather_v": lambda x, c: a2a.all_gather_v(x, [x.shape[0]], comm=c),
    "reduce_scatter_v": lambda x, c: a2a.reduce_scatter_v(x, [x.shape[0]], comm=c),
}


@pytest.mark.parametrize("name", sorted(COLLECTIVES))
def test_a_collective_returns_a_jax_array_equal_to_numpys(comm, name):
    x = values(6, 5, 3)
    assert_jax_equal(COLLECTIVES[name](jnp.asarray(x), comm), COLLECTIVES[name](x, comm))


def test_all_to_all_v_and_a_plan_return_jax_arrays(comm):
    x = values(7, 4)
    y, counts = a2a.all_to_all_v(jnp.asarray(x), [7], comm=comm)
    assert_jax_equal(y, x)
    assert_jax_equal(counts, np.array([7]))
    plan = a2a.plan_v([7], like=jnp.asarray(x), comm=comm)
    assert_jax_equal(plan.run(jnp.asarray(x)), x)


def test_the_moe_kernels_return_jax_arrays_equal_to_numpys():
    T, k, E, M = 11, 2, 3, 8
    rng = np.random.default_rng(1)
    indices = rng.integers(0, E, (T, k)).astype(np.int32)
    gates = rng.random((T, k)).astype(np.float32)
    x = values(T, M, seed=2)
    routing = a2a.route(jnp.asarray(indices), E, capacity=6)
    want = a2a.route(indices, E, capacity=6)
    np.testing.assert_array_equal(routing.locations, want.locations)
    encoded = a2a.fast_encode(jnp.asarray(x), routing, gates=jnp.asarray(gates))
    assert_jax_equal(encoded, a2a.fast_encode(x, want, gates=gates))
    assert_jax_equal(a2a.fast_decode(encoded, routing, gates=jnp.asarray(gates)),
                     a2a.fast_decode(np.asarray(encoded), want, gates=gates))
    assert_jax_equal(a2a.gate_grad(jnp.asarray(x), encoded, routing), a2a.gate_grad(x, np.asarray(encoded), want))
    x_sorted, perm = a2a.permute(jnp.asarray(x), jnp.asarray(indices), E)
    x_sorted_np, perm_np = a2a.permute(x, indices, E)
    assert_jax_equal(x_sorted, x_sorted_np)
    assert_jax_equal(a2a.unpermute(x_sorted, perm, gates=jnp.asarray(gates)),
                     a2a.unpermute(x_sorted_np, perm_np, gates=gates))
    index = a2a.es_index(jnp.asarray(indices), E)
    w = values(E, 5, M, seed=3)  # (E, N, K)
    assert_jax_equal(a2a.esmm(jnp.asarray(x), jnp.asarray(w), index), a2a.esmm(x, w, a2a.es_index(indices, E)))


def test_the_fused_gate_takes_and_returns_jax_arrays():
    # Forward then backward as JAX gives them: without x64 the indices come back as int32 (widened again).
    logits = values(9, 4, seed=4)
    got = a2a.top_k_gate(jnp.asarray(logits), 2, normalize=True)
    want = a2a.top_k_gate(logits, 2, normalize=True)
    for g, w in zip(got, want):
        assert_jax_equal(g, w.astype(np.asarray(g).dtype))
    d_gates = values(9, 2, seed=5)
    d_logits = a2a.top_k_gate_backward(got[0], got[1], got[3], jnp.asarray(d_gates), got[4], normalize=True)
    assert_jax_equal(d_logits, a2a.top_k_gate_backward(want[0], want[1], want[3], d_gates, want[4], normalize=True))


def test_out_cannot_be_a_jax_array_and_a_numpy_out_is_the_result(comm):
    x = jnp.asarray(values(4, 3))
    with pytest.raises(a2a.InvalidArgumentError, match="out is a JAX array, and JAX arrays are immutable"):
        a2a.all_to_all(x, comm=comm, out=jnp.zeros((4, 3), jnp.float32))
    out = np.empty((4, 3), np.float32)
    assert a2a.all_to_all(x, comm=comm, out=out) is out
    np.testing.assert_array_equal(out, np.asarray(x))
    routing = a2a.route(np.zeros((4, 1), np.int32), 1, capacity=4)
    with pytest.raises(a2a.InvalidArgumentError, match="JAX arrays are immutable"):
        a2a.fast_encode(x, routing, out=jnp.zeros((1, 4, 3), jnp.float32))


def test_a_jax_array_on_a_gpu_is_refused_with_the_way_around():
    class OnGpu:  # what a JAX CUDA array answers (no GPU here)
        def devices(self):
            return {type("Device", (), {"platform": "gpu"})()}

    message = gpu_array_error(OnGpu(), "input")
    assert "input is a JAX array on gpu" in message and "torch.from_dlpack(x)" in message
    assert gpu_array_error(jnp.zeros(2), "input") is None
