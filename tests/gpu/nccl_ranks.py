"""One rank of tests/gpu/test_nccl_group_gpu.py (under mpirun, one GPU per
rank: NCCL refuses two ranks on one device): the NCCL transport on a
communicator made over MPI, and on one made from a torch.distributed process
group whose backend is NCCL (Comm.from_torch: the unique id travels by
broadcast_object_list over NCCL itself), every algorithm bitwise against the
host communicator (rank_checks.py); then all_to_all and all_to_all_flex
captured into a CUDA graph on each and replayed. Prints `#wrong N` per case
on rank 0 and exits non-zero on any difference."""

from __future__ import annotations

import socket
import sys

import torch
import torch.distributed as dist
from mpi4py import MPI
from rank_checks import Tally, every_algorithm, graph_replay

import a2a


def nccl_process_group(world) -> None:
    """The default torch.distributed group over NCCL, rank and size from MPI,
    the rendezvous on rank 0's free port."""
    port = None
    if world.rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = world.bcast(port)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=world.rank, world_size=world.size,
                            device_id=torch.device("cuda", torch.cuda.current_device()))


def main() -> int:
    world = MPI.COMM_WORLD
    if world.size > torch.cuda.device_count():
        print(f"nccl_ranks.py: {world.size} ranks but {torch.cuda.device_count()} GPUs; NCCL needs one GPU per rank",
              file=sys.stderr)
        return 2
    torch.cuda.set_device(world.rank)
    host = a2a.Comm.from_mpi(world)
    over_mpi = a2a.Comm.from_mpi(world, device="cuda")
    nccl_process_group(world)
    from_torch = a2a.Comm.from_torch()
    assert from_torch.control_group is not None  # a gloo group made for the world, beside NCCL
    tally = Tally(world)
    for label, comm in (("nccl(mpi)", over_mpi), ("nccl(torch)", from_torch)):
        assert (comm.device, comm.transport) == ("cuda", "nccl"), (label, comm.device, comm.transport)
        every_algorithm(tally, label, host, comm)
        graph_replay(tally, label, host, comm)
    status = tally.finish(f"NCCL over MPI and from a torch NCCL group, {world.size} rank(s)")
    dist.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main())
