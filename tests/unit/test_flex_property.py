"""Property tests on one rank: random shapes, axes and dtypes against the
NumPy reference, through every code path (linear with and without MPI
datatypes, 2DH, a small A2A_MPI_MAX_COUNT)."""

from __future__ import annotations

import numpy as np
import pytest
import reference as ref
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import a2a

SETTINGS = settings(max_examples=80, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def comms():
    from mpi4py import MPI

    made = {
        "datatypes": a2a.Comm.from_mpi(MPI.COMM_SELF, use_mpi_datatypes=True),
        "copies": a2a.Comm.from_mpi(MPI.COMM_SELF, use_mpi_datatypes=False),
    }
    with pytest.MonkeyPatch.context() as mp:
        # Every message above 7 bytes goes as a derived datatype (BigMPI path).
        mp.setenv("A2A_MPI_MAX_COUNT", "7")
        made["max_count_7"] = a2a.Comm.from_mpi(MPI.COMM_SELF)
        made["max_count_7_copies"] = a2a.Comm.from_mpi(MPI.COMM_SELF, use_mpi_datatypes=False)
    return made


@st.composite
def flex_args(draw):
    ndim = draw(st.integers(1, 5))
    shape = tuple(draw(st.lists(st.integers(0, 5), min_size=ndim, max_size=ndim)))
    split = draw(st.integers(-ndim, ndim - 1))
    concat = draw(st.integers(-ndim, ndim - 1))
    dtype = draw(st.sampled_from(ref.NUMPY_DTYPES))
    algo = draw(st.sampled_from(sorted(a2a.ALGORITHMS)))
    return shape, split, concat, dtype, algo


@SETTINGS
@given(flex_args(), st.integers(0, 2**16))
def test_flex_matches_reference(comms, args, seed):
    shape, split, concat, dtype, algo = args
    x = ref.block(f"prop{seed}", 0, 0, shape, dtype)
    expected = ref.ref_all_to_all_flex([x], split % len(shape), concat % len(shape))[0]
    outputs = {}
    for name, comm in comms.items():
        y = a2a.all_to_all_flex(x, comm=comm, split_axis=split, concat_axis=concat, algo=algo)
        ref.assert_bitwise_equal(y, expected, f"{name} comm")
        outputs[name] = y
    for name, y in outputs.items():
        ref.assert_bitwise_equal(y, outputs["datatypes"], f"{name} vs datatypes")


@SETTINGS
@given(
    st.lists(st.integers(0, 6), min_size=0, max_size=3),
    st.integers(0, 9),
    st.sampled_from(ref.NUMPY_DTYPES),
    st.sampled_from(sorted(a2a.ALGORITHMS)),
)
def test_all_to_all_and_v_match_reference(comms, row_shape, rows, dtype, algo):
    x = ref.block("prop-a2a", rows, len(row_shape), (rows, *row_shape), dtype)
    for name, comm in comms.items():
        ref.assert_bitwise_equal(a2a.all_to_all(x, comm=comm, algo=algo), x, f"all_to_all, {name}")
        y, counts = a2a.all_to_all_v(x, [rows], comm=comm, algo=algo)
        ref.assert_bitwise_equal(y, x, f"all_to_all_v, {name}")
        assert counts.tolist() == [rows]


def test_out_parameter_is_filled_completely(comms):
    x = ref.block("fill", 0, 0, (3, 5, 2), "int32")
    for comm in comms.values():
        out = np.full((3, 5, 2), -7, dtype=np.int32)
        a2a.all_to_all_flex(x, comm=comm, split_axis=1, concat_axis=2, out=out)
        ref.assert_bitwise_equal(out, x)
