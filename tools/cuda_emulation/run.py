"""Runs the CUDA kernels of the expert-specific operators (csrc/cuda/es_cuda.cu)
on the CPU, for machines without a GPU: a host emulation of the CUDA model
(include/: one std::thread per CUDA thread, one block at a time, __shared__
as static storage, __syncthreads as a barrier that reports a deadlock, WMMA
fragments held whole by every lane, with its alignment rules checked) runs
es_cuda.cu's own host functions and kernels, rewritten only where C++ cannot
read CUDA (<<<>>> launches become emu::launch; the sm_80 guard is on; the
y/z grid cap is 1, so every grid-stride loop runs). es_cuda_check.cpp
checks the slot scatter, ESMM (CUDA-core and tensor-core paths, all row and
layout modes, bias, gates, misaligned rows), ESS and ESTMM against float64
references, under AddressSanitizer and UBSan.

    python tools/cuda_emulation/run.py [cases] [seed]      (about 2 min for 60 cases)

It proves indexing, bounds, barriers and the order of the sums; not speed,
nor what only hardware shows (memory ordering across warps, real WMMA
rounding). Not part of `make test`: a GPU runs tests/gpu/test_es_ops_gpu.py.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def split_top(text: str) -> list[str]:
    """Splits a launch configuration at its top-level commas."""
    parts, depth, current = [], 0, ""
    for ch in text:
        depth += ch in "(<[{"
        depth -= ch in ")>]}"
        if ch == "," and depth == 0:
            parts.append(current.strip())
            current = ""
        else:
            current += ch
    return [*parts, current.strip()]


def host_source(cuda: str) -> str:
    """es_cuda.cu with every `kernel<<<grid, block, ...>>>(args);` turned into
    `emu::launch(dim3(grid), dim3(block), [&] { kernel(args); });`."""
    for old, new in (("#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800", "#if 1"),
                     ("constexpr int64_t kMaxGridYZ = 65535;", "constexpr int64_t kMaxGridYZ = 1;")):
        if old not in cuda:
            raise SystemExit(f"run.py: es_cuda.cu no longer contains {old!r}; update the rewrite")
        cuda = cuda.replace(old, new)
    out, pos = [], 0
    for match in re.finditer(r"<<<", cuda):
        start = match.start()
        if start < pos:
            continue
        line = cuda.rfind("\n", 0, start) + 1
        name_at = line + len(cuda[line:start]) - len(cuda[line:start].lstrip())
        close = cuda.index(">>>", start)
        grid, block = split_top(cuda[start + 3:close])[:2]
        if cuda[close + 3] != "(":
            raise SystemExit(f"run.py: unexpected launch syntax near {cuda[name_at:close + 10]!r}")
        depth, end = 0, close + 3
        while True:
            depth += cuda[end] == "("
            depth -= cuda[end] == ")"
            if depth == 0:
                break
            end += 1
        if cuda[end + 1] != ";":
            raise SystemExit(f"run.py: a launch that is not a statement near {cuda[name_at:end + 10]!r}")
        out += [cuda[pos:name_at],
                f"emu::launch(dim3({grid}), dim3({block}), [&] {{ {cuda[name_at:start]}({cuda[close + 4:end]}); }});"]
        pos = end + 2
    return "".join(out) + cuda[pos:]


def main() -> int:
    cases = sys.argv[1] if len(sys.argv) > 1 else "20"
    seed = sys.argv[2:3]
    with open(os.path.join(ROOT, "csrc", "cuda", "es_cuda.cu")) as f:
        source = host_source(f.read())
    with tempfile.TemporaryDirectory() as tmp:
        host = os.path.join(tmp, "es_cuda_host.cpp")
        with open(host, "w") as f:
            f.write(source)
        binary = os.path.join(tmp, "es_cuda_check")
        compile_cmd = [os.environ.get("CXX", "g++"), "-std=c++17", "-O1", "-g", "-fsanitize=address,undefined",
                       "-fno-sanitize-recover=undefined", "-ffp-contract=off", f"-I{os.path.join(HERE, 'include')}",
                       f"-I{os.path.join(ROOT, 'csrc')}", f"-I{os.path.join(ROOT, 'csrc', 'include')}", host,
                       os.path.join(HERE, "es_cuda_check.cpp"), "-o", binary, "-lpthread"]
        subprocess.run(compile_cmd, check=True)
        return subprocess.run([binary, cases, *seed], check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
