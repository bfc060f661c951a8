"""An a2a.Routing that comes back from pickle is checked before any kernel
reads it (a2a/_routing_state.py): every layout round-trips, and tables that
would send a kernel out of bounds, or two choices into one row, raise
InvalidArgumentError naming the entry at fault."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest

import a2a

torch = pytest.importorskip("torch")

T, K, E = 9, 2, 3


def choices(seed=0):
    rng = np.random.default_rng(seed)
    return np.stack([rng.permutation(E)[:K] for _ in range(T)]).astype(np.int64)


def routings():
    indices = choices()
    return {
        "capacity": a2a.route(indices, E, capacity=4),
        "per-expert": a2a.route(indices, E, capacity=[2, 0, 7]),
        "dropless": a2a.permute(np.ones((T, 4)), indices, E)[1],
        "dropless wait=False": a2a.permute(np.ones((T, 4)), indices, E, wait=False)[1],
        "torch int32": a2a.route(torch.from_numpy(indices).int(), E, capacity=5),
        "fixed": a2a.route(torch.from_numpy(indices), E, capacity=3, wait=False),
    }


@pytest.mark.parametrize("name", list(routings()))
def test_every_layout_round_trips(name):
    routing = routings()[name]
    again = pickle.loads(pickle.dumps(routing))
    for table in ("locations", "counts", "offsets"):
        assert np.array_equal(np.asarray(getattr(again, table)), np.asarray(getattr(routing, table)))
    assert again.num_rows == routing.num_rows and again.num_dropped == routing.num_dropped
    assert copy.deepcopy(routing).num_rows == routing.num_rows


def unpickled(state):
    routing = object.__new__(a2a.Routing)
    routing.__setstate__(state)
    return routing


def tampered(routing, change):
    state = routing.__getstate__()
    locations, counts, offsets = (np.array(t) for t in state["tables"])
    tables = {"locations": locations, "counts": counts, "offsets": offsets}
    sizes = list(state["sizes"])
    change(tables, sizes, state)
    state["tables"] = (tables["locations"], tables["counts"], tables["offsets"])
    state["sizes"] = tuple(sizes)
    return state


def set_entry(name, index, value):
    def change(tables, sizes, state):
        tables[name][index] = value
    return change


CASES = {
    "offsets moved": (set_entry("offsets", 1, 5), r"offsets\[1\] = 5; the layout has 4 \(e \* capacity"),
    "more counted than fit": (set_entry("counts", 0, 5), r"counts\[0\] = 5; expert 0 has 4 rows"),
    "a negative count": (set_entry("counts", 2, -1), r"counts\[2\] = -1"),
    "num_rows": (lambda t, s, st: s.__setitem__(1, 13), r"num_rows is 13; the layout has 12"),
    "int32 locations": (lambda t, s, st: t.__setitem__("locations", t["locations"].astype(np.int32)),
                        r"locations must be a C-contiguous \(9, 2\) int64 array"),
    "host counts": (lambda t, s, st: st.__setitem__("host_counts", np.zeros(E, np.int64)),
                    r"host_counts \[0, 0, 0\] are not the counts"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_tables_no_route_could_make_are_refused(case):
    change, message = CASES[case]
    with pytest.raises(a2a.InvalidArgumentError, match=r"a2a.Routing \(unpickled\): " + message):
        unpickled(tampered(a2a.route(choices(), E, capacity=4), change))


def test_two_choices_in_one_row_and_an_index_past_the_experts_are_refused():
    routing = a2a.route(choices(), E, capacity=4)
    indices = choices()
    t0, t1 = [t for t in range(T) if indices[t, 0] == indices[0, 0]][:2]
    state = tampered(routing, lambda tables, sizes, state: tables["locations"].__setitem__((t1, 0),
                                                                                         tables["locations"][t0, 0]))
    with pytest.raises(a2a.InvalidArgumentError, match=rf"choices \({t0}, 0\) and \({t1}, 0\) both occupy row"):
        unpickled(state)
    state = routing.__getstate__()
    bad = indices.copy()
    bad[2, 1] = E + 4
    state["indices"] = bad
    with pytest.raises(a2a.InvalidArgumentError, match=r"indices\[2, 1\] = 7 is no expert of 3, yet locations\[2, 1\]"):
        unpickled(state)
