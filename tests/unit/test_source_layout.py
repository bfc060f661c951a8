"""The layering of csrc/ (docs/architecture.md): core/ and moe/ name no backend.

core/ holds the algorithms over the Transport and Device interfaces; moe/ the
MoE host logic over the moe::Kernels interface (it may use setup/ for where
its kernels run). Neither may include a backend
(cpu/, cuda/) or the headers of MPI, NCCL or CUDA, nor name their types: the
backends plug in below the interfaces, and setup/ is the one place that picks
them. core/ also stays below everything else (no moe/, setup/ or python/).
"""

from __future__ import annotations

import os
import re

import pytest

CSRC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "csrc")
SOURCE_SUFFIXES = (".hpp", ".cpp", ".h", ".cu", ".cuh")
INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]', re.MULTILINE)
# Headers of the backends' libraries: MPI, NCCL, the CUDA runtime/driver and its math types.
BACKEND_HEADER = re.compile(
    r"^(mpi[._]|nccl|cuda|cu(blas|fft|rand|sparse|solver)|cub/|thrust/|cooperative_groups|nv|driver_types)"
)
# Names from those libraries' APIs (types, handles, constants), outside comments and strings.
BACKEND_NAME = re.compile(
    r"\b(MPI_[A-Za-z_]+|nccl[A-Z][A-Za-z_]*|cuda[A-Z][A-Za-z_]*|CU[a-z][A-Za-z_]*_t|__half|__nv_bfloat16)\b"
)
COMMENT_OR_STRING = re.compile(r'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'', re.DOTALL)


def sources(folder: str) -> list[str]:
    root = os.path.join(CSRC, folder)
    return sorted(os.path.join(folder, name) for name in os.listdir(root) if name.endswith(SOURCE_SUFFIXES))


def backend_uses(path: str, allowed_folders: tuple[str, ...], root: str = CSRC) -> list[str]:
    with open(os.path.join(root, path)) as f:
        text = f.read()
    problems = []
    for kind, header in INCLUDE.findall(text):
        if kind == "<" and BACKEND_HEADER.match(header):
            problems.append(f"{path}: includes <{header}>")
        if kind == '"' and header != "a2a/a2a.h" and not header.startswith(allowed_folders):
            problems.append(f'{path}: includes "{header}"')
    code = COMMENT_OR_STRING.sub(" ", text)
    code = INCLUDE.sub(" ", code)
    for name in sorted(set(BACKEND_NAME.findall(code))):
        problems.append(f"{path}: names {name}")
    return problems


@pytest.mark.parametrize(
    ("folder", "allowed"),
    [("core", ("core/",)), ("moe", ("core/", "moe/", "setup/"))],
)
def test_folder_names_no_backend(folder, allowed):
    files = sources(folder)
    assert files, f"no sources in csrc/{folder}"
    problems = [problem for path in files for problem in backend_uses(path, allowed)]
    assert not problems, "\n".join(problems)


def test_the_check_catches_what_it_looks_for(tmp_path):
    # The scan itself: a file with each kind of offence is flagged, one that
    # mentions them only in comments and strings is not.
    core = tmp_path / "core"
    core.mkdir()
    (core / "bad.cpp").write_text(
        '#include <mpi.h>\n#include "cpu/cpu_device.hpp"\n#include <cuda_runtime.h>\n'
        "void f(MPI_Comm comm, cudaStream_t stream, ncclComm_t nccl);\n"
    )
    (core / "fine.cpp").write_text(
        '#include <vector>\n#include "core/error.hpp"\n#include "a2a/a2a.h"\n'
        '// waits like MPI_Testall, not cudaStreamSynchronize\nconst char* text = "MPI_Comm_dup failed";\n'
    )
    bad = backend_uses(os.path.join("core", "bad.cpp"), ("core/",), root=str(tmp_path))
    assert len(bad) == 6, bad
    assert backend_uses(os.path.join("core", "fine.cpp"), ("core/",), root=str(tmp_path)) == []
