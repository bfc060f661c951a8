"""Where one step's time goes: the kernels (on CUDA) or ops (on the CPU) with
the most self time, from torch.profiler.

On a GPU a step replayed from CUDA graphs has no host time left, and what
is left over its expert compute is device time: this says which kernels
hold it (the gate's, the encode and decode, the exchange's copies, the
GEMMs), for our layer and for each peer in the same run. On the CPU the
same call lists the ops by self CPU time.

    rows = top_self_time(torch, step, device="cuda", top=12)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .profiler_chatter import without_profiler_chatter

__all__ = ["format_profile", "top_self_time"]


def _self_us(event: Any, on_device: bool) -> float:
    if not on_device:
        return event.self_cpu_time_total
    # torch >= 2.4 names it device time; older versions, CUDA time
    return getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0.0)


def top_self_time(torch: Any, step: Callable[[], None], *, device: str, top: int, steps: int = 2) -> dict:
    """One warm step, then `steps` profiled ones: {"busy_ms": self time per
    step of every kernel (CUDA) or op (CPU), "kernels": how many distinct,
    "rows": the `top` largest, each {"name", "ms" per step, "calls" per
    step, "share" of busy_ms}}; on CUDA also "host": the same of the host's
    ops (self CPU time)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    on_device = device == "cuda"
    sync = torch.cuda.synchronize if on_device else (lambda: None)
    step()
    sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_device else [])
    with without_profiler_chatter(), profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        sync()
    averages = prof.key_averages()
    found = _largest([e for e in averages if (e.device_type == DeviceType.CUDA) == on_device], on_device, top, steps)
    if on_device:  # and what the host spent, by op: on a GPU the step's time past its kernels is there
        found["host"] = _largest([e for e in averages if e.device_type != DeviceType.CUDA], False, top, steps)
    return found


def _largest(events: list, on_device: bool, top: int, steps: int) -> dict:
    events = [e for e in events if _self_us(e, on_device) > 0]
    busy_us = sum(_self_us(e, on_device) for e in events)
    events.sort(key=lambda e: _self_us(e, on_device), reverse=True)
    rows = [{"name": e.key, "ms": _self_us(e, on_device) / 1e3 / steps, "calls": e.count / steps,
             "share": _self_us(e, on_device) / busy_us if busy_us else 0.0} for e in events[:top]]
    return {"busy_ms": busy_us / 1e3 / steps, "kernels": len(events), "rows": rows}


def format_profile(label: str, profile: dict, step_ms: float | None, unit: str) -> list[str]:
    """Comment lines for a benchmark's output: the busy time against the step's, then one line per row
    (and the host's ops after a GPU's kernels)."""
    step = f" of a {step_ms:.2f} ms step" if step_ms else ""
    lines = [(f"#   {label}: {profile['busy_ms']:.2f} ms of {unit} self time per step{step}, "
              f"{profile['kernels']} distinct {unit}s; the largest:")]
    for row in profile["rows"]:
        name = row["name"] if len(row["name"]) <= 90 else row["name"][:87] + "..."
        lines.append(f"#     {row['ms']:8.3f} ms {row['share'] * 100:5.1f}% x{row['calls']:<5g} {name}")
    if "host" in profile:
        lines += format_profile(f"{label}, on the host", profile["host"], None, "op")
    return lines
