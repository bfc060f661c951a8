"""The layer mode's summaries of a case and the issue's targets, from the
rows it measured (pure: no torch, no communicator)."""

from __future__ import annotations

import argparse
import math
import statistics
from typing import Any

from .layer_options import ISSUE_SIZE, Case

__all__ = ["TUNING_STEP_LIMIT", "config_label", "evaluate_targets", "summarize", "summarize_switch",
           "trials_without_prior"]

# The issue's targets.
ADAPTIVE_VS_BEST_MAX = 1.03  # adaptive time / best static time
WORST_VS_ADAPTIVE_MIN = 1.2  # worst static time / adaptive time
STEP_VS_EXPERT_MAX = 1.15  # adaptive time / expert compute time
SWITCH_VS_STEP_MAX = 0.01  # (first step after a switch of r - a steady step) / the steady step
GSHARD_VS_STEP_MIN = 4.0  # GShard time / adaptive time
TUNING_STEP_LIMIT = 10_000  # a search that takes more steps than this is a bug
PEER_KINDS = ("tutel", "megatron-core")  # the rows of moe_runtime.bench.peers' layers


def config_label(r: int | None, d: int | None, algo: str | None) -> str:
    """r1/d2/2dh: one token, no spaces (the table is split on whitespace)."""
    return f"r{r}/d{d}/{algo}"


def trials_without_prior(rows: list[dict], tuning: dict, valid_rs: list[int], args: argparse.Namespace,
                         two_level: bool) -> int:
    """The trials the case's search would have run without the prior: the
    search replayed, without it, on the static rows' times (pure); with no
    static rows (a comparison case), the trials plus those the prior saved."""
    from ..tuning.dictionary import AdaptiveDictionary, Config

    static = {Config(row["r"], row["d"], row["algo"]): row["time_ms"] for row in rows if row["kind"] == "static"}
    if not static:
        return tuning["trials"] + tuning["skipped"]
    replay = AdaptiveDictionary(degrees=tuple(args.degrees), algos=tuple(args.algos), warmup=0, repeats=1,
                                drift=math.inf)
    replay.bind({"replay": True}, valid_rs, two_level)
    for _ in range(TUNING_STEP_LIMIT):
        config = replay.choose(0)
        if not replay.tuning(0):
            return replay.trials(0)
        replay.report(0, config, static[config] / 1e3)
    raise RuntimeError("the replayed search did not end")


def summarize(case: Case, rows: list[dict], tuning: dict, expert_shape: list[int], plan: Any) -> dict:
    """The case's summary from its rows (pure)."""
    static = [row for row in rows if row["kind"] == "static"]
    by_kind = {row["kind"]: row for row in rows if row["kind"] != "static"}
    adaptive_ms = by_kind["adaptive"]["time_ms"]
    expert_ms = by_kind["expert"]["time_ms"]
    gshard = by_kind.get("gshard")
    graphed = by_kind.get("graphed")
    captured = by_kind.get("captured")

    def config(row: dict | None) -> dict | None:
        if row is None:
            return None
        return {"config": config_label(row["r"], row["d"], row["algo"]), "time_ms": row["time_ms"]}

    best = min(static, key=lambda row: row["time_ms"], default=None)
    worst = max(static, key=lambda row: row["time_ms"], default=None)
    return {
        "tokens": case.tokens,
        "factor": case.factor,
        "comparison": case.comparison,
        "capacity": plan.capacity,
        "best": config(best),
        "worst": config(worst),
        "adaptive": {**tuning, "time_ms": adaptive_ms, "buffer_capacity": plan.buffer_capacity},
        "adaptive_vs_best": None if best is None else adaptive_ms / best["time_ms"],
        "worst_vs_adaptive": None if worst is None else worst["time_ms"] / adaptive_ms,
        "expert": {"time_ms": expert_ms, "shape": expert_shape},
        "step_vs_expert": adaptive_ms / expert_ms,
        "gshard_ms": None if gshard is None else gshard["time_ms"],
        "gshard_vs_step": None if gshard is None else gshard["time_ms"] / adaptive_ms,
        "graphed_ms": None if graphed is None else graphed["time_ms"],
        "graphed_vs_expert": None if graphed is None else graphed["time_ms"] / expert_ms,
        # the whole step in the caller's one CUDA graph (forward, loss, backward)
        "captured_ms": None if captured is None else captured["time_ms"],
        "captured_vs_expert": None if captured is None else captured["time_ms"] / expert_ms,
        # Tutel's and Megatron-Core's layers over the same weights (rows of their names): their time over the step's
        "peers": {name: {"time_ms": row["time_ms"], "vs_step": row["time_ms"] / adaptive_ms}
                  for name, row in by_kind.items() if name in PEER_KINDS},
        "switch": None,
    }


def summarize_switch(pairs: list[dict], buffers_unchanged: bool) -> dict:
    """What switching r costs, from (switch, steady, again) steps (pure):
    medians of switch - steady, in ms and relative to the steady step, over
    all records and per configuration; ``control``: the same relative median
    of again - steady, two steps without a switch between them."""
    median = statistics.median

    def numbers(mine: list[dict]) -> dict:
        return {"cost_ms": median(p["switch_ms"] - p["steady_ms"] for p in mine),
                "relative": median((p["switch_ms"] - p["steady_ms"]) / p["steady_ms"] for p in mine),
                "control": median((p["again_ms"] - p["steady_ms"]) / p["steady_ms"] for p in mine)}

    by_config: dict[str, list[dict]] = {}
    for pair in pairs:
        by_config.setdefault(pair["config"], []).append(pair)
    configs = [{"config": config, "switch_ms": median(p["switch_ms"] for p in mine),
                "steady_ms": median(p["steady_ms"] for p in mine), **numbers(mine)}
               for config, mine in by_config.items()]
    return {"pairs": len(pairs), **numbers(pairs), "buffers_unchanged": buffers_unchanged, "configs": configs,
            "samples": pairs}


def evaluate_targets(summaries: list[dict], sizes: dict) -> list[dict]:
    """Each target of the issue, met or missed, with the numbers of every case
    it applies to (pure). `sizes`: model_dim, hidden, experts, top_k."""

    def verdict(ok: bool) -> str:
        return "met" if ok else "missed"

    targets = []
    cases = []
    for s in summaries:
        if s["best"] is None:
            continue
        ok = s["adaptive_vs_best"] <= ADAPTIVE_VS_BEST_MAX and s["worst_vs_adaptive"] >= WORST_VS_ADAPTIVE_MIN
        cases.append({"tokens": s["tokens"], "factor": s["factor"], "adaptive_vs_best": s["adaptive_vs_best"],
                      "worst_vs_adaptive": s["worst_vs_adaptive"], "verdict": verdict(ok)})
    targets.append({"name": "adaptive", "text": f"adaptive within {ADAPTIVE_VS_BEST_MAX - 1:.0%} of the best static "
                    f"and >= {WORST_VS_ADAPTIVE_MIN:g}x the worst", "cases": cases})
    cases = [{"tokens": s["tokens"], "factor": s["factor"], "step_vs_expert": s["step_vs_expert"],
              "verdict": verdict(s["step_vs_expert"] <= STEP_VS_EXPERT_MAX)} for s in summaries]
    targets.append({"name": "expert", "text": f"step within {STEP_VS_EXPERT_MAX:g}x of its expert compute",
                    "cases": cases})
    issue_size = all(sizes[name] == ISSUE_SIZE[name] for name in ("model_dim", "hidden", "experts", "top_k"))
    cases = []
    for s in summaries:
        if s["comparison"] and s["gshard_vs_step"] is not None:
            at_size = issue_size and s["tokens"] == ISSUE_SIZE["tokens"] and s["factor"] == ISSUE_SIZE["factor"]
            cases.append({"tokens": s["tokens"], "factor": s["factor"], "gshard_vs_step": s["gshard_vs_step"],
                          "issue_size": at_size, "verdict": verdict(s["gshard_vs_step"] >= GSHARD_VS_STEP_MIN)})
    targets.append({"name": "gshard", "text": f">= {GSHARD_VS_STEP_MIN:g}x the GShard-style layer at T = 4096, "
                    "M = 1024, H = 1024, E = 8, k = 2, f = 1", "cases": cases})
    cases = [{"tokens": s["tokens"], "factor": s["factor"], "switch_relative": s["switch"]["relative"],
              "switch_ms": s["switch"]["cost_ms"], "switch_control": s["switch"]["control"],
              "buffers_unchanged": s["switch"]["buffers_unchanged"],
              "verdict": verdict(s["switch"]["relative"] < SWITCH_VS_STEP_MAX and s["switch"]["buffers_unchanged"])}
             for s in summaries if s.get("switch")]
    targets.append({"name": "switch", "text": f"switching r costs < {SWITCH_VS_STEP_MAX:.0%} of a step and "
                    "allocates no buffer",
                    "cases": cases})
    for target in targets:
        # The GShard target holds at the issue's size only; other sizes are shown for reading.
        judged = [c for c in target["cases"] if target["name"] != "gshard" or c["issue_size"]]
        verdicts = [c["verdict"] for c in judged]
        target["verdict"] = "not measured" if not verdicts else verdict(all(v == "met" for v in verdicts))
    return targets

