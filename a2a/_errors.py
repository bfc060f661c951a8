"""Exceptions raised by a2a. Each carries the core's status code in ``status``."""

from __future__ import annotations

__all__ = [
    "A2AError",
    "A2ATimeoutError",
    "InvalidArgumentError",
    "MismatchError",
    "RemoteError",
    "TransportError",
    "UnsupportedError",
    "from_status",
]

# Status codes of csrc/include/a2a/a2a.h (a2a_status_t).
_INVALID_ARGUMENT, _MISMATCH, _TIMEOUT, _TRANSPORT, _UNSUPPORTED, _REMOTE, _INTERNAL = range(1, 8)


class A2AError(RuntimeError):
    """Base class of every error raised by a2a."""

    status = _INTERNAL

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        if status is not None:
            self.status = status


class InvalidArgumentError(A2AError, ValueError):
    """This rank's input is invalid (shape, count, dtype, layout, axis, buffer)."""

    status = _INVALID_ARGUMENT


class MismatchError(A2AError, ValueError):
    """Ranks called a collective with arguments that must agree but do not."""

    status = _MISMATCH


class A2ATimeoutError(A2AError, TimeoutError):
    """A wait exceeded A2A_TIMEOUT_S; the message lists the unfinished peers."""

    status = _TIMEOUT


class TransportError(A2AError):
    """MPI (or NCCL) reported an error, or the communicator was retired."""

    status = _TRANSPORT


class UnsupportedError(A2AError):
    """The operation is not supported by this build or this communicator."""

    status = _UNSUPPORTED


class RemoteError(A2AError):
    """Another rank rejected its input, so this rank's collective was abandoned."""

    status = _REMOTE


_BY_STATUS = {
    cls.status: cls
    for cls in (InvalidArgumentError, MismatchError, A2ATimeoutError, TransportError, UnsupportedError, RemoteError)
}


def from_status(status: int, message: str) -> A2AError:
    """Builds the exception for a core status code (used by the native module)."""
    return _BY_STATUS.get(status, A2AError)(message, status)
