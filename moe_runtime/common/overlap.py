"""Adaptive pipelining (Tutel Section 3.2): d chunks of exchange -> expert -> exchange.

Only the two all-to-alls and the expert between them are split, along the
capacity axis (the gate, the routing and Batch Prioritized Routing see the
whole batch). Chunk i's exchanges overlap chunk i +- 1's expert compute.
Every rank issues the exchanges in the same order, whatever the timing::

    exchanges:  B0 B1 A0 B2 A1 B3 A2 ... A(d-1)      (B = before, A = after the expert)
    compute:       X0    X1    X2    ...

- CPU: the exchanges run on one communication thread with its own
  communicator (the collectives release the GIL while they wait; the main
  thread makes no MPI call meanwhile, so MPI_THREAD_SERIALIZED suffices).
- CUDA: they run on a communication stream, ordered against the compute
  stream by events; nothing waits on the host.
- d = 1, or a single chunk: the three run in order on the calling thread.

:meth:`Overlap.start` runs one task on the same thread (and stream): the
sample-assignment cache's predicted dispatch, overlapping the gate.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import torch

import a2a

__all__ = ["Overlap", "check_thread_level"]

THREAD_LEVELS_THAT_OVERLAP = ("serialized", "multiple")


def check_thread_level(comm: a2a.Comm, task: str | None = None) -> None:
    """A communication thread needs MPI_THREAD_SERIALIZED or more (every rank
    has the same level, so every rank raises alike). `task`: what runs on the
    thread by :meth:`Overlap.start` (on every device: a CUDA communicator's
    calls go through MPI too, its argument check at least); None: pipelining,
    which runs on a thread on the CPU only (on CUDA, on a stream of the
    calling thread)."""
    level = comm.mpi_thread_level
    if level is None or level in THREAD_LEVELS_THAT_OVERLAP:
        return
    if task is None:
        if comm.device != "cpu":
            return
        task = "pipelining (a2a_ffn_overlap_degree > 1) on CPU runs the exchanges"
    raise a2a.UnsupportedError(
        f"{task} on a thread, which needs MPI_THREAD_SERIALIZED or MPI_THREAD_MULTIPLE; MPI granted {level!r} on "
        f"rank {comm.rank} (initialize MPI with a higher level, e.g. mpi4py.rc.thread_level = 'multiple')"
    )


class Overlap:
    """Runs `before(i)`, `compute(i)`, `after(i)` for d chunks with the
    exchanges (before, after) off the compute path."""

    def __init__(self, device: str, cuda_device: int | None = None):
        self.device = device
        # The communicator's GPU: its current stream is the compute stream, whatever the current device.
        self.cuda_device = cuda_device
        self._executor: ThreadPoolExecutor | None = None
        self._stream: Any = None

    def __deepcopy__(self, memo: dict[int, Any]) -> Overlap:
        """The same settings; the copy starts its own thread and stream when it needs them."""
        return Overlap(self.device, self.cuda_device)

    def run(self, chunks: int, before: Callable[[int], None], compute: Callable[[int], None],
            after: Callable[[int], None]) -> None:
        if chunks == 1:
            before(0)
            compute(0)
            after(0)
        elif self.device == "cuda":
            self._run_streams(chunks, before, compute, after)
        else:
            self._run_thread(chunks, before, compute, after)

    def _run_thread(self, chunks: int, before, compute, after) -> None:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moe-exchange")
        grad_mode = torch.is_grad_enabled()  # thread-local in torch: carry the caller's to the thread
        failed = threading.Event()

        def guarded(step: Callable[[int], None], i: int) -> None:
            # Once an exchange failed, the exchanges queued behind it do not start: the caller raises that
            # error, and another exchange would wait for peers that raised it too (a layer whose kept
            # agreement a rank did not keep gathers on this communicator next: flows/kept.py).
            if failed.is_set():
                return
            try:
                _with_grad_mode(grad_mode, step, i)
            except BaseException:
                failed.set()
                raise

        def submit(step: Callable[[int], None], i: int) -> Future:
            return self._executor.submit(guarded, step, i)

        befores: list[Future] = [submit(before, 0), submit(before, 1)]
        afters: list[Future] = []
        try:
            for i in range(chunks):
                befores[i].result()
                compute(i)
                afters.append(submit(after, i))
                if i + 2 < chunks:
                    befores.append(submit(before, i + 2))
            for future in afters:
                future.result()
        except BaseException:
            # Nothing may still write the buffers once this call returns.
            for future in befores + afters:
                future.cancel()
            wait(befores + afters)  # their own errors, if any, follow from the one raised
            raise

    def _run_streams(self, chunks: int, before, compute, after) -> None:
        main = torch.cuda.current_stream(self.cuda_device)
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=main.device)
        side = self._stream
        side.wait_stream(main)  # the inputs of the chunks were written on main

        def exchange(step: Callable[[int], None], i: int, wait: Any = None) -> Any:
            with torch.cuda.stream(side):
                if wait is not None:
                    side.wait_event(wait)
                step(i)
                return side.record_event()

        ready = [exchange(before, 0)]
        for i in range(chunks):
            if i + 1 < chunks:
                ready.append(exchange(before, i + 1))
            main.wait_event(ready[i])
            compute(i)
            exchange(after, i, main.record_event())
        main.wait_stream(side)

    def start(self, task: Callable[[], Any]) -> Callable[[], Any]:
        """Starts `task` (exchanges only, no autograd recording) on the
        communication thread, off the caller's path; returns the function
        that waits for it and gives its result (or raises its error). The
        caller makes no call on the task's communicator until then. On CUDA
        the task also runs on the communication stream, after the work
        queued so far on the caller's stream; its result is ready for the
        caller's stream once the wait returns."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moe-exchange")
        if self.device != "cuda":
            return self._executor.submit(_without_grad, task).result
        main = torch.cuda.current_stream(self.cuda_device)
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=main.device)
        side, inputs_ready = self._stream, main.record_event()

        def on_side_stream() -> tuple[Any, Any]:
            with torch.cuda.stream(side):  # the current stream is per thread
                side.wait_event(inputs_ready)
                return task(), side.record_event()

        future = self._executor.submit(_without_grad, on_side_stream)

        def wait() -> Any:
            result, done = future.result()
            main.wait_event(done)
            return result

        return wait

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None


def _without_grad(task: Callable[[], Any]) -> Any:
    with torch.no_grad():
        return task()


def _with_grad_mode(enabled: bool, step: Callable[[int], None], i: int) -> None:
    with torch.set_grad_enabled(enabled):
        step(i)
