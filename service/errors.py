"""Errors that carry their gRPC status. Raise these anywhere; one interceptor turns them into statuses.

Every class has the same attributes (code, message), so the mapper can never crash on the error it
should report (kserve's trap).
"""

from __future__ import annotations

import grpc

# Messages may quote what a client sent (a model name, a tensor name). A status travels in trailing
# metadata, percent-encoded (3 bytes for each byte outside printable ASCII), and clients refuse
# metadata past 8 KiB by default: a long message is cut here, for every API, to this encoded size.
MAX_MESSAGE_BYTES = 2048


class ServiceError(Exception):
    """Base of every error a client may see; `message` is safe to send (no stack traces, no secrets)."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(ServiceError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(ServiceError):
    code = grpc.StatusCode.NOT_FOUND


class ResourceExhausted(ServiceError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(ServiceError):
    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(ServiceError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Cancelled(ServiceError):
    code = grpc.StatusCode.CANCELLED


class Unauthenticated(ServiceError):
    code = grpc.StatusCode.UNAUTHENTICATED


class Internal(ServiceError):
    """A bug or an engine failure; the message stays short and the details go to the log."""

    code = grpc.StatusCode.INTERNAL


def to_status(error: BaseException) -> tuple[grpc.StatusCode, str]:
    """The one map from an exception to what a client sees: a ServiceError's own status, INTERNAL else.

    Anything that is not a ServiceError is a bug; its text may hold internals, so it never leaves.
    """
    if isinstance(error, ServiceError):
        return error.code, shorten(error.message)
    return grpc.StatusCode.INTERNAL, "internal error"


def shorten(message: str, limit: int = MAX_MESSAGE_BYTES) -> str:
    """The message, cut so that its percent-encoded form (as gRPC sends it) stays under `limit` bytes."""
    size = 0
    for i, ch in enumerate(message):
        size += 1 if " " <= ch <= "~" and ch != "%" else 3 * len(ch.encode("utf-8", "surrogatepass"))
        if size > limit - 64:
            return message[:i] + f"... (cut: {len(message)} characters in all)"
    return message
