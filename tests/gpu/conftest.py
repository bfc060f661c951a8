"""GPU tests: skipped, with the reason, without torch, a CUDA device, or a
CUDA build of a2a (a2a.config()["cuda"])."""

from __future__ import annotations

import pytest


def _missing() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    import a2a

    if not a2a.config()["cuda"]:
        return "a2a was built without CUDA (a2a.config()['cuda'] is False)"
    return None


@pytest.fixture(scope="session")
def cuda_available() -> None:
    reason = _missing()
    if reason is not None:
        pytest.skip(reason)


@pytest.fixture(autouse=True)
def _requires_cuda(cuda_available) -> None:
    """Every test here needs the GPU."""
