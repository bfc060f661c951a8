"""gpu_check.md: what the device call brings back first. The machine and
the build, each stage's steps with result, time and budget, every GPU target
with its number, the tests a GPU machine skipped (each one a check that did
not run), and the excerpts of what failed."""

from __future__ import annotations

from pathlib import Path

from .stages import NOT_CHOSEN, Result
from .targets import Target


def table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    def cell(text: str) -> str:
        return str(text).replace("|", "\\|").replace("\n", " ")
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(cell(c) for c in row) + " |" for row in rows)]


def write(path: Path, *, dry: bool, facts: dict[str, str], build: Result, results: list[Result],
          targets: list[Target], seconds: float) -> None:
    failed = [r for r in [build, *results] if not r.ok]
    if dry:
        verdict = "dry run (no GPU): " + ("everything up to the first GPU call passed" if not failed
                                          else f"{len(failed)} step(s) failed")
    else:
        left_out = sum(r.status == NOT_CHOSEN for r in results)
        verdict = (f"{len(failed)} step(s) did not pass" if failed else "every step passed" if not left_out
                   else f"every step that ran passed ({left_out} left out by --only)")
    lines = [f"# GPU check: {facts.get('gpu', '?')}", "", f"**{verdict}**, {seconds:.0f} s in all.", ""]
    lines += table(("", ""), [(key, value) for key, value in facts.items()])
    lines += ["", "## Steps", ""]
    rows = [(r.stage, r.step, r.status, f"{r.seconds:.1f}", f"{r.budget_s:.0f}", r.summary) for r in [build, *results]]
    lines += table(("stage", "step", "result", "s", "budget s", "its summary"), rows)
    lines += ["", "## Targets", ""]
    lines += table(("target", "goal", "measured", "verdict"),
                   [(t.name, t.goal, t.measured, t.verdict) for t in targets])
    skipped = [(r.step, line) for r in results for line in r.skips]
    if skipped and not dry:
        lines += ["", "## Skipped on the GPU machine", "",
                  "Each of these is a check that did not run; on a GPU none should say 'no CUDA device'.", ""]
        lines += [f"- {step}: `{line}`" for step, line in skipped[:60]]
    trouble = [r for r in [build, *results] if r.excerpt]
    if trouble:
        lines += ["", "## Excerpts of what did not pass", ""]
        for result in trouble:
            lines += [f"### {result.stage}: {result.step} ({result.status})", "", "```", result.excerpt[-6000:], "```",
                      ""]
    path.write_text("\n".join(lines) + "\n")
