"""The GPU-facing API where no GPU is needed: argument checks of the CUDA
communicators, their errors on a machine without a GPU or without NCCL, the
DLPack reader, and the benchmark's --device flags."""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import a2a
from a2a import _C
from a2a.bench import collectives as bench_module


def _gpu_present() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"device": "gpu"}, "device must be one of"),
        ({"transport": "nccl"}, "device='cuda'"),
        ({"device": "cuda", "transport": "ucx"}, "transport must be one of"),
    ],
)
def test_bad_device_or_transport(kwargs, match):
    with pytest.raises(ValueError, match=match):
        a2a.Comm.from_mpi(MPI.COMM_SELF, **kwargs)


def test_cuda_comm_without_a_gpu_is_unsupported():
    if _gpu_present():
        pytest.skip("a GPU is present (tests/gpu covers CUDA communicators)")
    for transport in ("mpi", "nccl"):
        with pytest.raises(a2a.UnsupportedError) as info:
            a2a.Comm.from_mpi(MPI.COMM_SELF, device="cuda", transport=transport)
        message = str(info.value)
        assert "rank 0" in message
        assert "CUDA" in message, message


def test_nccl_unique_id_is_128_bytes_or_unsupported():
    if not a2a.config()["nccl"]:
        with pytest.raises(a2a.UnsupportedError, match="without NCCL"):
            _C.nccl_unique_id()
        return
    try:
        uid = _C.nccl_unique_id()
    except (a2a.TransportError, a2a.UnsupportedError) as error:  # no network interface NCCL likes
        pytest.skip(f"ncclGetUniqueId failed here: {error}")
    assert isinstance(uid, bytes) and len(uid) == 128


def test_nccl_comm_rejects_a_bad_id_or_rank():
    with pytest.raises(ValueError, match="128 bytes"):
        _C.Comm.from_nccl_id(b"short", 1, 0)
    with pytest.raises(a2a.InvalidArgumentError, match="rank 3 is not in"):
        _C.Comm.from_nccl_id(bytes(128), 2, 3)


def test_from_torch_needs_an_initialized_process_group():
    torch = pytest.importorskip("torch")
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        pytest.skip("a process group is already initialized")
    with pytest.raises(RuntimeError, match="init_process_group"):
        a2a.Comm.from_torch()


def test_host_comm_reports_its_device():
    comm = a2a.Comm.from_mpi(MPI.COMM_SELF)
    assert (comm.device, comm.transport, comm.cuda_device) == ("cpu", "mpi", None)
    assert "device=cpu, transport=mpi" in repr(comm)


# ---------------------------------------------------------------------------
# DLPack


def test_dlpack_view_of_a_numpy_array():
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    address, shape, contiguous, code, bits, lanes, device_type, device_id = _C.dlpack_view(x.__dlpack__())
    assert (address, shape, contiguous) == (x.ctypes.data, (3, 4), True)
    assert (code, bits, lanes, device_type, device_id) == (2, 32, 1, 1, 0)


def test_dlpack_view_sees_strides_and_offsets():
    x = np.arange(24, dtype=np.int64).reshape(4, 6)[1:, ::2]
    address, shape, contiguous, code, bits, *_ = _C.dlpack_view(x.__dlpack__())
    assert address == x.ctypes.data and shape == (3, 3) and contiguous is False
    assert (code, bits) == (0, 64)


def test_dlpack_view_of_a_torch_bfloat16_tensor():
    torch = pytest.importorskip("torch")
    t = torch.zeros(5, 2, dtype=torch.bfloat16)
    address, shape, contiguous, code, bits, *_ = _C.dlpack_view(t.__dlpack__())
    assert (address, shape, contiguous, code, bits) == (t.data_ptr(), (5, 2), True, 4, 16)


def test_dlpack_view_refuses_other_objects():
    with pytest.raises((ValueError, TypeError)):
        _C.dlpack_view(object())


# ---------------------------------------------------------------------------
# The benchmark's --device flags


def test_bench_transport_needs_device_cuda(capsys):
    with pytest.raises(SystemExit):
        bench_module.parse_args(["--transport", "mpi"])
    assert "needs --device cuda" in capsys.readouterr().err


def test_bench_device_cuda_defaults():
    args = bench_module.parse_args(["--device", "cuda"])
    assert (args.transport, args.baselines) == ("nccl", ["d2d"])
    assert bench_module.parse_args([]).baselines == ["mpi"]
    assert "vs D2D" in bench_module.header_lines(["d2d"])[1]
    assert "vs MPI" in bench_module.header_lines()[1]


FROM_TORCH_SCRIPT = """
import torch.distributed as dist
import a2a
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
try:
    a2a.Comm.from_torch(cuda_device=0)
except a2a.UnsupportedError as error:
    print("UnsupportedError:", error)
except RuntimeError as error:
    print("RuntimeError:", error)
finally:
    # gloo's threads must be joined before exit, or their destructors may
    # call std::terminate ("terminate called without an active exception").
    dist.destroy_process_group()
"""


def test_from_torch_bootstraps_until_the_device():
    # On a machine without a GPU, from_torch runs the id broadcast and the
    # host gather over a 1-rank gloo group, then stops at the CUDA device
    # (or, in a build without NCCL, at the unique id) with a clear error.
    pytest.importorskip("torch")
    if _gpu_present():
        pytest.skip("a GPU is present (tests/gpu covers from_torch)")
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-c", FROM_TORCH_SCRIPT], check=False, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    if a2a.config()["nccl"]:
        assert result.stdout.startswith("UnsupportedError:") and "CUDA" in result.stdout, result.stdout
    else:
        assert "could not create a NCCL unique id" in result.stdout, result.stdout


WORLD_AGAIN_SCRIPT = """
import torch
import torch.distributed as dist
from a2a import _comm

real = dist.get_backend
# The world stands for a NCCL-only one (no GPU here): its control group is then made beside it.
dist.get_backend = lambda group=None: "nccl" if group is dist.group.WORLD else real(group)
for world in range(2):  # a second world after destroy_process_group(), as test runners and notebooks make
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    control = _comm._control_group(dist.group.WORLD, None)
    assert _comm._control_group(dist.group.WORLD, None) is control  # made once per world
    ones = torch.ones(2)
    dist.all_reduce(ones, group=control)  # a group of this world, not the destroyed one
    print(world, real(control), ones.tolist())
    dist.destroy_process_group()
"""


def test_the_world_control_group_is_made_again_for_a_new_world():
    """from_torch's gloo group beside a NCCL world: after destroy_process_group() and a new
    init_process_group(), a group of the new world, not the destroyed one."""
    pytest.importorskip("torch")
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", WORLD_AGAIN_SCRIPT], check=False, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:2] == ["0 gloo [1.0, 1.0]", "1 gloo [1.0, 1.0]"], result.stdout
