"""The package surface: config(), paths for C/C++/CMake users, docstrings, errors."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import shutil
import subprocess

import pytest

import a2a
from a2a import _errors


def test_config_reports_what_was_built():
    cfg = a2a.config()
    for key in ("version", "mpi", "cuda", "nccl", "cuda_archs", "library"):
        assert key in cfg, f"a2a.config() lacks {key!r}: {cfg}"
    assert cfg["mpi"] is True
    assert isinstance(cfg["cuda"], bool) and isinstance(cfg["nccl"], bool)
    if cfg["nccl"]:
        assert cfg["cuda"], "NCCL is built only with CUDA"
        assert cfg["nccl_version"].count(".") == 2, cfg
    if cfg["cuda"]:
        assert cfg["cuda_archs"] and all(arch.isdigit() for arch in cfg["cuda_archs"]), cfg
    else:
        assert cfg["cuda_archs"] == []
    assert cfg["version"] == a2a.__version__
    assert os.path.isdir(cfg["library"]), cfg["library"]


def test_cuda_is_built_wherever_nvcc_is_found():
    # The build compiles the CUDA kernels when nvcc is on PATH (A2A_WITH_CUDA=AUTO); CI relies on
    # this to compile them on every run.
    if shutil.which("nvcc") is None or os.environ.get("A2A_WITH_CUDA", "").upper() in ("0", "OFF"):
        pytest.skip("no nvcc on PATH, or CUDA switched off")
    assert a2a.config()["cuda"] is True, a2a.config()


def test_nccl_is_built_wherever_ci_asks_for_it():
    # .ci/run sets A2A_WITH_NCCL=1 wherever nvcc is found and tools/bootstrap.sh installs
    # nvidia-nccl-cu13 there, so CI compiles the NCCL transport on every run.
    if os.environ.get("A2A_WITH_NCCL", "").upper() not in ("1", "ON"):
        pytest.skip("A2A_WITH_NCCL is not set to 1")
    assert a2a.config()["nccl"] is True, a2a.config()


def _exported_symbols(path: str) -> list[str]:
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("no nm (binutils) on PATH")
    out = subprocess.run([nm, "-D", "--defined-only", path], capture_output=True, text=True, check=True).stdout
    return [line.split()[-1] for line in out.splitlines() if line.strip()]


def test_the_native_files_export_their_interface_alone():
    # An exported copy of a C++ runtime symbol (std::locale from a static libstdc++, seen on the
    # first GPU machine) replaces the process's own for every library loaded later: torch's
    # import after a2a's died in free(). cmake/liba2a.map and cmake/module.map hold them back.
    library = os.path.join(a2a.config()["library"], "liba2a.so")
    leaked = [name for name in _exported_symbols(library) if not name.startswith("a2a_")]
    assert not leaked, f"{library} exports more than the C ABI: {leaked[:10]}"
    module = a2a._C.__file__
    leaked = [name for name in _exported_symbols(module) if name != "PyInit__C"]
    assert not leaked, f"{module} exports more than PyInit__C: {leaked[:10]}"


def test_config_returns_a_fresh_dict():
    cfg = a2a.config()
    cfg["mpi"] = "changed"
    assert a2a.config()["mpi"] is True


def test_get_include_holds_the_c_header():
    include = a2a.get_include()
    assert os.path.isabs(include)
    header = os.path.join(include, "a2a", "a2a.h")
    assert os.path.isfile(header), f"{header} is missing"
    with open(header) as f:
        text = f.read()
    for symbol in ("a2a_all_to_all", "a2a_all_to_all_flex", "a2a_v_plan_create", "a2a_comm_create_mpi"):
        assert symbol in text


def test_get_include_holds_the_cpp_header():
    assert os.path.isfile(os.path.join(a2a.get_include(), "a2a", "a2a.hpp"))


def test_get_cmake_dir_holds_the_package_config():
    cmake_dir = a2a.get_cmake_dir()
    assert os.path.isabs(cmake_dir)
    assert os.path.isfile(os.path.join(cmake_dir, "a2aConfig.cmake")), os.listdir(cmake_dir)


def test_version_string():
    parts = a2a.__version__.split(".")
    assert len(parts) == 3 and all(p.isdigit() for p in parts)


def test_algorithms():
    assert set(a2a.ALGORITHMS) == {"linear", "2dh"}


def test_all_names_exist():
    for name in a2a.__all__:
        assert hasattr(a2a, name), name


def public_objects():
    """(name, object) of everything a2a exports (and a2a.launch, and a2a.torch
    where torch is installed), and the public methods and properties that
    its classes define themselves."""
    modules = [a2a, importlib.import_module("a2a.launch")]
    if importlib.util.find_spec("torch") is not None:
        modules.append(importlib.import_module("a2a.torch"))
    for module in modules:
        for name in module.__all__:
            obj = getattr(module, name)
            yield f"{module.__name__}.{name}", obj
            if inspect.isclass(obj):
                for member, value in vars(obj).items():
                    if not member.startswith("_") and (callable(value) or isinstance(value, (property, classmethod))):
                        yield f"{module.__name__}.{name}.{member}", value


@pytest.mark.parametrize("name, obj", list(public_objects()), ids=lambda v: v if isinstance(v, str) else "")
def test_public_objects_have_docstrings(name, obj):
    if not (callable(obj) or inspect.isclass(obj) or isinstance(obj, (property, classmethod))):
        # Data (ALGORITHMS, REDUCE_OPS): described in the package docstring.
        assert f"``{name.rpartition('.')[2]}``" in a2a.__doc__, f"{name} is not described in a2a's docstring"
        return
    doc = obj.__doc__  # its own, not one inherited from a base class
    assert doc and len(doc.strip()) > 10, f"{name} has no docstring"


def test_module_docstring():
    assert a2a.__doc__ and "all_to_all" in a2a.__doc__


@pytest.mark.parametrize("fn", [a2a.all_to_all, a2a.all_to_all_flex, a2a.all_to_all_v], ids=lambda f: f.__name__)
def test_collectives_take_keyword_only_comm_and_algo(fn):
    params = inspect.signature(fn).parameters
    for name in ("comm", "algo", "out"):
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY, name
    assert params["algo"].default == "linear"
    assert params["out"].default is None


# ---------------------------------------------------------------------------
# Exceptions


def test_error_hierarchy():
    for cls in (
        a2a.InvalidArgumentError,
        a2a.MismatchError,
        a2a.A2ATimeoutError,
        a2a.TransportError,
        a2a.UnsupportedError,
        a2a.RemoteError,
    ):
        assert issubclass(cls, a2a.A2AError)
    assert issubclass(a2a.A2AError, RuntimeError)
    # Bad input is a ValueError, a timeout is a TimeoutError: plain `except`s work.
    assert issubclass(a2a.InvalidArgumentError, ValueError)
    assert issubclass(a2a.MismatchError, ValueError)
    assert issubclass(a2a.A2ATimeoutError, TimeoutError)
    assert not issubclass(a2a.RemoteError, ValueError)


def test_status_codes_match_the_c_header():
    header = os.path.join(a2a.get_include(), "a2a", "a2a.h")
    with open(header) as f:
        text = f.read()
    expected = {
        a2a.InvalidArgumentError: "A2A_ERROR_INVALID_ARGUMENT = 1",
        a2a.MismatchError: "A2A_ERROR_MISMATCH = 2",
        a2a.A2ATimeoutError: "A2A_ERROR_TIMEOUT = 3",
        a2a.TransportError: "A2A_ERROR_TRANSPORT = 4",
        a2a.UnsupportedError: "A2A_ERROR_UNSUPPORTED = 5",
        a2a.RemoteError: "A2A_ERROR_REMOTE = 6",
    }
    for cls, line in expected.items():
        assert line in text
        assert cls.status == int(line.rsplit(" ", 1)[1])


@pytest.mark.parametrize("status", range(1, 8))
def test_from_status_builds_the_matching_class(status):
    error = _errors.from_status(status, f"message {status}")
    assert isinstance(error, a2a.A2AError)
    assert error.status == status
    assert str(error) == f"message {status}"
    if status == 7:
        assert type(error) is a2a.A2AError


def test_from_status_unknown_code_is_a_generic_error():
    error = _errors.from_status(99, "odd")
    assert type(error) is a2a.A2AError
    assert error.status == 99


def test_dtype_codes_match_the_c_header():
    from a2a import _arrays

    header = os.path.join(a2a.get_include(), "a2a", "a2a.h")
    with open(header) as f:
        text = f.read()
    for name, code in _arrays.DTYPE_CODES.items():
        assert f"A2A_{name.upper()} = {code}" in text, name
