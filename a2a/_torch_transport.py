"""The transport of ``a2a.Comm.from_torch`` on CPU tensors: torch.distributed's
point-to-point messages over a group (gloo under torchrun), for a job with
no MPI beneath it. a2a's C++ algorithms call it back through
``a2a_transport_ops_t`` (csrc/python/py_transport.cpp): each message is the
group's own ``send`` / ``recv`` of a uint8 tensor viewing a2a's own memory
(no copy), tagged with its communicator's tag, and a call's messages are
awaited together, bounded by the communicator's timeout.

Under mpirun, MPI stays the transport of CPU communicators
(``Comm.from_job``): it is 2-40x faster than gloo on this project's
machines (docs/benchmarks.md, "torchrun on CPUs").
"""

from __future__ import annotations

import ctypes
import time
from datetime import timedelta
from typing import Any

# Each communicator made by from_torch takes a block of torch.distributed tags
# (its splits number theirs from 0 inside it): two communicators over the same
# ranks never share a tag, so a message that a failed call left in flight
# cannot be taken by another communicator's receive. The block is the largest
# next block of the group's ranks (agreed, as the ranks may have made
# communicators over other groups).
TAGS_PER_COMMUNICATOR = 1 << 16
_next_block = [0]


def agree_tag_base(group: Any) -> int:
    """Collective over `group`: the first tag of a new communicator's block."""
    import torch.distributed as dist

    blocks: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(blocks, _next_block[0], group=group)
    block = max(blocks)
    if (block + 1) * TAGS_PER_COMMUNICATOR > 2**31 - 1:
        raise RuntimeError(f"Comm.from_torch: this process made {block} communicators over torch.distributed; "
                           "their tags are used up (reuse communicators instead of making one per call)")
    _next_block[0] = block + 1
    return block * TAGS_PER_COMMUNICATOR


class TorchGroupTransport:
    """isend / irecv / wait over a torch.distributed group; peers are ranks of
    the group, tags offset by tag_base (agree_tag_base)."""

    def __init__(self, group: Any, tag_base: int):
        import torch
        import torch.distributed as dist

        self._torch, self.group, self.tag_base = torch, group, tag_base
        self.backend = str(dist.get_backend(group)).lower()
        self._pending: dict[int, tuple[Any, str, int, Any]] = {}  # request -> (work, what, peer, tensor)
        self._next = 0
        # Views of a2a's memory by (address, bytes): a call's buffers (the communicator's workspace, the
        # caller's arrays) recur, and a view owns nothing, so an old one serves whatever lives there now.
        self._views: dict[tuple[int, int], Any] = {}

    def _view(self, address: int, nbytes: int) -> Any:
        view = self._views.get((address, nbytes))
        if view is None:
            if len(self._views) >= 256:
                self._views.clear()
            view = self._views[(address, nbytes)] = self._torch.frombuffer(
                (ctypes.c_char * nbytes).from_address(address), dtype=self._torch.uint8)
        return view

    def _tag(self, tag: int) -> int:
        if tag >= TAGS_PER_COMMUNICATOR:  # every split takes two (a data and a control lane)
            raise RuntimeError(f"this communicator and its splits used up their {TAGS_PER_COMMUNICATOR} "
                               "torch.distributed tags (reuse sub-communicators instead of splitting per call)")
        return self.tag_base + tag

    def _post(self, post: Any, address: int, nbytes: int, what: str, peer: int, tag: int) -> int:
        """The request of post([a2a's memory as a tensor], peer, tag) (the group's send or recv); a failure to
        post (gloo: the peer's connection closed, its process died) names the peer, as a failed wait does."""
        tensor = self._view(address, nbytes)
        tag = self._tag(tag)
        try:
            work = post([tensor], peer, tag)
        except RuntimeError as error:
            raise RuntimeError(f"{what} rank {peer} over torch.distributed ({self.backend}): {error}") from None
        request = self._next
        self._next += 1
        self._pending[request] = (work, what, peer, tensor)  # the tensor lives until the wait
        return request

    # The group's own send / recv (ranks of the group): torch.distributed.isend's checks and rank
    # mapping cost as much as the message at small sizes.
    def isend(self, address: int, nbytes: int, peer: int, tag: int) -> int:
        return self._post(self.group.send, address, nbytes, "send to", peer, tag)

    def irecv(self, address: int, nbytes: int, peer: int, tag: int) -> int:
        return self._post(self.group.recv, address, nbytes, "receive from", peer, tag)

    def wait(self, requests: list[int], timeout_s: float) -> None:
        """Every request done, or TimeoutError naming the peers whose messages
        did not complete within timeout_s; a peer's failure (a closed
        connection: its process died) raises at once."""
        deadline = time.monotonic() + timeout_s
        late: list[str] = []
        try:
            for request in requests:
                work, what, peer, _ = self._pending[request]
                if late:  # past the deadline already: only see which others are done
                    if not work.is_completed():
                        late.append(f"{what} rank {peer}")
                    continue
                try:
                    work.wait(timeout=timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
                except RuntimeError as error:
                    if "timed out" not in str(error).lower() and "timeout" not in str(error).lower():
                        raise RuntimeError(f"{what} rank {peer} over torch.distributed ({self.backend}): "
                                           f"{error}") from None
                    late.append(f"{what} rank {peer}")
        finally:
            for request in requests:
                self._pending.pop(request, None)
        if late:
            raise TimeoutError(f"no completion within {timeout_s:g} s (A2A_TIMEOUT_S) over torch.distributed "
                               f"({self.backend}): {', '.join(late)}")
