"""The ``dynamic`` rows of ``python -m moe_runtime.bench`` (--dynamic-steps):
per-expert dynamic capacity (``MoELayer(flow="dynamic")``, DynaMoE
Section 4.1) against the static capacity factor that drops nothing on the
same steps and against ``flow="dropless"``.

A skewed synthetic routing: at step s, half of every rank's tokens lean
towards one hot expert (the gate row of expert s // 2 mod E, scaled by
``SKEW``), so one expert gets several times its share, and which one moves
every two steps. Before timing, the steps' inputs are routed by the gate
alone to find the static factor: the smallest f whose capacity (Tutel's
rule, k * floor(f * ceil(T / E))) holds the busiest expert of any step on
any rank: the no-drop static factor of the paper (its alpha = 7.0). The three
layers have the same weights; each step is a forward and backward, the three
take turns step by step (all see the same inputs in the same order), and the
dynamic layer's policy starts cold.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

import numpy as np

from a2a.bench import common

from ..common.host_values import all_reduce_values

__all__ = ["dynamic_header_lines", "dynamic_rows", "format_dynamic"]

SKEW = 4.0  # how far a hot token leans towards its expert's gate row (in units of the row's norm)


def _step_inputs(bench: Any, layer: Any, steps: int) -> list[Any]:
    """The tokens of every step on this rank (see the module docstring)."""
    torch, args = bench.torch, bench.args
    row = layer.gates[0].wg.weight.detach().float()
    inputs = []
    for step in range(steps):
        generator = torch.Generator(device=bench.device).manual_seed(104729 * step + bench.comm.rank)
        x = torch.randn(args.tokens, args.model_dim, generator=generator, device=bench.device)
        hot = row[(step // 2) % layer.num_global_experts]
        x[: args.tokens // 2] += SKEW * hot / hot.norm().clamp(min=1e-12) * math.sqrt(args.model_dim) / 4
        inputs.append(x.to(bench.dtype).requires_grad_(True))
    return inputs


def _no_drop_factor(bench: Any, layer: Any, inputs: list[Any]) -> float:
    """The smallest Tutel-rule factor whose capacity drops nothing on any step of any rank."""
    torch, args = bench.torch, bench.args
    busiest = 0
    with torch.no_grad():
        for x in inputs:
            indices = torch.topk(layer.gates[0](x), args.top_k, dim=1).indices
            busiest = max(busiest, int(torch.bincount(indices.reshape(-1), minlength=args.experts).max()))
    busiest = int(all_reduce_values(np.array([busiest]), bench.comm, op="max")[0])
    share = -(-args.tokens // args.experts)  # ceil(T / E)
    # k * floor(f * share) >= busiest: f * share just above ceil(busiest / k).
    return (-(-busiest // args.top_k) + 0.5) / share


def dynamic_rows(bench: Any, steps: int) -> list[dict]:
    """The static no-drop factor, dropless and dynamic rows (empty when the
    layer shares experts or steps is 0): median step time, the time over the
    static one, the choices dropped (all ranks, all steps), the mean rows per
    expert of the dispatched buffer (per rank: C, or the mean of the C_e) and
    the dynamic layer's capacity changes."""
    if bench.layer.experts.sharers > 1 or steps < 1:
        return []
    layer = bench.new_layer
    layers = {"static": layer(), "dropless": layer(flow="dropless"), "dynamic": layer(flow="dynamic")}
    inputs = _step_inputs(bench, layers["static"], steps)
    factor = _no_drop_factor(bench, layers["static"], inputs)
    stats = {name: {"dropped": 0, "rows": []} for name in layers}

    def timing(name: str) -> Any:
        options = {"capacity_factor": factor, "adaptive_r": 1, "a2a_ffn_overlap_degree": 1} if name == "static" else {}
        position = iter(range(steps))

        def run() -> float:
            x = inputs[next(position)]
            seconds = bench.timed(bench.layer_step(layers[name], x, algo="linear", **options))
            plan = layers[name].last_plan
            stats[name]["dropped"] += plan.dropped
            if name != "dropless":  # dropless has no capacity: every routed row and no padding
                rows = sum(plan.capacities) if plan.capacities else plan.buffer_capacity * bench.args.experts
                stats[name]["rows"].append(rows / bench.args.experts)
            return seconds

        return run

    names = list(layers)
    samples = common.take_turns([timing(name) for name in names], steps)
    dropped = all_reduce_values(np.array([float(stats[n]["dropped"]) for n in names]), bench.comm)
    static_ms = statistics.median(samples[0]) * 1e3
    rows = []
    for index, name in enumerate(names):
        time_ms = statistics.median(samples[index]) * 1e3
        rows.append({"dispatcher": name, "factor": factor if name == "static" else None, "steps": steps,
                     "tokens": bench.args.tokens, "time_ms": time_ms, "vs_static": time_ms / static_ms,
                     "dropped": int(dropped[index]), "rows_per_expert": statistics.mean(stats[name]["rows"]) if stats[name]["rows"] else None,
                     "changes": layers[name].capacity_tracker.changes if name == "dynamic" else None,
                     "samples_ms": [t * 1e3 for t in samples[index]]})
    return rows


_DYNAMIC = "{:>11}  {:>6}  {:>7}  {:>6}  {:>10}  {:>10}  {:>8}  {:>12}  {:>8}"


def dynamic_header_lines() -> list[str]:
    return ["#" + _DYNAMIC.format("dispatcher", "factor", "tokens", "steps", "time(ms)", "vs static", "dropped",
                                  "rows/expert", "changes")[1:]]


def format_dynamic(row: dict) -> str:
    return _DYNAMIC.format(row["dispatcher"], "-" if row["factor"] is None else f"{row['factor']:.3g}",
                           row["tokens"], row["steps"], f"{row['time_ms']:.2f}", f"{row['vs_static']:.2f}x",
                           row["dropped"], "-" if row["rows_per_expert"] is None else f"{row['rows_per_expert']:.1f}",
                           "-" if row["changes"] is None else row["changes"])
