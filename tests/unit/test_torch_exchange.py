"""all_to_all and all_to_all_flex on torch tensors take a path without views
(a2a/_torch_exchange.py) when every check passes, and the general path
otherwise, which reports what is wrong as before. One rank: the exchange
is a copy (flex a reshape); tests/mpi checks the exchanges across ranks."""

from __future__ import annotations

import numpy as np
import pytest
from checks import raises_invalid

import a2a
from a2a import _collectives

torch = pytest.importorskip("torch")

CALLS = {
    "all_to_all": lambda x, comm, **kw: a2a.all_to_all(x, comm=comm, **kw),
    "flex-0-1": lambda x, comm, **kw: a2a.all_to_all_flex(x, comm=comm, split_axis=0, concat_axis=1, **kw),
    "flex-negative-2dh": lambda x, comm, **kw: a2a.all_to_all_flex(x, comm=comm, split_axis=-1, concat_axis=-2,
                                                                   algo="2dh", **kw),
}


@pytest.fixture
def no_general_path(monkeypatch):
    def refused(*args, **kwargs):
        raise AssertionError("the general path ran")

    monkeypatch.setattr(_collectives, "_prepare", refused)


@pytest.mark.parametrize("name", CALLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.uint8])
def test_valid_tensors_take_the_path_without_views(comm, no_general_path, name, dtype):
    call = CALLS[name]
    x = (torch.arange(5 * 3 * 4) % 251).reshape(5, 3, 4).to(dtype)
    want = x.clone()
    got = call(x, comm)
    assert type(got) is torch.Tensor and got.dtype == dtype and torch.equal(got, want) and got.data_ptr() != x.data_ptr()
    out = torch.empty_like(x)
    assert call(x, comm, out=out) is out and torch.equal(out, want)


@pytest.mark.parametrize("name", CALLS)
def test_the_same_bits_as_numpy(comm, name):
    call = CALLS[name]
    x = np.random.default_rng(1).standard_normal((4, 3, 2)).astype(np.float32)
    assert np.array_equal(call(torch.from_numpy(x), comm).numpy(), call(x, comm))


@pytest.mark.parametrize("bad,match", [
    (lambda x: {"x": x.transpose(0, 1)}, "not C-contiguous"),
    (lambda x: {"x": x.to(torch.complex64).conj()}, "conjugate bit"),
    (lambda x: {"x": x, "out": torch.empty(2, 3, 4)}, "out has shape"),
    (lambda x: {"x": x, "out": torch.empty(5, 3, 4, dtype=torch.float64)}, "out has shape .* and dtype float64"),
    (lambda x: {"x": x, "out": torch.empty(5, 4, 3).transpose(1, 2)}, "not C-contiguous"),
    (lambda x: {"x": x, "out": np.empty((5, 3, 4), np.float32)}, "out is a numpy array but the input is a torch"),
    (lambda x: {"x": x, "algo": "ring"}, "unknown algo 'ring'"),
], ids=["transposed", "conjugate", "out shape", "out dtype", "out transposed", "out numpy", "algo"])
def test_what_the_general_path_reports_is_unchanged(comm, bad, match):
    for call in (a2a.all_to_all, lambda x, **kw: a2a.all_to_all_flex(x, split_axis=0, concat_axis=1, **kw)):
        arguments = bad(torch.randn(5, 3, 4))
        with pytest.raises(a2a.InvalidArgumentError, match=match):
            call(arguments.pop("x"), comm=comm, **arguments)


def test_an_axis_out_of_range_is_reported_by_the_general_path(comm):
    raises_invalid(lambda: a2a.all_to_all_flex(torch.randn(5, 3, 4), comm=comm, split_axis=3, concat_axis=0),
                   "split_axis=3 is out of range")


def test_the_fast_path_counts_its_allocations(comm, no_general_path):
    x = torch.randn(6, 2)
    with a2a.counting() as counted:
        a2a.all_to_all(x, comm=comm)
        a2a.all_to_all(x, comm=comm, out=torch.empty_like(x))
    assert counted.counters.allocations == 1
