"""torchrun on CPUs, as a new user launches: Tutel's helloworld with one
import changed trains over the gloo group (a2a.Comm.from_torch on the CPU,
a2a/_torch_transport.py) to the same losses as under mpirun, and resumes from
its checkpoints; a rank that never calls turns into a timeout on the others,
and a rank that dies into an error at once. (The collectives and the layer
under torchrun: tests/run_mpi.py's torchrun-* configurations.)"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from launcher import torchrun

pytest.importorskip("torch")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HELLOWORLD = os.path.join(ROOT, "examples", "tutel", "helloworld.py")
LOSS = re.compile(r"^STEP-(\d+): loss = (\S+),", re.MULTILINE)


def losses(done: subprocess.CompletedProcess) -> list[str]:
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [loss for _, loss in LOSS.findall(done.stdout)]


def test_tutel_helloworld_trains_under_torchrun_as_under_mpirun(tmp_path):
    args = [HELLOWORLD, "--device", "cpu", "--num_steps", "6"]
    over_gloo = torchrun(2, args)
    assert "CPU collectives over torch.distributed (gloo)" in over_gloo.stderr  # said once, by rank 0
    assert over_gloo.stderr.count("CPU collectives over torch.distributed") == 1
    env = {k: v for k, v in os.environ.items() if not k.startswith("A2A_")}
    over_mpi = subprocess.run([sys.executable, "-m", "a2a.launch", "--np", "2", "--", sys.executable, *args],
                              capture_output=True, text=True, check=False, timeout=180, env=env)
    trained = losses(over_gloo)
    assert len(trained) == 6 and trained == losses(over_mpi)  # the same seeds, the same losses, digit for digit
    assert float(trained[-1]) < float(trained[0])
    # The checkpoint round trip: three steps saved, three more from the files.
    checkpoint = ["--checkpoint_path", str(tmp_path / "ckpt-{rank}-of-{size}.pt")]
    first = losses(torchrun(2, [HELLOWORLD, "--device", "cpu", "--num_steps", "3", *checkpoint]))
    resumed = losses(torchrun(2, [HELLOWORLD, "--device", "cpu", "--num_steps", "3", *checkpoint]))
    assert sorted(os.listdir(tmp_path)) == ["ckpt-0-of-2.pt", "ckpt-1-of-2.pt"]
    assert first + resumed == trained  # SGD keeps no state: resumed steps are steps 3..5


def test_tutels_own_helloworld_trains_with_only_the_moe_import_changed(tmp_path):
    """Tutel's examples/helloworld.py itself, where Tutel is installed (make peers): its `system` and
    `net` still come from Tutel, its MoE layer from here. Skipped where Tutel is not installed (CI)."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("tutel.examples.helloworld")
    except ImportError:
        spec = None
    if spec is None or spec.origin is None:
        pytest.skip("Tutel is not installed (make peers)")
    with open(spec.origin) as source:
        text = source.read()
    changed = text.replace("from tutel import moe as tutel_moe", "from moe_runtime import moe as tutel_moe")
    assert changed.count("from moe_runtime import moe as tutel_moe") == 1, "Tutel's helloworld imports moe otherwise"
    script = tmp_path / "helloworld.py"
    script.write_text(changed + "\nassert type(model._moe_layer).__module__.startswith('moe_runtime'), "
                                "type(model._moe_layer)\n")
    trained = losses(torchrun(2, [str(script), "--device", "cpu", "--num_steps", "4", "--batch_size", "4",
                                  "--num_tokens", "64", "--model_dim", "64", "--hidden_size", "128"]))
    assert len(trained) == 4 and float(trained[-1]) < float(trained[0]), trained


FAULT = """
import os, sys, time
import numpy as np
import torch.distributed as dist
import a2a
dist.init_process_group("gloo")
comm = a2a.Comm.from_torch(device="cpu", timeout_s=3)
x = np.ones(4 * comm.size, np.float32)
a2a.all_to_all(x, comm=comm)
if comm.rank == 1:
    if sys.argv[1] in ("dies", "died"):
        os._exit(0)  # exit code 0: torchrun waits for rank 0 instead of killing it
    time.sleep(8)  # never makes the second call
    os._exit(0)
if sys.argv[1] == "died":
    time.sleep(1.5)  # the peer's connection is closed before this rank posts: the post itself fails
started = time.monotonic()
try:
    a2a.all_to_all(x, comm=comm)
    print("NO ERROR", flush=True)
except a2a.A2AError as error:
    print(f"RAISED {type(error).__name__} after {time.monotonic() - started:.1f} s: {error}", flush=True)
os._exit(0)  # the abandoned receive stays in gloo; a clean shutdown would wait for it
"""


@pytest.mark.parametrize("fault", ["skips", "dies", "died"])
def test_a_peer_that_never_calls_or_dies_raises_on_the_others(tmp_path, fault):
    script = tmp_path / "fault.py"
    script.write_text(FAULT)
    done = torchrun(2, [str(script), fault], A2A_QUIET="1")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    raised = re.search(r"RAISED (\w+) after ([\d.]+) s: (.*)", done.stdout)
    assert raised, done.stdout[-2000:] + done.stderr[-2000:]
    kind, seconds, message = raised.group(1), float(raised.group(2)), raised.group(3)
    assert "rank 0 of 2" in message and "rank 1" in message, message
    if fault == "skips":  # bounded by the communicator's timeout
        assert kind == "A2ATimeoutError" and 2.5 < seconds < 6, (kind, seconds, message)
    else:  # gloo sees the closed connection: no wait for the timeout
        assert kind == "TransportError" and seconds < 2.5, (kind, seconds, message)
