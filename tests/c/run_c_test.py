"""Builds examples/c against the installed liba2a via find_package(a2a) and
runs its programs (alltoall, low_latency) under mpirun: plain 4 ranks,
emulated 2 x 2 nodes, and 3 ranks; and external_transport (four threads
over the program's own transport, no MPI) and top_k_gate (a local kernel)
once each, directly.
Called by `make test-c`; prints the program's output and a summary line."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

from c_programs import cmake_build, mpirun_env

from a2a.launch import mpirun_command

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.path.join(ROOT, "build", "c-example")
CONFIGS = [(4, None), (4, 2), (3, 1)]  # (ranks, emulated local_size)
PROGRAMS = ("alltoall", "low_latency")


def main() -> int:
    shutil.rmtree(BUILD, ignore_errors=True)
    cmake_build(os.path.join(ROOT, "examples", "c"), BUILD)
    passed = failed = 0
    for program, (ranks, local_size) in ((p, c) for p in PROGRAMS for c in CONFIGS):
        command = mpirun_command(ranks, [os.path.join(BUILD, program)])
        code = subprocess.run(command, env=mpirun_env(local_size), timeout=300, check=False).returncode
        label = f"C program {program}, {ranks} ranks" + (f", local_size {local_size}" if local_size else "")
        print(f"{'PASS' if code == 0 else 'FAIL'}: {label}")
        passed += code == 0
        failed += code != 0
    env = {k: v for k, v in os.environ.items() if not k.startswith("A2A_")}
    for program, label in (("external_transport", "4 threads, no MPI"), ("top_k_gate", "a local kernel, no MPI")):
        code = subprocess.run([os.path.join(BUILD, program)], env=env, timeout=120, check=False).returncode
        print(f"{'PASS' if code == 0 else 'FAIL'}: C program {program}, {label}")
        passed += code == 0
        failed += code != 0
    print(f"{passed} passed, {failed} failed")
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
