"""One rank of a network-fault test (tests/cluster/test_faults.py): calls one collective, or one training
step of MoELayer, over and over on the namespace cluster, checking every result against its reference,
until a call raises or, with --until-stop, until the driver asks the job to stop.

    python tests/cluster/fault_job.py --op linear|2dh|flex|v|layer --out DIR [--per-peer N] [--until-stop]

Each rank writes DIR/ready<R> once its first call has returned, and at the end
DIR/rank<R>.json: its calls, how many were wrong, and the error it raised (type, message, wall time)
with, under --until-stop, each call's wall-clock start and end. A rank that raised leaves with status 1
at once (os._exit): MPI_Finalize would wait for peers it can no longer reach.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
# tests/reference.py, and tests/mpi_runtime/runtime_util.py for the layer
sys.path[:0] = [os.path.dirname(HERE), os.path.join(os.path.dirname(HERE), "mpi_runtime")]

import reference as ref

import a2a

OPS = ("linear", "2dh", "flex", "v", "layer")
ROW = 4  # int32 columns per row: a row of 16 bytes


def collective(op: str, comm: a2a.Comm, per_peer: int):
    """(a call, the result it must return) of `op`, per_peer rows to each peer."""
    rank, world = comm.rank, comm.size
    if op in ("linear", "2dh"):
        shape = (world * per_peer, ROW)
        x = ref.a2a_input(op, rank, world, shape, "int32")
        return lambda: a2a.all_to_all(x, comm=comm, algo=op), ref.a2a_expected(op, rank, world, shape, "int32")
    if op == "flex":  # split the columns, concatenate the rows: MoE's combine
        shape = (per_peer, world * ROW)
        x = ref.flex_input(op, rank, world, shape, 1, "int32")
        want = ref.flex_expected(op, rank, world, shape, 1, 0, "int32")
        return lambda: a2a.all_to_all_flex(x, comm=comm, split_axis=1, concat_axis=0), want
    counts = ref.v_counts("varied", world) * per_peer  # uneven, some zero
    x = ref.v_input(op, rank, counts, (ROW,), "int32")
    return lambda: a2a.all_to_all_v(x, counts[rank], comm=comm)[0], ref.v_expected(op, rank, counts, (ROW,), "int32")[0]


def training_step(comm: a2a.Comm):
    """(one forward and backward of MoELayer, its (y, x.grad) from the float64 reference). The layer's
    all-to-alls alone: no all-reduce of the shared gradients, whose wait could name no peer."""
    import torch
    from runtime_util import make_layer, reference, tokens_of, upstream_of

    layer = make_layer(comm, 2 * comm.size, torch.float64)
    want = reference(layer, comm, torch.float64, capacity_factor=1.0)

    def step():
        x = tokens_of(comm.rank, torch.float64).requires_grad_(True)
        layer.zero_grad(set_to_none=True)
        y = layer(x)
        ((y * upstream_of(comm.rank, torch.float64)).sum() + y.l_aux).backward()
        return torch.cat([y.detach().flatten(), x.grad.flatten()]).numpy()

    return step, torch.cat([want[0].flatten(), want[1].flatten()]).numpy()


def exact(got: np.ndarray, want: np.ndarray, op: str) -> bool:
    if op == "layer":  # float64 against the float64 reference, summed in another order
        return got.shape == want.shape and bool(np.abs(got - want).max() <= 1e-12 * max(1.0, np.abs(want).max()))
    return got.shape == want.shape and bool(np.array_equal(got, want))


def write(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as out:
        out.write(text)
    os.replace(path + ".tmp", path)  # the driver never reads half a file


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--op", choices=OPS, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--per-peer", type=int, default=1024, help="rows of 16 bytes to each peer")
    parser.add_argument("--until-stop", action="store_true",
                        help="stop, all ranks after the same call, once DIR/stop exists")
    args = parser.parse_args()

    comm = a2a.Comm.from_mpi()
    call, want = training_step(comm) if args.op == "layer" else collective(args.op, comm, args.per_peer)
    record: dict = {"rank": comm.rank, "op": args.op, "calls": 0, "wrong": 0, "error": None, "times": []}
    stop = os.path.join(args.out, "stop")
    try:
        while True:
            start = time.time()
            got = call()
            if args.until_stop:
                record["times"].append([start, time.time()])
            record["calls"] += 1
            record["wrong"] += not exact(got, want, args.op)
            if record["calls"] == 1:
                write(os.path.join(args.out, f"ready{comm.rank}"), str(time.time()))
            # The ranks agree on stopping through the library too, so that this wait is bounded as well.
            if args.until_stop and a2a.all_reduce(np.array([os.path.exists(stop)], np.int32), comm=comm,
                                                  op="max")[0]:
                break
    except a2a.A2AError as error:
        record.update(error=type(error).__name__, message=str(error), raised_at=time.time())
    write(os.path.join(args.out, f"rank{comm.rank}.json"), json.dumps(record))
    if record["error"]:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    return 0 if record["wrong"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
