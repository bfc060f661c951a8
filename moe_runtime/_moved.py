"""The module paths of earlier releases, for one release: ``import
moe_runtime.tuner`` still works, gives the module's new home
(moe_runtime.tuning.dictionary) and warns a DeprecationWarning naming it.
Installed as a finder by moe_runtime/__init__.py; nothing else uses it."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

__all__ = ["MOVED", "PACKAGES", "install"]

MOVED = {
    "host_values": "common.host_values", "buffers": "common.buffers", "pipeline": "common.overlap",
    "initialization": "common.initialization", "gates": "gating.gates", "losses": "gating.losses",
    "capacity": "gating.capacity", "experts": "experts.ffn", "activation": "experts.activation",
    "ragged_ffn": "experts.ragged_ffn", "relocation": "experts.relocation", "flows": "flows.expert",
    "tuner": "tuning.dictionary", "prior": "tuning.prior", "dictionary_flows": "registry",
    "dropless": "deployment.dropless", "expert_cache": "deployment.expert_cache",
    "cache_policy": "deployment.cache_policy", "placement": "deployment.placement",
    "assignment_cache": "deployment.assignment_cache", "cached_dispatch": "deployment.cached_dispatch",
    "dynamic_capacity": "dynamic.capacity", "ragged": "dynamic.ragged", "flex_config": "flex.config",
    "flex_cost": "flex.cost", "flex_dispatch": "flex.dispatch", "flex_routing": "flex.routing",
    "flex_scheduler": "flex.scheduler", "vexperts": "flex.vexperts", "hexa": "hexa.centric",
    "hexa_cache": "hexa.cache", "hexa_experts": "hexa.experts", "hetero_split": "hexa.split",
    "step_memory": "bench.step_memory", "bench_assignment": "bench.assignment", "bench_cache": "bench.cache",
    "bench_dynamic": "bench.dynamic", "bench_flex": "bench.flex", "bench_flows": "bench.flows",
    "bench_hetero": "bench.hetero", "bench_peer": "bench.peer", "bench_placement": "bench.placement",
    "bench_rank": "bench.rank",
}
# Old module names that are packages now: their paths import the packages, not the old modules.
PACKAGES = ("experts", "flex", "flows", "hexa")


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        package, _, name = fullname.partition(".")
        if package != "moe_runtime" or name not in MOVED or name in PACKAGES:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        new = f"moe_runtime.{MOVED[spec.name.partition('.')[2]]}"
        warnings.warn(f"{spec.name} moved to {new} (issue 23); the old path goes in the next release",
                      DeprecationWarning, stacklevel=2)
        return importlib.import_module(new)

    def exec_module(self, module):
        pass


def install() -> None:
    if not any(isinstance(finder, _MovedFinder) for finder in sys.meta_path):
        sys.meta_path.append(_MovedFinder())
