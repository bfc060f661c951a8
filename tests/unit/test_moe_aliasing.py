"""The MoE kernels refuse an output that is, or overlaps, an input (they read
and write in parallel: an overlapping out= gave wrong results, silently).
The check is in the core entry points (csrc/moe/moe.cpp), so the C ABI has it
too: exact aliases (out=x where the element counts allow it) and buffers one
row apart, with NumPy and torch."""

from __future__ import annotations

import numpy as np
import pytest
import reference as ref
from checks import raises_invalid

import a2a
from a2a import _C
from a2a._routing import native_routing

# T = E * C, with every token routed: out= can be x itself.
T, K, E, C, M = 12, 1, 3, 4, 5
OVERLAP = "the kernels do not work in place"


@pytest.fixture(params=["numpy", "torch"])
def framework(request):
    if request.param == "torch":
        pytest.importorskip("torch")
    return request.param


@pytest.fixture
def indices():
    return (np.arange(T, dtype=np.int64) % E).reshape(T, K)  # C = T / E slots per expert, none dropped


def buffer(framework, rows, tag="alias"):
    """A (rows, M) float32 array of `framework` holding deterministic data."""
    return ref.to_framework(ref.moe_data(tag, (rows, M), "float32"), "float32", framework)


def routing_of(indices, framework):
    routing = a2a.route(ref.to_framework(indices, "int64", framework), E, capacity=C)
    assert (routing.capacity, routing.num_rows, routing.num_dropped) == (C, T, 0)
    return routing


def test_encode_into_its_own_input(framework, indices):
    x = buffer(framework, T)
    routing = routing_of(indices, framework)
    raises_invalid(
        lambda: a2a.fast_encode(x, routing, out=x), "dispatch", "output rows overlaps input x", OVERLAP
    )
    both = buffer(framework, T + 1)  # out one row after x
    raises_invalid(lambda: a2a.fast_encode(both[:T], routing, out=both[1:]), "output rows overlaps input x")
    # Apart, the same call works.
    got = a2a.fast_encode(both[:T], routing, out=buffer(framework, T, "apart"))
    assert tuple(got.shape) == (E, C, M)


def test_decode_into_its_own_input(framework, indices):
    routing = routing_of(indices, framework)
    dispatched = buffer(framework, E * C).reshape(E, C, M)
    raises_invalid(
        lambda: a2a.fast_decode(dispatched, routing, out=dispatched),
        "combine",
        "output y overlaps input rows",
    )
    both = buffer(framework, E * C + 1)
    raises_invalid(
        lambda: a2a.fast_decode(both[1:].reshape(E, C, M), routing, out=both[: E * C]),
        "output y overlaps input rows",
    )


def test_permute_and_unpermute_into_their_own_input(framework, indices):
    x = buffer(framework, T)
    given = ref.to_framework(indices, "int64", framework)
    raises_invalid(lambda: a2a.permute(x, given, E, out=x), "dispatch", "output rows overlaps input x")
    x_sorted, perm = a2a.permute(x, given, E)
    assert perm.num_rows == T
    raises_invalid(
        lambda: a2a.unpermute(x_sorted, perm, out=x_sorted), "combine", "output y overlaps input rows"
    )
    both = buffer(framework, T + 1)
    raises_invalid(lambda: a2a.permute(both[1:], given, E, out=both[:T]), "output rows overlaps input x")
    raises_invalid(lambda: a2a.unpermute(both[:T], perm, out=both[1:]), "output y overlaps input rows")


def test_encode_into_its_gates(indices):
    # A flat float32 buffer whose last element of out is the first gate.
    routing = routing_of(indices, "numpy")
    x = buffer("numpy", T)
    flat = np.ones(E * C * M + T * K - 1, np.float32)
    out, gates = flat[: E * C * M], flat[E * C * M - 1 :].reshape(T, K)
    raises_invalid(lambda: a2a.fast_encode(x, routing, gates, out=out), "output rows overlaps input gates")


def test_encode_into_the_routing(indices):
    # Python hands out the routing's arrays read-only, so out= over them is
    # refused before the core; the core entry point refuses it too, for C
    # callers: out= over the routing's locations (int64 bits, the byte count of
    # a float64 (T, 1) array).
    routing = routing_of(indices, "numpy")
    x = np.ones((T, 1), np.float64)
    raises_invalid(lambda: a2a.fast_encode(x, routing, out=routing.locations.view(np.float64)), "read-only")
    fields = native_routing(routing)
    locations_address = fields[5]
    float64 = 1  # A2A_FLOAT64
    raises_invalid(
        lambda: _C.moe_dispatch((0, 0, 0), fields, x.ctypes.data, float64, 1, 0, 0, locations_address),
        "output rows overlaps input routing.locations",
    )


def test_gate_gradient_entry_point_refuses_its_inputs(indices):
    # The backward's gate gradient (a2a.torch calls it with fresh outputs): the
    # core entry point itself refuses grad_gates over tokens or rows.
    routing = routing_of(indices, "numpy")
    tokens, rows = buffer("numpy", T), buffer("numpy", E * C, "rows")
    cpu = (0, 0, 0)
    float32 = 0  # A2A_FLOAT32
    for name, target in (("tokens", tokens), ("rows", rows)):
        raises_invalid(
            lambda target=target: _C.moe_gate_grad(
                cpu,
                native_routing(routing),
                tokens.ctypes.data,
                rows.ctypes.data,
                float32,
                M,
                float32,
                target.ctypes.data,
            ),
            "gate_grad",
            f"output grad_gates overlaps input {name}",
        )
