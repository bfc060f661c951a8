#!/usr/bin/env python3
"""a2a_all_to_all in C against MPI_Alltoall, in turns, in one mpirun
(alltoall_vs_mpi.c): the library's exchange and its cross-rank check
without Python. Builds the program against the installed a2a, then runs it
with the check on and off.

    python tools/c_vs_mpi/run.py [--np 4] [--local-size 2] [--algo linear] [-b 8192] [-e 65536]
                                 [--calls 200] [--repetitions 9]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "tests", "c"))

from c_programs import cmake_build, mpirun_env

from a2a.launch import mpirun_command


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--np", type=int, default=4)
    parser.add_argument("--local-size", type=int, default=2, help="emulated ranks per node (A2A_LOCAL_SIZE)")
    parser.add_argument("--algo", default="linear", choices=["linear", "2dh"])
    parser.add_argument("-b", type=int, default=8192, help="smallest size, bytes per rank")
    parser.add_argument("-e", type=int, default=65536, help="largest size, bytes per rank")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--repetitions", type=int, default=9)
    args = parser.parse_args()
    build = os.path.join(ROOT, "build", "c-vs-mpi")
    cmake_build(HERE, build)
    program = os.path.join(build, "alltoall_vs_mpi")
    for check in ("1", "0"):
        env = dict(mpirun_env(args.local_size), A2A_CROSS_CHECK=check)
        command = mpirun_command(args.np, [program, args.algo, str(args.b), str(args.e), str(args.calls),
                                           str(args.repetitions)])
        done = subprocess.run(command, env=env, check=False)
        if done.returncode != 0:
            return done.returncode
    return 0


if __name__ == "__main__":
    sys.exit(main())
