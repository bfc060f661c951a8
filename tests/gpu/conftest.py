"""GPU tests: skipped, with the reason, without torch, a CUDA device, or a
CUDA build of a2a (a2a.config()["cuda"]).

For the GPU check, whose budget may stop a run before pytest's summary: a
failure's traceback is written the moment it fails, and with
A2A_TEST_HANG_S=N a test still running after N seconds has every thread's
stack dumped and ends the process (a device wait that never returns cannot
be interrupted from Python)."""

from __future__ import annotations

import faulthandler
import os
import sys

import pytest


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.failed:
        sys.__stderr__.write(f"\n----- {report.nodeid} failed ({report.when}):\n{report.longreprtext}\n-----\n")
        sys.__stderr__.flush()


_HANG_DUMP: dict[str, object] = {}


def pytest_configure(config: pytest.Config) -> None:
    # stderr as it is before pytest captures a test's output: a dump into the capture would be lost at the exit
    _HANG_DUMP["file"] = os.fdopen(os.dup(2), "w")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    limit = float(os.environ.get("A2A_TEST_HANG_S") or 0)
    if limit > 0:  # with pytest -v the hanging test's name is the last line before the stacks
        faulthandler.dump_traceback_later(limit, exit=True, file=_HANG_DUMP["file"])
    yield
    if limit > 0:
        faulthandler.cancel_dump_traceback_later()


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
