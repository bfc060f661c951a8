"""The one way to say what runs (moe_runtime.registry), on one rank:
MoELayer(flow=NAME or settings, flows=(...)); the keywords of earlier
releases (dispatcher=, parallel=, flex=, expert_cache=, assignment_cache=,
dynamic_capacity=, hidden_split=, shared_cache=) build the same flow with a
DeprecationWarning naming the flow= that replaces them, and refuse what
they refused; the errors of flow= and flows=.

The suite turns that DeprecationWarning into an error (pyproject.toml's
filterwarnings), so the tests here that use the old keywords on purpose
catch it with pytest.warns."""

from __future__ import annotations

import dataclasses
import importlib
import sys
import warnings

import pytest

torch = pytest.importorskip("torch")

import moe_runtime
from moe_runtime import (
    AssignmentCache,
    DataCentric,
    Dropless,
    DynamicCapacity,
    ExpertCache,
    FlexConfig,
    ModelCentric,
    PipelineSharedCache,
)
from moe_runtime._moved import MOVED, PACKAGES
from moe_runtime.registry import FLOWS, SETTINGS

M, H = 6, 8
CACHES = (ExpertCache, AssignmentCache, PipelineSharedCache)


def build(comm, gate=None, **options):
    experts = {"type": "ffn", "num_experts_per_device": 2, "hidden_size_per_expert": H}
    return moe_runtime.MoELayer(gate or {"type": "top", "k": 2}, M, experts, comm=comm, seeds=(1, 2),
                                **options).double()


def dictionary_layer(comm, **options):
    """An expert layer whose dictionary may choose other flows (capacity factor 0: nothing drops)."""
    options.setdefault("parallel_type", "adaptive:auto")
    return build(comm, {"type": "top", "k": 2, "capacity_factor": 0.0}, **options)


def tokens() -> torch.Tensor:
    return torch.randn(7, M, dtype=torch.float64, generator=torch.Generator().manual_seed(3))


def new_spelling(comm, **options):
    """A layer built without any DeprecationWarning."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        return build(comm, **options)


def assert_same_settings(got, want):
    """Equal settings; a cache (one per layer, or the layer's own) counts by its type."""
    if not dataclasses.is_dataclass(want):
        assert got == want
        return
    assert type(got) is type(want)
    for field in dataclasses.fields(want):
        a, b = getattr(got, field.name), getattr(want, field.name)
        if isinstance(b, CACHES):
            assert type(a) is type(b), field.name
        else:
            assert a == b, field.name


# (deprecated keywords, the flow= that replaces them), built afresh for each layer (a cache serves one layer).
DEPRECATED = {
    "dispatcher=capacity": lambda: ({"dispatcher": "capacity"}, "expert"),
    "parallel=expert": lambda: ({"parallel": "expert"}, "expert"),
    "dispatcher=dropless": lambda: ({"dispatcher": "dropless"}, "dropless"),
    "expert_cache": lambda: ({"dispatcher": "dropless", "expert_cache": ExpertCache(1)},
                             Dropless(expert_cache=ExpertCache(1))),
    "assignment_cache": lambda: ({"dispatcher": "dropless", "assignment_cache": AssignmentCache()},
                                 Dropless(assignment_cache=AssignmentCache())),
    "dispatcher=dynamic": lambda: ({"dispatcher": "dynamic"}, "dynamic"),
    "dynamic_capacity": lambda: ({"dispatcher": "dynamic", "dynamic_capacity": DynamicCapacity(margin=1.5)},
                                 DynamicCapacity(margin=1.5)),
    "flex": lambda: ({"dispatcher": "dropless", "flex": FlexConfig(slots_per_rank=3)}, FlexConfig(slots_per_rank=3)),
    "parallel=data_centric": lambda: ({"parallel": "data_centric"}, DataCentric()),
    "data_centric-settings": lambda: ({"parallel": "data_centric", "hidden_split": [H],
                                       "shared_cache": PipelineSharedCache()},
                                      DataCentric(hidden_split=[H], shared_cache=PipelineSharedCache())),
    "parallel=model_centric": lambda: ({"parallel": "model_centric"}, ModelCentric()),
    "model_centric-settings": lambda: ({"parallel": "model_centric", "hidden_split": [H]},
                                       ModelCentric(hidden_split=[H])),
}


@pytest.mark.parametrize("case", DEPRECATED)
def test_a_deprecated_keyword_builds_the_flow_of_its_new_spelling_and_warns(comm, case):
    deprecated, flow = DEPRECATED[case]()
    with pytest.warns(DeprecationWarning) as records:
        old = build(comm, **deprecated)
    new = new_spelling(comm, flow=flow)
    name = flow if isinstance(flow, str) else new.flow.name

    assert len(records) == 1
    message, record = str(records[0].message), records[0]
    assert message.startswith(f"MoELayer({', '.join(f'{key}=' for key in sorted(deprecated))}) is deprecated")
    assert "say what runs with flow=" in message
    wanted = "'expert'" if name == "expert" else f"{type(new.flow.settings).__name__}("
    assert f"flow={wanted}" in message, message
    assert record.filename == __file__  # attributed to the caller (what a warnings filter sees)

    assert old.flow.name == new.flow.name == name
    assert type(old.flow) is type(new.flow) is FLOWS[name]
    assert_same_settings(old.flow.settings, new.flow.settings)
    assert old.parallel == new.parallel == (name if name in ("data_centric", "model_centric") else "expert")
    x = tokens()
    y_old, y_new = old(x), new(x)
    assert old.last_plan.flow == new.last_plan.flow == name
    assert torch.equal(y_old, y_new)  # the same seeds, the same flow: the same function


def test_a_deprecated_shared_cache_moves_into_the_dictionarys_data_centric_flow(comm):
    cache = PipelineSharedCache()
    with pytest.warns(DeprecationWarning, match=r"MoELayer\(shared_cache=\) is deprecated: give "
                                                r"flows=\(\.\.\., DataCentric\(shared_cache=\.\.\.\)\)") as records:
        old = dictionary_layer(comm, flows=("dropless", "data_centric"), shared_cache=cache)
    assert len(records) == 1 and records[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        new = dictionary_layer(comm, flows=("dropless", DataCentric(shared_cache=cache)))
    assert old.flows == new.flows == ("dropless", "data_centric")
    assert old.shared_cache is new.shared_cache is cache
    assert old.flow.name == new.flow.name == "expert"
    x = tokens()
    assert torch.equal(old(x, flow="data_centric"), new(x, flow="data_centric"))
    assert old.last_plan.flow == new.last_plan.flow == "data_centric"


# The refusals of the deprecated keywords (raised before any warning), as in earlier releases.
REFUSED = [
    ({"dispatcher": "sorted"}, ValueError, "dispatcher must be one of"),
    ({"parallel": "tensor"}, ValueError, "parallel must be one of"),
    ({"expert_cache": ExpertCache(1)}, ValueError, "expert_cache needs dispatcher='dropless'"),
    ({"dispatcher": "dynamic", "expert_cache": ExpertCache(1)}, ValueError, "expert_cache needs dispatcher='dropless'"),
    ({"dispatcher": "dropless", "expert_cache": 2}, TypeError, "expert_cache must be a moe_runtime.ExpertCache"),
    ({"assignment_cache": AssignmentCache()}, ValueError, "assignment_cache needs dispatcher='dropless'"),
    ({"flex": FlexConfig()}, ValueError, "flex= needs dispatcher='dropless'"),
    ({"dispatcher": "dropless", "flex": {"slots_per_rank": 2}}, TypeError, "flex must be a moe_runtime.FlexConfig"),
    ({"dispatcher": "dropless", "flex": FlexConfig(), "expert_cache": ExpertCache(1)}, ValueError,
     "flex= does not combine"),
    ({"dispatcher": "dynamic", "dynamic_capacity": {"margin": 2}}, TypeError, "must be a moe_runtime.DynamicCapacity"),
    ({"dispatcher": "dropless", "dynamic_capacity": DynamicCapacity()}, ValueError,
     "dynamic_capacity= is the setting of dispatcher='dynamic'"),
    ({"hidden_split": [H]}, ValueError, "hidden_split= is the setting"),
    ({"shared_cache": PipelineSharedCache()}, ValueError, "shared_cache= is the setting of the data-centric flow"),
    ({"parallel": "model_centric", "shared_cache": PipelineSharedCache()}, ValueError,
     "shared_cache= is the setting of the data-centric flow"),
    ({"parallel": "data_centric", "shared_cache": {}}, TypeError, "shared_cache must be"),
    ({"parallel": "model_centric", "shared_cache": {}}, TypeError, "shared_cache must be"),
    ({"parallel": "data_centric", "dispatcher": "dropless"}, ValueError, "dispatcher"),
    ({"parallel": "model_centric", "dispatcher": "dropless"}, ValueError, "dispatcher"),
    ({"parallel": "data_centric", "flex": FlexConfig()}, ValueError, r"takes none of \['flex'\]"),
    ({"parallel": "data_centric", "expert_cache": ExpertCache(1)}, ValueError, r"takes none of \['expert_cache'\]"),
    ({"flow": "dropless", "expert_cache": ExpertCache(1)}, ValueError,
     r"give flow= or the deprecated \['expert_cache'\], not both"),
    ({"flow": Dropless(), "dispatcher": "dropless"}, ValueError, "give flow= or the deprecated"),
    ({"flow": "data_centric", "parallel": "data_centric", "hidden_split": [H]}, ValueError,
     r"the deprecated \['hidden_split', 'parallel'\], not both"),
    ({"dispatch": "dropless"}, TypeError, r"unexpected keyword argument\(s\) \['dispatch'\]"),
]


@pytest.mark.parametrize("options, error, match", REFUSED, ids=[str(sorted(case[0])) for case in REFUSED])
def test_the_deprecated_keywords_refuse_what_they_refused(comm, options, error, match):
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # refused before any warning
        with pytest.raises(error, match=match):
            build(comm, **options)


@pytest.mark.parametrize("options, match", [
    ({"flows": ("dropless",), "shared_cache": PipelineSharedCache()}, "shared_cache= is the setting"),
])
def test_a_deprecated_keyword_beside_flows_refuses_what_it_refused(comm, options, match):
    with pytest.raises(ValueError, match=match):
        dictionary_layer(comm, **options)


@pytest.mark.parametrize("options, match", [
    ({"flows": ("data_centric",), "dispatcher": "dropless"}, "flow='expert'"),
    ({"flows": ("dropless",), "parallel": "data_centric", "parallel_type": "adaptive:1"}, "'flows'"),
])
def test_a_deprecated_flow_beside_flows_warns_then_is_refused(comm, options, match):
    with pytest.warns(DeprecationWarning, match="say what runs with flow="), pytest.raises(ValueError, match=match):
        dictionary_layer(comm, **options)


@pytest.mark.parametrize("flow, error, match", [
    ("tensor", ValueError, (r"flow must be one of \('expert', 'dropless', 'dynamic', 'flex', 'data_centric', "
                            r"'model_centric'\) or a settings object \(Dropless, DynamicCapacity, FlexConfig, "
                            r"DataCentric, ModelCentric\), got 'tensor'")),
    ("capacity", ValueError, "flow must be one of"),
    ("Dropless", ValueError, "flow must be one of"),
    ({"margin": 2}, TypeError, (r"flow must be a name of .* or one of \['Dropless', 'DynamicCapacity', "
                                r"'FlexConfig', 'DataCentric', 'ModelCentric'\], got dict")),
    (ExpertCache(1), TypeError, "got ExpertCache"),
    (PipelineSharedCache(), TypeError, "got PipelineSharedCache"),
    (Dropless, TypeError, "got type"),  # the class, not settings
])
def test_flow_refuses_an_unknown_name_or_a_wrong_settings_type(comm, flow, error, match):
    with pytest.raises(error, match=match):
        build(comm, flow=flow)


@pytest.mark.parametrize("flow", ["expert", "dropless", "dynamic", "flex", "data_centric", "model_centric",
                                  Dropless(), DynamicCapacity(), FlexConfig(), DataCentric(), ModelCentric()],
                         ids=lambda flow: flow if isinstance(flow, str) else type(flow).__name__)
def test_every_flow_by_name_or_settings_runs_and_says_so(comm, flow):
    layer = new_spelling(comm, flow=flow)
    name = flow if isinstance(flow, str) else SETTINGS[type(flow)]
    assert layer.flow.name == name and type(layer.flow) is FLOWS[name]
    if not isinstance(flow, str):
        assert layer.flow.settings is flow
    elif name != "expert":
        assert_same_settings(layer.flow.settings, {value: kind for kind, value in SETTINGS.items()}[name]())
    layer(tokens())
    assert layer.last_plan.flow == name


def test_flows_take_names_and_settings_objects(comm):
    cache = PipelineSharedCache()
    layer = dictionary_layer(comm, flows=(ModelCentric(), "dropless", DataCentric(shared_cache=cache)))
    assert layer.flows == ("dropless", "data_centric", "model_centric")  # the dictionary's order
    assert layer.shared_cache is cache
    x = tokens()
    want = layer(x, flow="expert")
    for name in layer.flows:
        assert torch.allclose(layer(x, flow=name), want, atol=1e-12, rtol=0), name
        assert layer.last_plan.flow == name
    assert cache.gathers >= 1
    with_names = dictionary_layer(comm, flows=("dropless", "data_centric", "model_centric"))
    assert with_names.flows == layer.flows


@pytest.mark.parametrize("flows, error, match", [
    ("dropless", TypeError, "flows must be a list or tuple"),
    (("dropless", "dropless"), ValueError, "duplicates"),
    (("dropless", Dropless()), ValueError, "duplicates"),
    (("ring",), ValueError, "unknown flow 'ring'"),
    ((FlexConfig(),), ValueError, r"unknown flow FlexConfig\("),
    ((DynamicCapacity(),), ValueError, r"unknown flow DynamicCapacity\("),
    (("expert",), ValueError, "unknown flow 'expert'"),
])
def test_flows_refuse_what_the_dictionary_cannot_choose(comm, flows, error, match):
    with pytest.raises(error, match=match):
        dictionary_layer(comm, flows=flows)


def test_flows_need_the_expert_flow(comm):
    with pytest.raises(ValueError, match="they need flow='expert', not flow='dropless'"):
        dictionary_layer(comm, flow="dropless", flows=("data_centric",))


def test_the_suite_makes_a_deprecated_keyword_an_error_and_only_that(comm):
    """pyproject.toml's filterwarnings: a MoELayer deprecation fails the test
    that makes it (so no new use creeps in); another library's does not."""
    with pytest.raises(DeprecationWarning, match="is deprecated: say what runs with flow='expert'"):
        build(comm, dispatcher="capacity")
    with pytest.raises(DeprecationWarning, match=r"MoELayer\(shared_cache=\) is deprecated"):
        dictionary_layer(comm, flows=("data_centric",), shared_cache=PipelineSharedCache())
    with warnings.catch_warnings(record=True) as caught:  # keeps the suite's filters, records what they let through
        warnings.warn_explicit("numpy.foo is deprecated", DeprecationWarning, "numpy/foo.py", 1, module="numpy.foo")
        warnings.warn_explicit("torch.bar is deprecated", DeprecationWarning, "torch/bar.py", 1, module="torch.bar")
    assert [str(w.message) for w in caught] == ["numpy.foo is deprecated", "torch.bar is deprecated"]


def test_flow_none_is_the_expert_flow(comm):
    layer = new_spelling(comm, flow=None)
    assert layer.flow.name == "expert"


@pytest.mark.parametrize("old", sorted(set(MOVED) - set(PACKAGES)))
def test_a_module_path_of_earlier_releases_imports_its_new_home_and_warns(old):
    sys.modules.pop(f"moe_runtime.{old}", None)
    with pytest.warns(DeprecationWarning, match=f"moe_runtime.{old} moved to moe_runtime.{MOVED[old]}"):
        module = importlib.import_module(f"moe_runtime.{old}")
    assert module is importlib.import_module(f"moe_runtime.{MOVED[old]}")
