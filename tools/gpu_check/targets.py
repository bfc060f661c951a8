"""The GPU targets of docs/benchmarks.md, read from the benchmarks' JSON and
output: each with its measured number and met / missed (or only reported,
where the docs set no number).

    target                                                     source
    a2a.bench --device cuda: #wrong 0; linear vs D2D reported  collectives.json
    layout kernels >= 0.80 of a device copy, chunks >= 64 KiB  layout.json
    encode/decode >= 0.9 of a same-run device memcpy, bf16     kernels.json
    esmm >= 0.7 of cuBLAS (issue 14's target, on the GPU)      es_ops.json
    the fused top-k gate against torch's ops: reported, #wrong 0   gate.json
    nccl_tests_ext -D cuda (and -G 1): #wrong 0                the programs' footers
    MoE layer step (issue 35), per comparison case:            layer.json
      step <= 1.6x its expert compute at T = 4096, <= 1.3x at 16384
      the graphed step <= 1.15x its expert compute at T = 4096 (cuda_graphs=1; and the whole
        step captured by its caller in one graph, as Megatron-Core's full-iteration graphs)
      >= 1.5x faster than Tutel's, >= 2x than Megatron-Core's, >= 6x than GShard's
      every peer equal to the layer in float64 first (its tolerance)
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from .stages import Result

LAYOUT_MIN = 0.80
LAYOUT_FROM_BYTES = 64 * 1024
ENCODE_DECODE_MIN = 0.9
ESMM_MIN = 0.7
STEP_VS_EXPERT_MAX = {4096: 1.6, 16384: 1.3}  # by T; other T are reported
GRAPHED_VS_EXPERT_MAX = {4096: 1.15}
PEER_VS_STEP_MIN = {"gshard": 6.0, "tutel": 1.5, "megatron-core": 2.0}  # the peer's time / our step's
NCCL_FOOTER = re.compile(r"#\s*Out of bounds values\s*:\s*(\d+)\s+(OK|FAILED)")


@dataclass
class Target:
    name: str
    goal: str
    measured: str
    verdict: str  # met, missed, reported, not run (why)


def load(bench: Path, name: str) -> list | dict | None:
    path = bench / name
    if not path.exists():
        return None
    return json.loads(path.read_text())


def verdict(ok: bool) -> str:
    return "met" if ok else "missed"


def judged(ratio: float, minimum: float | None, wrong: int) -> str:
    """Missed on any wrong element; else met or missed against `minimum`, or
    only reported where the docs set none."""
    if wrong:
        return "missed"
    return "reported" if minimum is None else verdict(ratio >= minimum)


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def collectives(rows: list[dict]) -> list[Target]:
    ours = [r for r in rows if r.get("algo") not in (None, "d2d")]
    wrong = sum(r.get("wrong") or 0 for r in ours)
    out = [Target("a2a.bench --device cuda: every algorithm right", "#wrong 0", f"#wrong {wrong}", verdict(not wrong))]
    for algo in sorted({r["algo"] for r in ours}):
        largest = max((r for r in ours if r["algo"] == algo), key=lambda r: r["size"])
        ratio = (largest.get("ratios") or {}).get("d2d")
        out.append(Target(f"a2a.bench --device cuda: {algo} against a device copy (1 rank)", "reported",
                          f"{ratio:.2f}x D2D at {largest['size']} B" if ratio else "no D2D ratio", "reported"))
    return out


def layout(rows: list[dict]) -> list[Target]:
    out = []
    for op in ("transpose", "ranges"):
        big = [r for r in rows if r["op"] == op and r["chunk_bytes"] >= LAYOUT_FROM_BYTES]
        if not big:
            continue
        worst = min(big, key=lambda r: r["of_copy"])
        wrong = sum(r["wrong"] for r in rows if r["op"] == op)
        out.append(Target(f"layout {op} against a device copy, chunks >= 64 KiB", f">= {LAYOUT_MIN:.2f}, #wrong 0",
                          f"worst {worst['of_copy']:.2f} (chunk {worst['chunk_bytes']} B), "
                          f"geomean {geomean([r['of_copy'] for r in big]):.2f}, #wrong {wrong}",
                          judged(worst["of_copy"], LAYOUT_MIN, wrong)))
    return out


def kernels(rows: list[dict]) -> list[Target]:
    out = []
    measured = [r for r in rows if not r.get("skipped") and r.get("vs_memcpy")]
    for op in ("encode", "decode", "permute", "unpermute"):
        mine = [r for r in measured if r["op"] == op and r["dtype"] == "bfloat16"]
        if not mine:
            continue
        worst = min(mine, key=lambda r: r["vs_memcpy"])
        wrong = sum(r.get("wrong") or 0 for r in mine)
        shape = f"T={worst['tokens']} E={worst['experts']} M={worst['model_dim']}"
        text = (f"worst {worst['vs_memcpy']:.2f} ({shape}), geomean {geomean([r['vs_memcpy'] for r in mine]):.2f}, "
                f"#wrong {wrong}")
        minimum = ENCODE_DECODE_MIN if op in ("encode", "decode") else None
        goal = f">= {minimum} of memcpy, #wrong 0" if minimum else "reported, #wrong 0"
        out.append(Target(f"{op} bf16 against a same-run device memcpy", goal, text,
                          judged(worst["vs_memcpy"], minimum, wrong)))
    return out


def es_ops(rows: list[dict]) -> list[Target]:
    out = []
    for row in rows:
        minimum = ESMM_MIN if row["op"] == "esmm" else None
        goal = f">= {minimum} of cuBLAS" if minimum else "reported"
        # vs_dropless: against permuted rows through torch's grouped GEMM (the runtime's Hexa "auto" path).
        text = (f"{row['gflops']:.0f} GFLOP/s, {row['vs_dense']:.2f}x the dense matmul, "
                f"{row['vs_padded']:.2f}x padded, {row.get('vs_dropless', float('nan')):.2f}x permuted rows, "
                f"#wrong {row['wrong']}")
        out.append(Target(f"{row['op']} {row['dtype']} T={row['T']} E={row['E']} k={row['k']} M={row['M']} H={row['H']}",
                          goal + ", #wrong 0", text, judged(row["vs_dense"], minimum, row["wrong"])))
    return out


def gate(rows: list[dict]) -> list[Target]:
    """The fused gate, per pass: its worst row against torch's ops and memcpy (no number is set)."""
    out = []
    for direction in ("forward", "backward"):
        mine = [r for r in rows if r["pass"] == direction]
        if not mine:
            continue
        worst = min(mine, key=lambda r: r["vs_torch"])
        wrong = sum(r.get("wrong") or 0 for r in mine)
        text = (f"worst {worst['vs_torch']:.2f}x torch's ops (T={worst['tokens']} E={worst['experts']} "
                f"k={worst['top_k']}: {worst['time_us']:.1f} us), geomean {geomean([r['vs_torch'] for r in mine]):.2f}x; "
                f"{geomean([r['vs_memcpy'] for r in mine]):.2f} of memcpy; #wrong {wrong}")
        out.append(Target(f"top_k_gate {direction} {worst['dtype']} against torch's ops", "reported, #wrong 0", text,
                          judged(worst["vs_torch"], None, wrong)))
    return out


def _against_expert(what: str, size: str, ms: float, expert_ms: float, limit: float | None) -> Target:
    """A step's time against its expert compute, judged where the issue sets a limit for this T."""
    ratio = ms / expert_ms
    return Target(f"{what} against its expert compute, {size}", f"<= {limit}x" if limit else "reported",
                  f"{ms:.2f} ms / {expert_ms:.2f} ms = {ratio:.2f}x", verdict(ratio <= limit) if limit else "reported")


def layer(report: dict) -> list[Target]:
    """The MoE layer step on the GPU (moe_runtime.bench --gpu-step's JSON),
    each comparison case against issue 35's targets, after the float64
    checks of the peers against the layer."""
    out = []
    peer = report.get("peer_check") or {}
    out.append(Target("the GShard peer equals the layer in float64 on the device", f"<= {peer.get('tolerance', '?')}",
                      f"output error {peer.get('output_error', float('nan')):.2g}, gradient error "
                      f"{peer.get('grad_error', float('nan')):.2g}", verdict(bool(peer.get("passed")))))
    for check in report.get("peers_check") or []:
        name = f"{check['name']} equals the layer in float64 on the device"
        if check.get("missing"):
            out.append(Target(name, f"<= {check['tolerance']}", "-", f"not run: {check['missing']}"))
            continue
        out.append(Target(f"{check['name']} {check['version']} equals the layer in float64 on the device",
                          f"<= {check['tolerance']}", f"output error {check['output_error']:.2g}, gradient error "
                          f"{check['grad_error']:.2g}", verdict(bool(check["passed"]))))
    cases = [s for s in report.get("summaries", []) if s.get("comparison")]
    if not cases:
        out.append(Target("MoE layer step", "see docs/benchmarks.md", "-", "not run: no comparison case"))
    for case in cases:
        tokens = case["tokens"]
        size = f"T={tokens}, f={case['factor']:g}, {report.get('dtype')}"
        step, expert = case["adaptive"]["time_ms"], case["expert"]["time_ms"]
        out.append(_against_expert(f"MoE layer step ({case['adaptive']['config']})", size, step, expert,
                                   STEP_VS_EXPERT_MAX.get(tokens)))
        if case.get("graphed_ms") is not None:
            out.append(_against_expert("the step replayed from CUDA graphs", size, case["graphed_ms"], expert,
                                       GRAPHED_VS_EXPERT_MAX.get(tokens)))
        if case.get("captured_ms") is not None:
            out.append(_against_expert("the whole step captured by its caller in one CUDA graph", size,
                                       case["captured_ms"], expert, GRAPHED_VS_EXPERT_MAX.get(tokens)))
        times = {"gshard": case.get("gshard_ms")}
        times.update({name: peer.get("time_ms") for name, peer in (case.get("peers") or {}).items()})
        for name, minimum in PEER_VS_STEP_MIN.items():
            goal = f">= {minimum}x"
            what = f"{name} against the MoE layer step, {size}"
            missing = ((case.get("peers") or {}).get(name) or {}).get("missing")
            if times.get(name) is None:
                out.append(Target(what, goal, "-", f"not run: {missing or 'no row'}"))
                continue
            ratio = times[name] / step
            out.append(Target(what, goal, f"{times[name]:.2f} ms / {step:.2f} ms = {ratio:.2f}x",
                              verdict(ratio >= minimum)))
    return out


def nccl_programs(results: list[Result]) -> list[Target]:
    out = []
    for result in results:
        if not result.step.startswith("nccl_tests_ext"):
            continue
        footer = NCCL_FOOTER.search(result.output)
        if not result.ok or footer is None:
            measured = f"{result.status}" + (f", footer: {footer.group(0)}" if footer else ", no footer")
            # A step left out on purpose (--only, or the dry run's "no GPU") is not a miss; one that ran out
            # of time or whose build failed is.
            left_out = result.status.startswith(("not run: not in --only", "not run: no GPU")) \
                or result.status == "not run"
            out.append(Target(result.step, "#wrong 0", measured, "not run" if left_out else "missed"))
            continue
        wrong = int(footer.group(1))
        out.append(Target(result.step, "#wrong 0", f"#wrong {wrong}", verdict(wrong == 0 and footer.group(2) == "OK")))
    return out


def evaluate(bench: Path, results: list[Result], *, dry: bool) -> list[Target]:
    """Every target, in the order of the module docstring."""
    readers = (("collectives.json", collectives, "a2a.bench --device cuda"),
               ("layout.json", layout, "layout kernels"),
               ("kernels.json", kernels, "encode/decode/permute/unpermute bf16"),
               ("es_ops.json", es_ops, "esmm, ess, estmm"),
               ("gate.json", gate, "the fused top-k gate"),
               ("layer.json", layer, "MoE layer step"))
    out: list[Target] = []
    for name, read, what in readers:
        data = None if dry else load(bench, name)
        if data is None:
            why = "no GPU (dry run)" if dry else f"no {name}: its benchmark did not finish"
            out.append(Target(what, "see docs/benchmarks.md", "-", f"not run: {why}"))
            continue
        out += read(data)
    if dry:
        out.append(Target("nccl_tests_ext -D cuda, -G 1", "#wrong 0", "-", "not run: no GPU (dry run)"))
    else:
        out += nccl_programs(results)
    return out
