"""Types of a2a._C, the pybind11 module over liba2a (csrc/python/module.cpp).

Buffers cross as raw addresses (int) that the Python layer keeps alive for
the call; dtypes, algorithms, reduce ops and device types are the integer
codes of a2a/a2a.h. tests/unit/test_typing.py checks that this file names
exactly what the module exports.
"""

from typing import Any, TypeAlias

import numpy as np

# (device type, cudaStream_t, threads) of a2a_exec_t: (0, 0, 0) is the CPU.
_Exec: TypeAlias = tuple[int, int, int]
# a2a_routing_t: (num_tokens, top_k, num_experts, indices, index dtype,
# locations, counts, expert_offsets, capacity (-1: dropless), num_rows).
_RoutingFields: TypeAlias = tuple[int, int, int, int, int, int, int, int, int, int]

UNDEFINED: int
"""A2A_UNDEFINED: the color of a rank that joins no communicator in Comm.split."""

def build_config() -> str:
    """a2a_build_config(): "key=value;..." (version, mpi, cuda, nccl, ...)."""

def process_counters() -> dict[str, int]:
    """a2a_counters(NULL): the process's counters by name (a2a.Counters' fields)."""

def numpy_layout(array: np.ndarray, /) -> tuple[int, bool, bool]:
    """(address, C-contiguous, writeable) of a NumPy array."""

def dtype_size(dtype: int, /) -> int:
    """Bytes per element of an a2a_dtype_t (0 for an unknown code)."""

def dlpack_view(capsule: Any, /) -> tuple[int, tuple[int, ...], bool, int, int, int, int, int]:
    """(address, shape, C-contiguous, type code, bits, lanes, device type,
    device id) of an unconsumed "dltensor" capsule."""

def nccl_unique_id() -> bytes:
    """A new NCCL unique id (UnsupportedError in builds without NCCL)."""

def route_workspace_size(exec: _Exec, num_tokens: int, top_k: int, num_experts: int, /) -> int: ...
def route(
    exec: _Exec,
    comm: Comm | None,
    indices: int,
    index_dtype: int,
    num_tokens: int,
    top_k: int,
    num_experts: int,
    token_order: int,
    capacity: int,
    capacity_setting: float,
    workspace: int,
    workspace_bytes: int,
    locations: int,
    counts: int,
    offsets: int,
    host_counts: int,
) -> tuple[int, int, int]:
    """a2a_route_host_counts: fills locations, counts and offsets, and host_counts (E int64, host) with a copy
    of counts; returns (capacity, num_rows, num_dropped)."""

def route_capacities(
    exec: _Exec,
    comm: Comm | None,
    indices: int,
    index_dtype: int,
    num_tokens: int,
    top_k: int,
    num_experts: int,
    token_order: int,
    capacities: list[int],
    workspace: int,
    workspace_bytes: int,
    locations: int,
    counts: int,
    offsets: int,
) -> tuple[int, int, list[int]]:
    """a2a_route_capacities: fills locations, counts and offsets; returns
    (num_rows, num_dropped, the per-expert capacities agreed across ranks)."""

def route_fixed(
    exec: _Exec,
    indices: int,
    index_dtype: int,
    num_tokens: int,
    top_k: int,
    num_experts: int,
    token_order: int,
    capacity: int,
    workspace: int,
    workspace_bytes: int,
    locations: int,
    counts: int,
    offsets: int,
    /,
) -> None:
    """a2a_route_fixed: fills locations, counts and offsets at one capacity (or packed: -1); reads nothing back."""

def route_fixed_dropped(exec: _Exec, num_tokens: int, top_k: int, num_experts: int, workspace: int,
                        workspace_bytes: int, /) -> int:
    """a2a_route_fixed_dropped: the dropped choices a route_fixed left in `workspace` (waits for the device)."""

def moe_dispatch(
    exec: _Exec,
    routing: _RoutingFields,
    x: int,
    dtype: int,
    model_dim: int,
    gates: int,
    gate_dtype: int,
    rows: int,
    /,
) -> None: ...
def moe_combine(
    exec: _Exec,
    routing: _RoutingFields,
    rows: int,
    dtype: int,
    model_dim: int,
    gates: int,
    gate_dtype: int,
    y: int,
    /,
) -> None: ...
def moe_gate_grad(
    exec: _Exec,
    routing: _RoutingFields,
    tokens: int,
    rows: int,
    dtype: int,
    model_dim: int,
    gate_dtype: int,
    grad_gates: int,
    /,
) -> None: ...
# The expert-specific operators. An index travels as (num_tokens, top_k,
# num_experts, tile, num_slots, slots, expert_starts, counts); a2a_es_rows_t
# and a2a_es_weight_layout_t are ints.
_EsIndexFields: TypeAlias = tuple[int, int, int, int, int, int, int, int]

# (rows, cols, block, format, q, q_stride, scales, scale_stride): a2a_fp8_rows_t.
_Fp8Rows: TypeAlias = tuple[int, int, int, int, int, int, int, int]

def fp8_packed_layout(cols: int, block: int, /) -> tuple[int, int]:
    """a2a_fp8_packed_layout: (scale_offset, row_bytes) of packed FP8 rows."""

_Gate: TypeAlias = tuple[int, int, int, bool, int]  # (T, E, k, normalize, dtype code)

def top_k_gate_workspace_size(gate: _Gate, /) -> int: ...
def top_k_gate(exec: _Exec, gate: _Gate, logits: int, scores: int, indices: int, gates: int, share: int, l_aux: int,
               workspace: int, /) -> None: ...
def top_k_gate_backward(exec: _Exec, gate: _Gate, scores: int, indices: int, share: int, d_gates: int, d_l_aux: int,
                        d_logits: int, /) -> None: ...
def quantize_fp8(exec: _Exec, x: int, dtype: int, rows: _Fp8Rows, /) -> None: ...
def dequantize_fp8(exec: _Exec, rows: _Fp8Rows, dtype: int, y: int, /) -> None: ...

def es_index_capacity(num_tokens: int, top_k: int, num_experts: int, tile: int, /) -> int:
    """a2a_es_index_capacity: the most slots a routing can need."""

def es_index_workspace_size(exec: _Exec, num_tokens: int, top_k: int, num_experts: int, /) -> int: ...
def es_index(
    exec: _Exec,
    indices: int,
    index_dtype: int,
    num_tokens: int,
    top_k: int,
    num_experts: int,
    tile: int,
    workspace: int,
    workspace_bytes: int,
    slots: int,
    max_slots: int,
    expert_starts: int,
    counts: int,
    /,
) -> int:
    """a2a_es_index: fills slots, expert_starts and counts; returns num_slots."""

def esmm_workspace_size(index: _EsIndexFields, y_rows: int, n: int, dtype: int, /) -> int: ...
def esmm(
    exec: _Exec,
    index: _EsIndexFields,
    x: int,
    x_rows: int,
    k: int,
    w: int,
    w_layout: int,
    bias: int,
    gates: int,
    gate_dtype: int,
    dtype: int,
    n: int,
    y: int,
    y_rows: int,
    workspace: int,
    workspace_bytes: int,
    /,
) -> None: ...
def ess(
    exec: _Exec,
    index: _EsIndexFields,
    x: int,
    x_rows: int,
    gates: int,
    gate_dtype: int,
    dtype: int,
    n: int,
    out: int,
    /,
) -> None: ...
def estmm(
    exec: _Exec,
    index: _EsIndexFields,
    a: int,
    a_rows: int,
    a_dim: int,
    b: int,
    b_rows: int,
    b_dim: int,
    gates: int,
    gate_dtype: int,
    dtype: int,
    out: int,
    /,
) -> None: ...
def testing_comm_create_mpi(
    staging: str,
    mpi_comm_address: int,
    local_size: int,
    timeout_s: float,
    use_mpi_datatypes: int,
    device_type: int,
    transport: int,
    cuda_device: int,
    cross_check: int,
    /,
) -> Comm:
    """Tests only: a host communicator whose data ("staged") or control ("control")
    messages go through the staging transports with host copies."""

def testing_comm_create_external_by_round(
    transport: Any, name: str, size: int, rank: int, local_size: int, timeout_s: float, cross_check: int, /
) -> Comm:
    """Tests only: from_transport's communicator checking every call by a round (a2a_testing.h)."""

def transpose_chunks(exec: _Exec, dst: int, src: int, rows: int, cols: int, chunk_bytes: int, /) -> None: ...
def copy_ranges(exec: _Exec, dst: int, src: int, ranges: np.ndarray | list[tuple[int, int, int]], /) -> None:
    """Each (src offset, dst offset, bytes) range copied: (n, 3) C-contiguous
    uint64 rows (or int64 without a negative entry), read in place; a list
    of non-negative triples is converted first."""

class Comm:
    """a2a::Communicator: one a2a_comm_t."""

    def __init__(
        self,
        mpi_comm_address: int,
        local_size: int = 0,
        timeout_s: float = 0.0,
        use_mpi_datatypes: int = -1,
        device_type: int = 0,
        transport: int = 0,
        cuda_device: int = -1,
        cross_check: int = -1,
    ) -> None: ...
    @staticmethod
    def from_transport(
        transport: Any, name: str, size: int, rank: int, local_size: int = 0, timeout_s: float = 0.0,
        cross_check: int = -1
    ) -> Comm:
        """A host communicator over `transport`'s isend / irecv / wait (a2a_comm_create_external)."""
    @staticmethod
    def from_nccl_id(
        id: bytes, size: int, rank: int, local_size: int = 0, timeout_s: float = 0.0, cuda_device: int = -1,
        cross_check: int = -1, control: Any = None, control_name: str = ""
    ) -> Comm:
        """NCCL from a unique id (a2a_comm_create_nccl); with `control` (an object with isend / irecv / wait,
        as from_transport's), its check and host values over that channel (a2a_comm_create_nccl_with_control)."""
    @property
    def device(self) -> tuple[int, int, int]:
        """(device type, transport, CUDA device or -1)."""

    @property
    def mpi_thread_level(self) -> int:
        """MPI_Query_thread's level (MPI_THREAD_SINGLE 0 ... MULTIPLE 3), or -1 without MPI."""

    @property
    def irregular_reason(self) -> str:
        """"" when the nodes are equal blocks of consecutive ranks; else why 2DH refuses (a2a_comm_irregular_reason)."""

    @property
    def cross_check(self) -> bool:
        """Whether collectives check that every rank called them alike (a2a_comm_cross_check)."""

    @property
    def predicts_check(self) -> bool:
        """Whether calls that every rank predicted post their check (a2a_comm_predicts_check)."""

    def check(self) -> None:
        """Completes the posted check of the last call (a2a_comm_check)."""

    def counters(self) -> dict[str, int]:
        """a2a_counters(comm): this communicator's counters by name (a2a.Counters' fields)."""

    @property
    def topology(self) -> tuple[int, int, int, int, int, int]:
        """(rank, size, local_rank, local_size, node, num_nodes)."""

    def split(self, color: int, key: int) -> Comm | None:
        """a2a_comm_split (collective): the new communicator of color, ranked by
        (key, rank); None for color UNDEFINED."""

    def set_stream(self, stream: int, /) -> None: ...
    def report_invalid(self, op: str, message: str, /) -> None:
        """Fails op on every rank (this one: InvalidArgumentError with message)."""

    def all_to_all_workspace_size(self, count: int, dtype: int, algo: int, /) -> int: ...
    def all_to_all(
        self, send: int, recv: int, count: int, dtype: int, algo: int, workspace: int, workspace_bytes: int, /
    ) -> None: ...
    def all_to_all_numpy(
        self, x: np.ndarray, out: Any, algo: int, workspace: np.ndarray, /
    ) -> np.ndarray | None:
        """all_to_all in one call for well-formed NumPy arrays; None: take the general path."""
    def all_to_all_v_numpy(
        self, x: np.ndarray, send_counts: Any, max_count: int, out: Any, algo: int, workspace: np.ndarray, /
    ) -> tuple[np.ndarray | None, np.ndarray, VExchange | None] | None:
        """all_to_all_v in one call for NumPy input and a list of counts: (result, recv_counts, None), or
        (None, recv_counts, the open exchange) when out= or the workspace do not fit; None: unfit input,
        nothing sent."""

    def all_to_all_flex_workspace_size(
        self, shape: list[int], split_axis: int, concat_axis: int, dtype: int, algo: int, /
    ) -> int: ...
    def all_to_all_flex_numpy(
        self, x: np.ndarray, out: Any, split_axis: int, concat_axis: int, algo: int, workspace: np.ndarray, /
    ) -> np.ndarray | None:
        """all_to_all_flex in one call for NumPy arrays (axes in [0, ndim)); None: take the general path."""

    def all_to_all_flex(
        self,
        send: int,
        recv: int,
        shape: list[int],
        split_axis: int,
        concat_axis: int,
        dtype: int,
        algo: int,
        workspace: int,
        workspace_bytes: int,
        /,
    ) -> None: ...
    def all_gather(self, send: int, recv: int, count: int, dtype: int, /) -> None: ...
    def all_reduce(self, send: int, recv: int, count: int, dtype: int, op: int, /) -> None: ...
    def reduce_scatter(self, send: int, recv: int, count: int, dtype: int, op: int, /) -> None: ...
    def all_gather_v(self, send: int, recv: int, counts: list[int], dtype: int, /) -> None: ...
    def reduce_scatter_v(self, send: int, recv: int, counts: list[int], dtype: int, op: int, /) -> None: ...

class LowLatency:
    """a2a::LowLatency: a low-latency dispatch/combine handle (its creation agrees on the config)."""

    def __init__(
        self, comm: Comm, max_tokens: int, num_experts: int, top_k: int, row_bytes: int, model_dim: int, dtype: int, /
    ) -> None: ...
    @property
    def workspace_size(self) -> int: ...
    @property
    def expert_capacity(self) -> int: ...
    def dispatch(
        self, exec: _Exec, workspace: int, workspace_bytes: int, x: int, num_tokens: int, indices: int,
        index_dtype: int, recv: int, recv_counts: int, /,
    ) -> None: ...
    def combine(
        self, exec: _Exec, workspace: int, workspace_bytes: int, expert_out: int, gates: int, gate_dtype: int,
        y: int, /,
    ) -> None: ...
    def check(self, exec: _Exec, workspace: int, workspace_bytes: int, /) -> None: ...

class VExchange:
    """a2a::VExchange: one all-to-all-v in two halves (its creation sends the
    rows and learns the counts; finish receives them)."""

    def __init__(
        self, comm: Comm, send: int, send_counts: list[int], row_elements: int, dtype: int, algo: int
    ) -> None: ...
    @property
    def recv_counts(self) -> list[int]: ...
    @property
    def workspace_size(self) -> int: ...
    def finish(self, recv: int, workspace: int, workspace_bytes: int, /) -> None: ...
    def drop(self) -> None: ...

class VPlan:
    """a2a::VPlan: an all-to-all-v plan (its creation exchanges the counts)."""

    def __init__(
        self, comm: Comm, send_counts: list[int], row_elements: int, dtype: int, algo: int
    ) -> None: ...
    @property
    def recv_counts(self) -> list[int]: ...
    @property
    def workspace_size(self) -> int: ...
    def execute(self, send: int, recv: int, workspace: int, workspace_bytes: int, /) -> None: ...
    def execute_numpy(
        self, x: np.ndarray, out: Any, rows_in: int, rows_out: int, dtype: int, workspace: np.ndarray, /
    ) -> np.ndarray | None:
        """execute in one call for NumPy arrays that fit the plan; None: take the general path."""
