#!/usr/bin/env python3
"""The peers of the layer step, from the kit into the check's prefix, on the
GPU machine (no network): Megatron-Core's wheel, and Tutel from its source,
whose CUDA extension (tutel_custom_kernel) compiles here against the
image's torch, CUDA and NCCL wheel. Then each is imported, and Tutel's layer
runs one forward on the GPU. moe_runtime.bench --gpu-step measures what got
installed; a peer that did not has the row "not installed".

    install_peers.py KIT PREFIX WORK          install (exit 1 if a peer is missing after it)
    install_peers.py KIT PREFIX WORK --dry    what the kit carries, nothing installed (exit 0)

Run by tools/gpu_check/stages.py with the check's environment (PYTHONPATH
at the prefix's site-packages, nvcc on PATH).
"""

from __future__ import annotations

import glob
import importlib.util
import os
import subprocess
import sys
import tarfile
import time

PIP = [sys.executable, "-m", "pip", "install", "--isolated", "--quiet", "--no-index", "--no-deps", "--no-compile",
       "--ignore-installed"]
PROBE = """
import importlib.metadata as m, torch
from tutel import moe
layer = moe.moe_layer(gate_type={"type": "top", "k": 2}, model_dim=64, experts={"type": "ffn", "count_per_node": 2,
    "hidden_size_per_expert": 64, "activation_fn": torch.relu}).cuda()
y = layer(torch.randn(16, 64, device="cuda"))
torch.cuda.synchronize()
import megatron.core
print("tutel", m.version("tutel"), "on", torch.cuda.get_device_name(), "; megatron-core", megatron.core.__version__)
"""


def carried(kit: str) -> tuple[list[str], str | None, str]:
    """(Megatron-Core wheels, Tutel's source archive or None, why Tutel is missing)."""
    peers = os.path.join(kit, "peers")
    wheels = sorted(glob.glob(os.path.join(peers, "megatron_core-*.whl")))
    archive = os.path.join(peers, "tutel-src.tar.gz")
    missing = os.path.join(peers, "TUTEL_MISSING")
    why = ""
    if os.path.exists(missing):
        with open(missing, encoding="utf-8") as fh:
            why = fh.read().strip().splitlines()[-1]
    return wheels, archive if os.path.exists(archive) else None, why or "no tutel-src.tar.gz in the kit"


def nccl_paths() -> tuple[str, str] | None:
    """(include, lib) of the NCCL wheel beside torch, for Tutel's NCCL extension."""
    spec = importlib.util.find_spec("nvidia.nccl")
    if spec is None or not spec.submodule_search_locations:
        return None
    root = next(iter(spec.submodule_search_locations))
    return os.path.join(root, "include"), os.path.join(root, "lib")


def gpu_arch() -> str:
    """This GPU's compute capability, as TORCH_CUDA_ARCH_LIST spells it ("9.0")."""
    probe = subprocess.run([sys.executable, "-c", "import torch; print('%d.%d' % torch.cuda.get_device_capability())"],
                           capture_output=True, text=True, check=False)
    return probe.stdout.strip() or "9.0"


def main(argv: list[str]) -> int:
    kit, prefix, work = argv[:3]
    dry = "--dry" in argv[3:]
    wheels, archive, why = carried(kit)
    print(f"kit: megatron-core {'carried' if wheels else 'missing'} ({', '.join(map(os.path.basename, wheels))}); "
          f"tutel {'carried' if archive else f'missing: {why}'}", flush=True)
    if dry:
        return 0
    status = 0
    started = time.monotonic()
    if wheels:
        subprocess.run([*PIP, "--find-links", os.path.dirname(wheels[0]), "--prefix", prefix, "megatron-core"],
                       check=False)
        print(f"megatron-core installed after {time.monotonic() - started:.1f} s", flush=True)
    if archive:
        source = os.path.join(work, "tutel-src")
        with tarfile.open(archive) as tar:
            tar.extractall(source, filter="data")
        env = dict(os.environ)
        found = nccl_paths()
        if found:  # else Tutel's setup.py builds its extension without NCCL (it falls back by itself)
            for name, path in (("CPATH", found[0]), ("LIBRARY_PATH", found[1])):
                env[name] = os.pathsep.join(p for p in (path, env.get(name)) if p)
            # its setup.py links -lnccl: the wheel has libnccl.so.2 only
            link = os.path.join(work, "nccl-link")
            os.makedirs(link, exist_ok=True)
            target = os.path.join(found[1], "libnccl.so.2")
            if os.path.exists(target) and not os.path.exists(os.path.join(link, "libnccl.so")):
                os.symlink(target, os.path.join(link, "libnccl.so"))
            env["LIBRARY_PATH"] = os.pathsep.join([link, env["LIBRARY_PATH"]])
        env["MAX_JOBS"] = str(os.cpu_count() or 4)
        # torch's extension builder compiles for this GPU only (unset, it may add every architecture it knows)
        env.setdefault("TORCH_CUDA_ARCH_LIST", gpu_arch())
        subprocess.run([*PIP, "--no-build-isolation", "--prefix", prefix, source], env=env, check=False)
        print(f"tutel compiled and installed after {time.monotonic() - started:.1f} s "
              f"(TORCH_CUDA_ARCH_LIST={env['TORCH_CUDA_ARCH_LIST']})", flush=True)
    probe = subprocess.run([sys.executable, "-c", PROBE], check=False)
    print(f"probe exit {probe.returncode} after {time.monotonic() - started:.1f} s", flush=True)
    if probe.returncode != 0 or not wheels or not archive:
        status = 1
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
