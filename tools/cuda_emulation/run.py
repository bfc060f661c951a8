"""Runs every CUDA kernel of csrc/cuda on the CPU, for machines without a GPU,
and checks each against the CPU kernels or float64 references. Part of
`make test` (target test-cuda-emulation); needs g++ with its sanitizers, no
build of the library and no GPU.

A kernel file is any csrc/cuda/*.cu(h) that defines a __global__ function; each
must have its check program here, <stem>_check.cpp, or this script fails naming
the file. Today: es_cuda.cu (es_cuda_check.cpp: ESMM / ESS / ESTMM against
float64), fp8_cuda.cu (fp8_cuda_check.cpp: quantize_fp8 and dequantize_fp8
bitwise against cpu/fp8_cpu.cpp, and moe/fp8.hpp's encoding over every code),
gating_cuda.cu (gating_cuda_check.cpp: the fused top-k gate forward and
backward bitwise against cpu/gating_cpu.cpp and within rounding of a float64
reference), layout_cuda.cu (layout_cuda_check.cpp: transpose_chunks and
copy_ranges bitwise against cpu/cpu_device.cpp), low_latency_cuda.cu
(low_latency_cuda_check.cpp: whole exchanges of 1 to 5 ranks, pack, unpack,
return and combine bytewise against cpu/low_latency_cpu.cpp and a model of
the exchange, and the status record against the CPU's errors) and
moe_cuda.cu (moe_cuda_check.cpp: route's scan, dispatch, combine and
gate_grad against cpu/moe_cpu.cpp); each file's header says what it covers.
Every kernel a file defines must be launched in it and run by its check
program, else this fails.

The kernel file itself is compiled for the host, rewritten only where C++
cannot read CUDA (each rewrite fails loudly when the source no longer matches):
  - `kernel<<<grid, block[, shared, stream]>>>(args);` becomes
    `emu::launch(name, launch bound, grid, block, shared, [&] { kernel(args); });`
  - `__shared__ [__align__(A)] T name[dims];` becomes a reference to the
    block's own instance, `auto& name = emu::shared<T[dims], A, id>();`
  - `__CUDA_ARCH__` conditions take the device branch (sm_80+), as nvcc's
    device pass does: the file's own are rewritten, and the file is compiled
    with __CUDA_ARCH__ defined (800), so that the headers it includes take
    theirs too (moe/gating.hpp's products are __fmul_rn / __dmul_rn there);
  - file-specific constants in REWRITES (es_cuda.cu: the y/z grid cap is 1,
    so that every grid-stride loop turns).
It is compiled with FMA contraction where the CPU has FMA (as nvcc's default
--fmad=true; __fmul_rn / __dmul_rn stay separate products), the check
programs and the CPU kernels without.

include/ emulates the CUDA model (emu.hpp, cuda_runtime.h, mma.h): a launch
runs its blocks one after another, a block one fiber per CUDA thread, each
until it reaches __syncthreads or a warp collective (__syncwarp,
__shfl_xor_sync, __match_any_sync, __ballot_sync; full mask only), in a
chosen order; a barrier or collective that not every thread reaches is
reported as a deadlock. __shared__ arrays live in a fresh 48 KiB arena per block, filled
with a chosen byte, poisoned for ASan outside the declared arrays; atomics
are relaxed atomics; WMMA fragments are held whole by every lane; launch
bounds, grid and block limits and WMMA alignment rules are checked. The
check programs give every output buffer guard bytes (poisoned for ASan, and
compared after each operation) and small SM counts, so that grid-stride
loops turn.

Two builds of every check program run, in parallel:
  - AddressSanitizer + UBSan (out-of-bounds accesses, misaligned vector
    accesses, overflow and other UB stop the program), each operation run
    under two schedules (forward / reverse, or two shuffles, of the blocks and
    of the threads; __shared__ filled with 0x00 / 0xff) whose outputs must be
    bitwise equal: a race or a read of unwritten shared memory that changes
    an output fails the case;
  - ThreadSanitizer, over fewer cases: every CUDA thread is a TSan fiber whose
    switches do not synchronize, and the emulation declares only the edges
    CUDA guarantees (launch -> threads, __syncthreads, __syncwarp, threads ->
    end of launch; shuffles, matches, ballots and relaxed atomics order
    nothing), so two threads of a block, or of successive blocks, touching
    the same bytes unordered are reported whatever order they ran in.
--self-test plants each bug of PLANTS in turn (an off-by-one store, vectors
wider than the pointers' alignment, missing __syncthreads, a read of
unwritten shared memory, a __syncthreads in divergent code, a non-atomic
add, a missing __syncwarp) and requires each to be reported by the
detectors named there.

    python3 tools/cuda_emulation/run.py            what make test runs (40-80 s on 2 shared cores)
    python3 tools/cuda_emulation/run.py --long     10x the cases, 5x under TSan, ASan's
                                                   use-after-return detection (6 min there)
    python3 tools/cuda_emulation/run.py --scale 3 --seed 7 --only moe_cuda --no-tsan
    python3 tools/cuda_emulation/run.py --self-test    (1.5 min there)
    python3 tools/cuda_emulation/run.py --plant histogram-plain-add --only moe_cuda

--scale multiplies every program's case count (CASES below), --tsan-scale the
ThreadSanitizer build's (TSAN_CASES), --seed picks other random cases (default
1, so make test is reproducible), --only restricts the kernel files, --jobs
the parallel compiles and runs, --keep builds in a directory that stays (to
rerun a program: `DIR/asan/moe_cuda_check CASES SEED`). A program's output
ends with one line per kernel instantiation run and a line of totals
(kernels, instantiations, launches, blocks, threads, cases, checks, failures).

It proves indexing, bounds, barriers, races and the order of the sums; not
speed, nor what only hardware shows (memory ordering beyond the barriers,
real WMMA rounding, nvcc's exact FMA contraction). A GPU runs tests/gpu/.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import os
import re
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
KERNEL_DIR = os.path.join(ROOT, "csrc", "cuda")

# Cases per check program (its CASES argument) in the quick run, and in the
# ThreadSanitizer build.
CASES = {"es_cuda": 20, "fp8_cuda": 20, "gating_cuda": 40, "layout_cuda": 100, "low_latency_cuda": 150, "moe_cuda": 60}
TSAN_CASES = {"es_cuda": 8, "fp8_cuda": 6, "gating_cuda": 10, "layout_cuda": 30, "low_latency_cuda": 40, "moe_cuda": 20}
# CPU twins linked into a check program (paths under csrc/).
TWINS = {
    "es_cuda": [],
    "fp8_cuda": ["cpu/fp8_cpu.cpp", "cpu/thread_pool.cpp"],
    "gating_cuda": ["cpu/gating_cpu.cpp", "cpu/thread_pool.cpp"],
    "layout_cuda": ["cpu/cpu_device.cpp", "core/device.cpp", "core/counters.cpp", "cpu/thread_pool.cpp"],
    # low_latency_cpu.cpp sums rows with moe_cpu.cpp's weighted sum.
    "low_latency_cuda": ["cpu/low_latency_cpu.cpp", "cpu/moe_cpu.cpp", "cpu/es_cpu.cpp", "cpu/gemm_cpu.cpp",
                         "cpu/fp8_cpu.cpp", "cpu/gating_cpu.cpp", "cpu/thread_pool.cpp"],
    "moe_cuda": ["cpu/moe_cpu.cpp", "cpu/es_cpu.cpp", "cpu/gemm_cpu.cpp", "cpu/fp8_cpu.cpp", "cpu/gating_cpu.cpp",
                 "cpu/low_latency_cpu.cpp", "cpu/thread_pool.cpp"],
}
# File-specific rewrites: (old, new), each of which must match.
REWRITES = {
    "es_cuda": [("constexpr int64_t kMaxGridYZ = 65535;", "constexpr int64_t kMaxGridYZ = 1;")],
}

COMMON_FLAGS = ["-std=c++17", "-O1", "-g1", "-pthread", f"-I{os.path.join(HERE, 'include')}", f"-I{HERE}",
                f"-I{os.path.join(ROOT, 'csrc')}", f"-I{os.path.join(ROOT, 'csrc', 'include')}"]
SANITIZERS = {
    "asan": ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined", "-fno-omit-frame-pointer"],
    "tsan": ["-fsanitize=thread"],
}


def fail(message: str) -> None:
    raise SystemExit(f"run.py: {message}")


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


def kernels_of(cuda: str) -> dict[str, str]:
    """The __global__ functions of a source: name -> launch bound (max threads per block)."""
    found = {}
    for match in re.finditer(r"\b__global__\s+void\s+(?:__launch_bounds__\s*\(([^()]*)\)\s*)?(\w+)\s*\(", cuda):
        found[match.group(2)] = split_top(match.group(1))[0] if match.group(1) else "1024"
    if len(found) != len(re.findall(r"\b__global__\b", cuda)):
        fail("a __global__ definition that is not `__global__ void [__launch_bounds__(...)] name(` ; update kernels_of")
    return found


def device_pass(cuda: str, name: str) -> str:
    """Takes the device branch of every __CUDA_ARCH__ condition (the emulation is sm_80+)."""
    forms = {
        "#ifdef __CUDA_ARCH__": "#if 1",
        "#ifndef __CUDA_ARCH__": "#if 0",
        "#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800": "#if 1",
        "#elif defined(__CUDA_ARCH__)": "#elif 1",
    }
    lines = cuda.split("\n")
    for i, line in enumerate(lines):
        if "__CUDA_ARCH__" in line and line.lstrip().startswith("#"):
            stripped = line.strip()
            if stripped not in forms:
                fail(f"{name}:{i + 1}: unknown __CUDA_ARCH__ condition {stripped!r}; add it to device_pass")
            lines[i] = forms[stripped]
    return "\n".join(lines)


def shared_arrays(cuda: str, name: str) -> str:
    """`__shared__ [__align__(A)] T name[dims];` -> `auto& name = emu::shared<T[dims], A, id>();`."""
    pattern = re.compile(r"__shared__\s+(?:__align__\((\d+)\)\s+)?([^;=()]*?)\s*\b(\w+)\s*((?:\[[^\]]+\]\s*)*);")
    count = 0

    def replace(match: re.Match) -> str:
        nonlocal count
        count += 1
        align, type_, var, dims = match.group(1) or "1", match.group(2), match.group(3), match.group(4).strip()
        return f"auto& {var} = emu::shared<{type_}{dims}, {align}, {count}>();"

    out = pattern.sub(replace, cuda)
    if "__shared__" in out:
        line = out[:out.index("__shared__")].count("\n") + 1
        fail(f"{name}:{line}: a __shared__ declaration that shared_arrays does not read (extern, initialized, "
             "or several names); update the rewrite")
    return out


def launches(cuda: str, name: str, bounds: dict[str, str]) -> tuple[str, set[str]]:
    """Every `kernel<<<grid, block, ...>>>(args);` becomes an emu::launch; returns the
    text and the kernels launched."""
    out, pos, launched = [], 0, set()
    for match in re.finditer(r"<<<", cuda):
        start = match.start()
        if start < pos:
            continue
        line = cuda.rfind("\n", 0, start) + 1
        name_at = line + len(cuda[line:start]) - len(cuda[line:start].lstrip())
        kernel = cuda[name_at:start]
        base = re.match(r"(\w+)", kernel)
        if base is None or base.group(1) not in bounds:
            fail(f"{name}: a launch of {kernel!r}, which is not a __global__ function of the file")
        close = cuda.index(">>>", start)
        config = split_top(cuda[start + 3:close])
        if len(config) < 2 or len(config) > 4:
            fail(f"{name}: unexpected launch configuration near {cuda[name_at:close + 3]!r}")
        grid, block = config[:2]
        shared = config[2] if len(config) > 2 else "0"
        if cuda[close + 3] != "(":
            fail(f"{name}: unexpected launch syntax near {cuda[name_at:close + 10]!r}")
        depth, end = 0, close + 3
        while True:
            depth += cuda[end] == "("
            depth -= cuda[end] == ")"
            if depth == 0:
                break
            end += 1
        if cuda[end + 1] != ";":
            fail(f"{name}: a launch that is not a statement near {cuda[name_at:end + 10]!r}")
        launched.add(base.group(1))
        out += [cuda[pos:name_at],
                f"emu::launch(emu::kernel_name<&{kernel}>(), {bounds[base.group(1)]}, dim3({grid}), dim3({block}), "
                f"{shared}, [&] {{ {kernel}({cuda[close + 4:end]}); }});" + "\n" * cuda[start:close].count("\n")]
        pos = end + 2
    return "".join(out) + cuda[pos:], launched


def host_source(cuda: str, name: str, stem: str) -> str:
    """The kernel file as host C++ for the emulation."""
    for old, new in REWRITES.get(stem, []):
        if old not in cuda:
            fail(f"{name} no longer contains {old!r}; update REWRITES")
        cuda = cuda.replace(old, new)
    bounds = kernels_of(cuda)
    cuda = device_pass(cuda, name)
    cuda = shared_arrays(cuda, name)
    cuda, launched = launches(cuda, name, bounds)
    never = sorted(set(bounds) - launched)
    if never:
        fail(f"{name}: kernels {never} are never launched with <<<>>> in the file, so nothing can run them")
    for token in ("<<<", "__CUDA_ARCH__", "__shared__"):
        if token in cuda:
            fail(f"{name}: {token} left after the rewrite; update run.py")
    return f'#line 1 "{name}"\n' + cuda


def kernel_files() -> dict[str, str]:
    """stem -> path of every csrc/cuda file that defines a kernel; fails for one without a check program."""
    found = {}
    for entry in sorted(os.listdir(KERNEL_DIR)):
        if not entry.endswith((".cu", ".cuh")):
            continue
        with open(os.path.join(KERNEL_DIR, entry)) as f:
            if not re.search(r"\b__global__\b", f.read()):
                continue
        stem = entry.rsplit(".", 1)[0]
        if not os.path.exists(os.path.join(HERE, f"{stem}_check.cpp")):
            fail(f"csrc/cuda/{entry} defines CUDA kernels but tools/cuda_emulation/{stem}_check.cpp does not exist: "
                 "write a check program for it (see es_cuda_check.cpp) and list its CPU twins in TWINS")
        if stem not in TWINS or stem not in CASES or stem not in TSAN_CASES:
            fail(f"csrc/cuda/{entry}: add it to TWINS (its CPU twins, or []), CASES and TSAN_CASES in run.py")
        found[stem] = os.path.join(KERNEL_DIR, entry)
    return found


def has_fma() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return re.search(r"^flags\s*:.*\bfma\b", f.read(), re.MULTILINE) is not None
    except OSError:
        return False


# Deliberate bugs for --plant / --self-test, each (file stem, text, replacement,
# the detectors that must report it): proof that every detector works.
PLANTS = {
    "transpose-store-off-by-one": (
        "layout_cuda", "if (i < count) store_vector(to + i, values[j]);",
        "if (i <= count) store_vector(to + i, values[j]);", ["asan"]),
    "transpose-width-ignores-pointers": (
        "layout_cuda", "plan.width = widest_width(dst | src | chunk_bytes);",
        "plan.width = widest_width(chunk_bytes);", ["ubsan"]),
    "scan-upsweep-without-syncthreads": (
        "moe_cuda", "        stride *= 2;\n        __syncthreads();\n", "        stride *= 2;\n", ["orders", "tsan"]),
    "scan-reads-unwritten-shared": (
        "moe_cuda", "sums[i] = i < n ? counts[first + i] : 0;", "if (i < n) sums[i] = counts[first + i];",
        ["orders", "cpu"]),
    "scan-syncthreads-in-divergent-code": (
        "moe_cuda", "if (tid == 0) sums[kScanChunk - 1] = 0;\n      __syncthreads();",
        "if (tid == 0) {\n        sums[kScanChunk - 1] = 0;\n        __syncthreads();\n      }", ["deadlock"]),
    "histogram-plain-add": (
        "moe_cuda", "atomicAdd(&tile_counts[expert * tiles + w], static_cast<unsigned long long>(__popc(same)));",
        "tile_counts[expert * tiles + w] += static_cast<unsigned long long>(__popc(same));", ["tsan"]),
    "assign-without-second-syncwarp": (
        "moe_cuda", "      __syncwarp();  // and the advance is visible to the next step\n", "", ["tsan"]),
    "gate-columns-without-second-syncthreads": (
        "gating_cuda", "    __syncthreads();  // the lanes' arrays are reused for the next expert\n", "",
        ["orders", "tsan", "cpu"]),
}
# What each detector prints.
DETECTORS = {
    "asan": "ERROR: AddressSanitizer",
    "ubsan": "runtime error:",
    "tsan": "WARNING: ThreadSanitizer",
    "orders": "differs between two thread orders",
    "deadlock": "deadlock in block",
    "cpu": "differs from the CPU",
}


class Build:
    """Compiles and runs check programs; objects are reused within one Build (--self-test)."""

    def __init__(self, args: argparse.Namespace, directory: str):
        self.args = args
        self.dir = directory
        self.cxx = os.environ.get("CXX", "g++")
        # -O1 contracts only with -fexpensive-optimizations.
        self.contract = (["-ffp-contract=fast", "-mfma", "-fexpensive-optimizations"] if has_fma()
                         else ["-ffp-contract=off"])
        self.done: dict[str, str] = {}  # object -> the command and source that made it

    def compile_one(self, item: tuple[str, list[str]]) -> tuple[str, subprocess.CompletedProcess | None]:
        obj, command = item
        with open(command[-3], "rb") as f:
            key = " ".join(command) + hashlib.sha256(f.read()).hexdigest()
        if self.done.get(obj) == key:
            return obj, None
        os.makedirs(os.path.dirname(obj), exist_ok=True)
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        if result.returncode == 0:
            self.done[obj] = key
        return obj, result

    def run(self, files: dict[str, str], plant: str = "", echo: bool = True) -> tuple[int, str]:
        """Builds and runs the check programs of `files`; returns the status and the output."""
        args = self.args
        scale = 10.0 if args.long and args.scale == 1.0 else args.scale
        tsan_scale = args.tsan_scale if args.tsan_scale is not None else (5.0 if args.long else 1.0)
        flavors = ["asan"] + ([] if args.no_tsan else ["tsan"])
        log: list[str] = []

        def say(text: str) -> None:
            log.append(text)
            if echo:
                sys.stdout.write(text)
                sys.stdout.flush()

        began = time.monotonic()
        compiles: dict[str, list[str]] = {}  # object -> command
        links: dict[tuple[str, str], list[str]] = {}  # (stem, flavor) -> objects
        for stem, path in files.items():
            with open(path) as f:
                cuda = f.read()
            if plant:
                plant_stem, old, new, _ = PLANTS[plant]
                if plant_stem == stem:
                    if old not in cuda:
                        fail(f"--plant {plant}: {path} no longer contains {old!r}; update PLANTS")
                    cuda = cuda.replace(old, new, 1)
            host = os.path.join(self.dir, f"{stem}_host.cpp")
            with open(host, "w") as f:
                f.write(host_source(cuda, os.path.relpath(path, ROOT), stem))
            for flavor in flavors:
                units = [(host, [*self.contract, "-D__CUDA_ARCH__=800"]),
                         (os.path.join(HERE, f"{stem}_check.cpp"), ["-ffp-contract=off"])]
                units += [(os.path.join(ROOT, "csrc", twin), ["-ffp-contract=off"]) for twin in TWINS[stem]]
                objects = []
                for unit, extra in units:
                    relative = os.path.relpath(unit, ROOT if unit.startswith(ROOT) else self.dir)
                    obj = os.path.join(self.dir, flavor, relative.rsplit(".", 1)[0] + ".o")
                    compiles[obj] = [self.cxx, *COMMON_FLAGS, *SANITIZERS[flavor], *extra, "-c", unit, "-o", obj]
                    objects.append(obj)
                # The check program first: its copies of shared inline functions (no FMA) win.
                links[(stem, flavor)] = [objects[1], objects[0], *objects[2:]]

        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            for obj, result in pool.map(self.compile_one, compiles.items()):
                if result is not None and result.returncode != 0:
                    sys.stderr.write(result.stdout + result.stderr)
                    fail(f"compiling {obj} failed: {' '.join(compiles[obj])}")
            binaries = {}
            for (stem, flavor), objects in links.items():
                binary = os.path.join(self.dir, flavor, f"{stem}_check")
                result = subprocess.run([self.cxx, *SANITIZERS[flavor], "-pthread", *objects, "-o", binary],
                                        capture_output=True, text=True, check=False)
                if result.returncode != 0:
                    sys.stderr.write(result.stdout + result.stderr)
                    fail(f"linking {binary} failed")
                binaries[(stem, flavor)] = binary
            say(f"run.py: compiled {len(compiles)} units and linked {len(binaries)} programs in "
                f"{time.monotonic() - began:.0f} s\n")

            def run_one(key: tuple[str, str]) -> tuple[tuple[str, str], subprocess.CompletedProcess, float]:
                stem, flavor = key
                count = (CASES if flavor == "asan" else TSAN_CASES)[stem] * (scale if flavor == "asan" else tsan_scale)
                env = dict(os.environ)
                env.setdefault("TSAN_OPTIONS", "halt_on_error=1 second_deadlock_stack=1")
                # --long also finds references to dead stack frames (5-10x slower).
                env.setdefault("ASAN_OPTIONS", f"detect_leaks=1:detect_stack_use_after_return={int(args.long)}")
                start = time.monotonic()
                result = subprocess.run([binaries[key], str(max(1, round(count))), str(args.seed)],
                                        capture_output=True, text=True, check=False, env=env)
                return key, result, time.monotonic() - start

            status = 0
            # Longest first, so that the parallel runs end together.
            order = sorted(binaries, key=lambda key: (key[1] != "asan", key[0] != "moe_cuda"))
            for (stem, flavor), result, seconds in pool.map(run_one, order):
                say(f"--- {stem} ({flavor}), {seconds:.0f} s\n{result.stdout}{result.stderr}")
                problems = []
                if result.returncode != 0:
                    problems.append(f"exit status {result.returncode}")
                ran = {re.sub(r"<.*", "", line.split()[1].rstrip(":")) for line in result.stdout.splitlines()
                       if line.startswith("kernel ")}
                with open(files[stem]) as f:
                    defined = set(kernels_of(f.read()))
                if defined - ran and result.returncode == 0:
                    problems.append(f"kernels never run: {sorted(defined - ran)}")
                if problems:
                    say(f"run.py: {stem} ({flavor}) FAILED: {'; '.join(problems)}\n")
                    status = 1
        say(f"run.py: {'FAILED' if status else 'passed'} in {time.monotonic() - began:.0f} s\n")
        return status, "".join(log)


def self_test(build: Build, files: dict[str, str]) -> int:
    """Plants every bug of PLANTS in turn; each must fail the run, reported by its detectors."""
    status = 0
    for name, (stem, _, _, expected) in PLANTS.items():
        if stem not in files:  # --only left its kernel file out
            continue
        code, text = build.run({stem: files[stem]}, plant=name, echo=False)
        fired = [label for label, marker in DETECTORS.items() if marker in text]
        caught = code != 0 and all(label in fired for label in expected)
        print(f"run.py: plant {name}: {'caught' if caught else 'MISSED'} (reported by {', '.join(fired) or 'none'}; "
              f"expected {', '.join(expected)})", flush=True)
        status |= not caught
    return status


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies every program's case count")
    parser.add_argument("--tsan-scale", type=float, default=None, help="the same for the ThreadSanitizer build")
    parser.add_argument("--long", action="store_true", help="--scale 10 --tsan-scale 5, and ASan's use-after-return")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--only", default="",
                        help="comma-separated stems (es_cuda,fp8_cuda,gating_cuda,layout_cuda,"
                             "low_latency_cuda,moe_cuda)")
    parser.add_argument("--no-tsan", action="store_true", help="skip the ThreadSanitizer build")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--keep", default="", help="build in this directory and keep it (the programs stay there)")
    parser.add_argument("--plant", choices=sorted(PLANTS), help="run with this deliberate bug in the kernel file")
    parser.add_argument("--self-test", action="store_true", help="every --plant in turn: each must be reported")
    args = parser.parse_args()

    files = kernel_files()
    if args.only:
        wanted = args.only.split(",")
        unknown = sorted(set(wanted) - set(files))
        if unknown:
            fail(f"--only: no kernel file {unknown}; there are {sorted(files)}")
        files = {stem: path for stem, path in files.items() if stem in wanted}
    with tempfile.TemporaryDirectory(prefix="cuda_emulation.") as scratch:
        directory = os.path.abspath(args.keep) if args.keep else scratch
        os.makedirs(directory, exist_ok=True)
        build = Build(args, directory)
        if args.self_test:
            return self_test(build, files)
        return build.run(files, plant=args.plant or "")[0]


if __name__ == "__main__":
    sys.exit(main())
