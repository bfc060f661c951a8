"""The layer mode's text: its rows, summaries, dropless and switch rows,
and the targets' verdicts, in columns that line up under their names."""

from __future__ import annotations

_ROW = "{:>7}  {:>6}  {:>8}  {:>6}  {:>2}  {:>2}  {:>6}  {:>10}  {:>7}"
_SWITCH = "{:>7}  {:>6}  {:<12}  {:>10}  {:>10}  {:>8}  {:>9}  {:>7}"
_SUMMARY = "{:>7}  {:>6}  {:<12}  {:>9}  {:<12}  {:>9}  {:<12}  {:>9}  {:>6}  {:>6}  {:>7}  {:>9}  {:>8}  {:>9}  {:>11}"


def header_lines() -> list[str]:
    return [
        "#" + _ROW.format("tokens", "factor", "capacity", "buffer", "r", "d", "algo", "time(ms)", "vs best")[1:],
    ]


def format_row(row: dict) -> str:
    return _ROW.format(row["tokens"], f"{row['factor']:g}", row["capacity"], row["buffer_capacity"], row["r"],
                       row["d"], row["algo"], f"{row['time_ms']:.2f}", f"{row['vs_best']:.2f}x")


def summary_header_lines() -> list[str]:
    return [
        "#" + _SUMMARY.format("tokens", "factor", "best static", "ms", "worst static", "ms", "adaptive", "ms",
                              "/best", "worst/", "tuning", "expert ms", "step/exp", "gshard ms", "gshard/step")[1:],
    ]


def format_summary(s: dict) -> str:
    def shown(value: float | None, spec: str, suffix: str = "") -> str:
        return "-" if value is None else f"{value:{spec}}{suffix}"

    best, worst, adaptive = s["best"] or {}, s["worst"] or {}, s["adaptive"]
    return _SUMMARY.format(
        s["tokens"], f"{s['factor']:g}", best.get("config", "-"), shown(best.get("time_ms"), ".2f"),
        worst.get("config", "-"), shown(worst.get("time_ms"), ".2f"), adaptive["config"],
        f"{adaptive['time_ms']:.2f}", shown(s["adaptive_vs_best"], ".3f"), shown(s["worst_vs_adaptive"], ".2f", "x"),
        f"{adaptive['steps']}/{adaptive['trials']}", f"{s['expert']['time_ms']:.2f}",
        f"{s['step_vs_expert']:.3f}x", shown(s["gshard_ms"], ".2f"), shown(s["gshard_vs_step"], ".2f", "x"),
    )


def format_comparison(s: dict) -> str | None:
    """A comparison case's graphed step and peers (one rank), or None without them."""
    parts = []
    if s.get("graphed_ms") is not None:
        parts.append(f"graphed {s['graphed_ms']:.2f} ms ({s['graphed_vs_expert']:.2f}x expert)")
    if s.get("captured_ms") is not None:
        parts.append(f"captured whole {s['captured_ms']:.2f} ms ({s['captured_vs_expert']:.2f}x expert)")
    for name, peer in (s.get("peers") or {}).items():
        parts.append(f"{name}: {peer['missing']}" if "missing" in peer
                     else f"{name} {peer['time_ms']:.2f} ms ({peer['vs_step']:.2f}x the step)")
    return f"# T={s['tokens']} f={s['factor']:g}: " + "; ".join(parts) if parts else None


_DROPLESS = "{:>11}  {:>6}  {:>7}  {:>10}  {:>11}  {:>9}  {:>9}  {:>8}  {:>9}  {:>11}"


def dropless_header_lines() -> list[str]:
    return ["#" + _DROPLESS.format("dispatcher", "factor", "tokens", "time(ms)", "vs dropless", "rows sent",
                                   "MiB sent", "dropped", "peak MiB", "vs dropless")[1:]]


def format_dropless(row: dict) -> str:
    return _DROPLESS.format(row["dispatcher"], "-" if row["factor"] is None else f"{row['factor']:g}", row["tokens"],
                            f"{row['time_ms']:.2f}", f"{row['vs_dropless']:.2f}x", row["rows_sent"],
                            f"{row['mib_sent']:.2f}", row["dropped"], f"{row['peak_mib']:.2f}",
                            f"{row['peak_vs_dropless']:.2f}x")


def switch_header_lines() -> list[str]:
    return ["#" + _SWITCH.format("tokens", "factor", "config", "switch(ms)", "steady(ms)", "cost(ms)",
                                 "cost/step", "control")[1:]]


def format_switch(s: dict) -> list[str]:
    """A case's switch rows: one per configuration, then all of them ("all")."""
    switch = s["switch"]
    lines = []
    for c in [*switch["configs"], {**switch, "config": "all", "switch_ms": None, "steady_ms": None}]:
        lines.append(_SWITCH.format(
            s["tokens"], f"{s['factor']:g}", c["config"],
            "-" if c["switch_ms"] is None else f"{c['switch_ms']:.2f}",
            "-" if c["steady_ms"] is None else f"{c['steady_ms']:.2f}",
            f"{c['cost_ms']:+.2f}", f"{c['relative']:+.2%}", f"{c['control']:+.2%}"))
    return lines


def target_lines(targets: list[dict]) -> list[str]:
    lines = ["# targets"]
    for target in targets:
        lines.append(f"#   {target['text']}: {target['verdict'].upper()}")
        for case in target["cases"]:
            where = f"T={case['tokens']} f={case['factor']:g}"
            if target["name"] == "adaptive":
                numbers = f"adaptive / best {case['adaptive_vs_best']:.3f}, worst / adaptive {case['worst_vs_adaptive']:.2f}x"
            elif target["name"] == "expert":
                numbers = f"step / expert compute {case['step_vs_expert']:.3f}x"
            elif target["name"] == "switch":
                numbers = (f"switch cost {case['switch_ms']:+.2f} ms, {case['switch_relative']:+.2%} of a step "
                           f"(control {case['switch_control']:+.2%}), buffers "
                           f"{'unchanged' if case['buffers_unchanged'] else 'ALLOCATED'}")
            else:
                numbers = f"GShard / step {case['gshard_vs_step']:.2f}x"
                if not case["issue_size"]:
                    where += " (not the issue's size)"
            lines.append(f"#     {where}: {numbers}: {case['verdict']}")
    return lines

